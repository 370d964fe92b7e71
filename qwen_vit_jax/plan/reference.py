"""HF-exact index functions: what HF transformers computes from `grid_thw`, element for element.

HF derives rotary ids, per-frame cu_seqlens and the Qwen2.5-VL window permutation with small
data-dependent torch ops (and host syncs) on every call; here they are pure functions of
(grid_thw, config), built by the same numba kernels as the plan, and tests pin them equal to
`transformers.vision_utils`. Also here: `to_spatial`, which undoes HF's patch order.
"""

from __future__ import annotations

import numpy as np

from ..config import VisionConfig
from . import kernels
from .grid import validate_grid


def rotary_ids(grid_thw, cfg: VisionConfig) -> np.ndarray:
    """int32 [N, 2] (h, w) rotary ids == HF `get_vision_position_ids(grid_thw, merge)`."""
    g = validate_grid(grid_thw, cfg)
    out = np.empty((int(np.prod(g, axis=1).sum()), 2), np.int32)
    kernels.fill_rotary_ids(g, cfg.spatial_merge_size, out.reshape(-1))
    return out


def frame_cu_seqlens(grid_thw) -> np.ndarray:
    """int32 [F + 1] per-frame segment boundaries == HF `get_vision_cu_seqlens(grid_thw)`."""
    return kernels.frame_starts(validate_grid(grid_thw)).astype(np.int32)


def _window_order(g: np.ndarray, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """window_index of a validated grid."""
    windows = kernels.window_table(g, cfg.spatial_merge_size, cfg.window_merge)
    index = np.empty(int(np.prod(g, axis=1).sum()) // cfg.merge_unit, np.int64)
    cu = np.empty(windows.shape[0] + 1, np.int32)
    kernels.fill_window_order(windows, cfg.spatial_merge_size, index, cu)
    return index, cu


def window_index(grid_thw, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(int64 [N / merge_unit], int32 [W + 1]) == HF `get_vision_window_index` (after its
    `unique_consecutive`). Only for windowed (Qwen2.5-VL) configs."""
    if not cfg.windowed:
        raise ValueError(f"window_index needs a windowed config (variant {cfg.variant!r} has no windows)")
    return _window_order(validate_grid(grid_thw, cfg), cfg)


def segment_lengths(grid_thw, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(frame lengths int64 [F], window lengths int64 [W]) in rows (patches), in HF order; the
    window array is empty when `cfg` has no windows. The real attention segments, for an analytic
    (ideal) cost: full attention costs ~ sum(F_i^2), window attention ~ sum(W_i^2)."""
    g = validate_grid(grid_thw, cfg)
    frames = np.repeat(g[:, 1] * g[:, 2], g[:, 0])
    if not cfg.windowed:
        return frames, np.zeros(0, np.int64)
    _, cu = _window_order(g, cfg)
    return frames, np.diff(cu).astype(np.int64)


def to_spatial(rows, grid_thw, cfg: VisionConfig) -> list:
    """A request's rows as one [..., t, h, w, C] array per image or video.

    Args:
      rows: [..., R, C] NumPy or JAX array: patch rows (R = sum(t * h * w): hidden states) or merged
        tokens (R = sum(t * h * w) / merge_unit: what `encode` returns), told apart by R; leading
        axes (e.g. [depth + 1] of hidden states) are kept.
      grid_thw: [k, 3] the request's grid.
    Returns:
      k arrays: [..., t, h, w, C] for patch rows, [..., t, h / m, w / m, C] for tokens
      (m = spatial_merge_size), in raster order: element [.., f, y, x, :] is the patch (or 2x2
      merged patch) at row y, column x of frame f. Within a frame, patch rows come in merge-unit
      order (m x m patches of one merge unit consecutive, units in raster order over the merged
      grid); this undoes it.
    """
    g = validate_grid(grid_thw, cfg)
    m = cfg.spatial_merge_size
    n = int((g[:, 0] * g[:, 1] * g[:, 2]).sum())
    total = rows.shape[-2]
    if total not in (n, n // (m * m)):
        raise ValueError(f"to_spatial: rows has {total} rows; grid_thw has {n} patches ({n // (m * m)} merged tokens)")
    merged = total != n or m == 1
    lead, c = rows.shape[:-2], rows.shape[-1]
    out, start = [], 0
    for t, h, w in g.tolist():
        if merged:
            size = t * (h // m) * (w // m)
            out.append(rows[..., start : start + size, :].reshape(*lead, t, h // m, w // m, c))
        else:
            size = t * h * w
            x = rows[..., start : start + size, :].reshape(*lead, t, h // m, w // m, m, m, c)
            k = len(lead)  # [.., t, hb, wb, i, j, C] -> [.., t, hb, i, wb, j, C] -> [.., t, h, w, C]
            x = x.transpose(*range(k), k, k + 1, k + 3, k + 2, k + 4, k + 5)
            out.append(x.reshape(*lead, t, h, w, c))
        start += size
    return out
