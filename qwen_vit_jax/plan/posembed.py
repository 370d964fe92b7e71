"""Host-side resampling of the learned position table (Qwen3-VL / Qwen3.5 / PaddleOCR-VL), in numba.

Qwen3-VL and Qwen3.5 learn a square table of `num_position_embeddings` = side x side rows (48 x 48
for the released towers) and resample it to every image's (h, w) patch grid with a bilinear,
align_corners=True interpolation. As in HF (`get_vision_interpolation_indices_and_weights` with
mode="bilinear", align_corners=True, spatial_merge_size=m), that interpolation is written as a
gather: per patch, 4 table rows and 4 weights, and the position embedding of the patch is

    pos[n] = sum_k weights[n, k] * table[indices[n, k]]        table: [side * side, D]

The 4 taps are (r0, c0), (r0, c1), (r1, c0), (r1, c1) in that order, with r0 = floor(src_row),
r1 = r0 + 1, both clamped to [0, side - 1], src_row = row * (side - 1) / max(h - 1, 1)
(align_corners=True: Qwen3) or (row + 0.5) * side / h - 0.5 (align_corners=False: PaddleOCR-VL,
whose first tap can clamp from -1 to 0), weights 1 - |src - tap| from the unclamped taps, and
likewise for columns; index = r * side + c.

Row order is ours and HF's: per grid entry, per frame (the t frames repeat the first), merge units
of m x m patches in raster order, patches inside a unit in raster order. The arithmetic is done in
float32 exactly as torch does it (same operations, same order), so indices are equal and weights
are bit-identical to HF's, which the tests check.

No torch or jax is imported here.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from qwen_vit_jax.config import VisionConfig

from .grid import as_grid


@numba.njit(cache=True)
def _axis_taps(pos, size, side, align_corners):
    """(tap0, tap1, weight0, weight1) of target position `pos` on an axis of `size` patches.

    float32 throughout, in torch's order: src = pos * (side - 1) / max(size - 1, 1), or
    (pos + 0.5) * side / size - 0.5 without align_corners; the numba literals are float32 on
    purpose (an int64 or float64 operand would promote the arithmetic)."""
    one = np.float32(1.0)
    zero = np.float32(0.0)
    if align_corners:
        src = np.float32(pos) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    else:
        half = np.float32(0.5)
        src = (np.float32(pos) + half) * np.float32(side) / np.float32(size) - half
    fl = np.floor(src)
    frac = src - fl
    t0 = min(max(np.int64(fl), 0), side - 1)
    t1 = min(max(np.int64(fl) + 1, 0), side - 1)
    w0 = max(one - abs(frac), zero)
    w1 = max(one - abs(frac - one), zero)
    return t0, t1, w0, w1


@numba.njit(cache=True)
def _repeat_frame(idx, wts, first, r, n, t):
    """Rows first .. first + n - 1 (one frame's taps) copied to the next t - 1 frames from row r
    (every frame of a video has the same positions); returns the row after them."""
    for _ in range(1, t):
        for q in range(n):
            for k in range(idx.shape[1]):
                idx[r + q, k] = idx[first + q, k]
                wts[r + q, k] = wts[first + q, k]
        r += n
    return r


@numba.njit(cache=True)
def _zero_rows(idx, wts, r):
    """Padding rows r .. end: table row 0, weight 0 (a zero position embedding)."""
    for q in range(r, idx.shape[0]):
        for k in range(idx.shape[1]):
            idx[q, k] = 0
            wts[q, k] = 0.0


@numba.njit(cache=True)
def _fill_interp(grid, side, m, align_corners, idx, wts):
    """idx: int32 [rows, 4], wts: float32 [rows, 4]; first N = sum(t*h*w) rows filled in our row
    order (see the module docstring), rows past N (padding) get index 0 and weight 0."""
    r = 0
    for g in range(grid.shape[0]):
        t, h, w = grid[g, 0], grid[g, 1], grid[g, 2]
        first = r
        for hb in range(h // m):
            for wb in range(w // m):
                for i in range(m):
                    row = hb * m + i
                    h0, h1, hw0, hw1 = _axis_taps(row, h, side, align_corners)
                    for j in range(m):
                        col = wb * m + j
                        c0, c1, cw0, cw1 = _axis_taps(col, w, side, align_corners)
                        idx[r, 0] = h0 * side + c0
                        idx[r, 1] = h0 * side + c1
                        idx[r, 2] = h1 * side + c0
                        idx[r, 3] = h1 * side + c1
                        wts[r, 0] = hw0 * cw0
                        wts[r, 1] = hw0 * cw1
                        wts[r, 2] = hw1 * cw0
                        wts[r, 3] = hw1 * cw1
                        r += 1
        r = _repeat_frame(idx, wts, first, r, h * w, t)
    _zero_rows(idx, wts, r)


@numba.njit(cache=True)
def _axis_taps_bicubic(pos, size, side, align_corners, taps, weights):
    """GLM's bicubic resampling along one axis: the 4 taps floor(src) - 1 .. floor(src) + 2 (clamped
    to [0, side - 1]: border padding) into `taps` and their Keys-kernel weights (a = -0.75, from the
    unclamped distances) into `weights`. float32 in torch's order (transformers' helper), literals
    float32 on purpose."""
    if align_corners:
        src = np.float32(pos) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    else:
        half = np.float32(0.5)
        src = (np.float32(pos) + half) * np.float32(side) / np.float32(size) - half
    fl = np.floor(src)
    frac = src - fl
    a = np.float32(-0.75)
    for k in range(4):
        o = k - 1
        taps[k] = min(max(np.int64(fl) + o, 0), side - 1)
        d = abs(frac - np.float32(o))
        if d <= np.float32(1.0):
            weights[k] = ((a + np.float32(2.0)) * d - (a + np.float32(3.0))) * d * d + np.float32(1.0)
        else:
            weights[k] = ((a * d - np.float32(5.0) * a) * d + np.float32(8.0) * a) * d - np.float32(4.0) * a


@numba.njit(cache=True)
def _fill_bicubic(grid, side, m, align_corners, idx, wts):
    """idx: int32 [rows, 16], wts: float32 [rows, 16]: as `_fill_interp`, with 4 x 4 taps per patch
    (row taps outer, column taps inner, as HF's helper) and weights the products of the axes'."""
    ht = np.empty(4, np.int64)
    hw = np.empty(4, np.float32)
    ct = np.empty(4, np.int64)
    cw = np.empty(4, np.float32)
    r = 0
    for g in range(grid.shape[0]):
        t, h, w = grid[g, 0], grid[g, 1], grid[g, 2]
        first = r
        for hb in range(h // m):
            for wb in range(w // m):
                for i in range(m):
                    _axis_taps_bicubic(hb * m + i, h, side, align_corners, ht, hw)
                    for j in range(m):
                        _axis_taps_bicubic(wb * m + j, w, side, align_corners, ct, cw)
                        for a in range(4):
                            for b in range(4):
                                idx[r, 4 * a + b] = ht[a] * side + ct[b]
                                wts[r, 4 * a + b] = hw[a] * cw[b]
                        r += 1
        r = _repeat_frame(idx, wts, first, r, h * w, t)
    _zero_rows(idx, wts, r)


def _check_grid(grid_thw, cfg: VisionConfig) -> np.ndarray:
    """grid_thw as int64 [k, 3], checked by as_grid: positive, h and w multiples of the merge size."""
    if cfg.num_position_embeddings <= 0:
        raise ValueError(f"{cfg.variant} has no learned position table (num_position_embeddings is 0)")
    return as_grid(grid_thw, merge=cfg.spatial_merge_size).array


def interpolation_indices_weights(
    grid_thw, cfg: VisionConfig, rows: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Gather indices and weights that resample the position table to every patch of `grid_thw`.

    Args:
      grid_thw: int [k, 3] rows (t, h, w) in patches; h, w multiples of cfg.spatial_merge_size.
      cfg: a VisionConfig with a table (num_position_embeddings = side * side); its
        `pos_embed_align_corners` picks the resampling.
      rows: total rows to return (>= N = sum t*h*w); rows past N are padding (index 0, weight 0,
        so their position embedding is exactly 0). Default N.

    Returns:
      indices: int32 [rows, taps] into the flattened [side * side, D] table (taps =
        cfg.pos_embed_taps: 4 bilinear, 16 bicubic).
      weights: float32 [rows, taps], equal to HF's helper's weights bit for bit.
    Both are read-only and shared through a cache keyed by (grid, side, merge, rows).
    """
    g = _check_grid(grid_thw, cfg)
    n = int((g[:, 0] * g[:, 1] * g[:, 2]).sum())
    rows = n if rows is None else rows
    if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or rows < n:
        raise ValueError(f"rows must be an int >= the grid's {n} patches, got {rows!r}")
    return _cached(
        g.tobytes(),
        len(g),
        cfg.pos_embed_side,
        cfg.spatial_merge_size,
        cfg.pos_embed_align_corners,
        cfg.pos_embed_taps,
        int(rows),
    )


@functools.lru_cache(maxsize=32)
def _cached(
    grid_bytes: bytes, k: int, side: int, m: int, align: bool, taps: int, rows: int
) -> tuple[np.ndarray, np.ndarray]:
    grid = np.frombuffer(grid_bytes, np.int64).reshape(k, 3)
    idx = np.empty((rows, taps), np.int32)
    wts = np.empty((rows, taps), np.float32)
    (_fill_bicubic if taps == 16 else _fill_interp)(grid, side, m, align, idx, wts)
    idx.flags.writeable = False
    wts.flags.writeable = False
    return idx, wts


def pos_embed_reference(table: np.ndarray, indices: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted gather in plain numpy, float32: pos[n] = sum_k weights[n, k] * table[indices[n, k]].

    Args:
      table: [side * side, D] learned position table (HF `pos_embed.weight`).
      indices, weights: [N, 4] from `interpolation_indices_weights`.
    Returns:
      float32 [N, D], to be added to the patch embedding (HF adds it before the first block).
    """
    rows = np.asarray(table, np.float32)[np.asarray(indices)]  # [N, 4, D]
    return np.einsum("nkd,nk->nd", rows, np.asarray(weights, np.float32), dtype=np.float32)
