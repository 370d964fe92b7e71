"""A request's pixels checked against the tower and its grid, once, in one place: float rows or
uint8 `Patches` (shapes, dtype, finiteness, the lookup table), then PaddleOCR-VL's raster rows put
in merge-unit order (the one row reorder of the host path). No jax here.
"""

from __future__ import annotations

import numpy as np

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.config import VisionConfig


def checked_pixels(pixel_values, grid: planlib.Grid, cfg: VisionConfig, check_finite: bool = True):
    """pixel_values ([N, patch_dim] float rows, or `Patches`) checked for a validated grid, its rows
    in merge-unit order: an [N, patch_dim] array or `Patches`.

    check_finite: reject NaN / Inf in float rows with a ValueError naming the image and its first
    bad row (one pass over the pixels)."""
    if isinstance(pixel_values, planlib.Patches):
        return _patches(pixel_values, grid, cfg)
    px = np.asarray(pixel_values)
    if px.ndim != 2:
        raise ValueError(f"pixel_values must be 2-D [N, {cfg.patch_dim}], got shape {px.shape}")
    if px.shape[1] != cfg.patch_dim:
        raise ValueError(
            f"pixel_values rows have {px.shape[1]} values, expected {cfg.patch_dim} "
            f"(= in_channels {cfg.in_channels} * temporal_patch_size {cfg.temporal_patch_size} "
            f"* patch_size {cfg.patch_size}^2): preprocess with this checkpoint's settings, "
            "qvj.preprocess_images(images, config=enc.preprocess) or "
            "qvj.preprocess_video(video, config=enc.video_preprocess) (or enc.encode_images / enc.encode_video)"
        )
    if not (np.issubdtype(px.dtype, np.floating) or np.issubdtype(px.dtype, np.integer)):
        raise ValueError(f"pixel_values must be numeric, got dtype {px.dtype}")
    if px.shape[0] != grid.patches:
        raise ValueError(f"pixel_values has {px.shape[0]} rows but grid_thw implies sum(t*h*w) = {grid.patches}")
    if check_finite:
        check_finite_rows(px, grid.array)
    return merge_unit_order(px, grid, cfg)


def _patches(patches: planlib.Patches, grid: planlib.Grid, cfg: VisionConfig) -> planlib.Patches:
    """`Patches` checked against this tower and the grid (rows, frames per row, patch, channels,
    dtype, a finite table), their rows in merge-unit order."""
    data, table = np.asarray(patches.data), np.asarray(patches.table)
    want = (grid.patches, "S", cfg.patch_size, cfg.patch_size, cfg.in_channels)
    if data.ndim != 5 or data.shape[2:] != want[2:] or data.shape[1] not in (1, cfg.temporal_patch_size):
        raise ValueError(
            f"Patches.data must be uint8 [N, S, p, p, C] = [{grid.patches}, 1 or {cfg.temporal_patch_size}, "
            f"{cfg.patch_size}, {cfg.patch_size}, {cfg.in_channels}] for this tower, got shape {data.shape}: "
            "preprocess with this checkpoint's settings, config=enc.preprocess / enc.video_preprocess"
        )
    if data.shape[0] != grid.patches:
        raise ValueError(f"Patches hold {data.shape[0]} rows but grid_thw implies sum(t*h*w) = {grid.patches}")
    if data.dtype != np.uint8:
        raise ValueError(f"Patches.data must be uint8, got dtype {data.dtype}")
    if patches.temporal_patch_size != cfg.temporal_patch_size:
        raise ValueError(
            f"Patches for temporal_patch_size {patches.temporal_patch_size}; the tower's is {cfg.temporal_patch_size}"
        )
    if table.shape != (cfg.in_channels, 256) or table.dtype != np.float32 or not np.isfinite(table).all():
        raise ValueError(
            f"Patches.table must be finite float32 [{cfg.in_channels}, 256], got {table.dtype} {table.shape}"
        )
    return planlib.Patches(merge_unit_order(data, grid, cfg), table, patches.temporal_patch_size)


def merge_unit_order(rows: np.ndarray, grid: planlib.Grid, cfg: VisionConfig) -> np.ndarray:
    """rows [N, ...] in the tower's patch order: PaddleOCR-VL's raster rows per frame gathered into
    merge units (exact, on the host); every other tower's rows as they are."""
    if not cfg.raster_rows:
        return rows
    return rows[planlib.raster_to_merge_order(grid.array, cfg.spatial_merge_size)]


def check_finite_rows(pixel_values: np.ndarray, grid_thw) -> None:
    """Raise ValueError if pixel_values [N, P] holds a NaN or Inf, naming the image (its row in
    grid_thw, validated) and its first bad row. One pass over the pixels when all is finite (a
    sum: NaN / Inf propagate; a finite overflow only sends us to the exact search)."""
    if not np.issubdtype(pixel_values.dtype, np.floating) or np.isfinite(pixel_values.sum(dtype=np.float64)):
        return
    bad = ~np.isfinite(pixel_values).all(axis=1)  # [N]
    if not bad.any():
        return
    row = int(np.argmax(bad))
    g = np.asarray(grid_thw, np.int64)
    ends = np.cumsum(g[:, 0] * g[:, 1] * g[:, 2])  # [k] one past each image's last row
    image = int(np.searchsorted(ends, row, side="right"))
    first = row - (int(ends[image - 1]) if image else 0)
    value = pixel_values[row][~np.isfinite(pixel_values[row])][0]
    raise ValueError(
        f"pixel_values holds non-finite values: image {image} (grid_thw row {image} = "
        f"{g[image].tolist()}), its row {first} (pixel_values row {row}) has {value}; "
        f"{int(bad.sum())} bad row(s) in all"
    )
