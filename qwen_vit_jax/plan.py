"""Host-side planning: every index the vision forward needs, built in numba from `grid_thw`.

HF derives rotary ids, per-frame cu_seqlens and the Qwen2.5-VL window permutation with small
data-dependent torch ops (and host syncs) on every call. Here they are pure functions of
(grid_thw, config) computed on the host, padded to a static `Bucket`, cached by grid signature,
and shipped to the device in one transfer; the jitted forward only ever sees bucket shapes.

Two layers:
  * HF-exact index functions (`rotary_ids`, `frame_cu_seqlens`, `window_index`), equal element
    for element to `transformers.vision_utils`; tests pin them.
  * `make_plan`, the form the device consumes. Rows stay in the ORIGINAL pixel_values order
    (no permutation of the residual stream): full attention uses per-row frame ids plus a block
    table, window attention gathers rows into fixed-size window slots and scatters them back.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numba
import numpy as np

from .config import VisionConfig

_MAX_PATCHES = 2**30  # keeps every padded row index comfortably inside int32
_PLAN_CACHE_SIZE = 64  # a plan for ~130k patches holds ~3 MB


# ---- validation ------------------------------------------------------------------------------
def validate_grid(grid_thw, cfg: VisionConfig | None = None) -> np.ndarray:
    """Check `grid_thw` ([k, 3] integer (t, h, w) in patches) and return an int64 [k, 3] copy.

    Float arrays are rejected even when integral: a float grid is almost always a caller bug.
    With `cfg`, h and w must be multiples of `cfg.spatial_merge_size`.
    """
    try:
        arr = np.asarray(grid_thw)
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"grid_thw is not a rectangular [k, 3] array: {e}") from None
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"grid_thw must have shape [k, 3] (rows of t, h, w), got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError("grid_thw is empty: need at least one (t, h, w) row")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"grid_thw must hold integers, got dtype {arr.dtype}")
    # k is small: plain Python ints are faster than a handful of tiny numpy ops and cannot overflow.
    rows = arr.tolist()
    m = cfg.spatial_merge_size if cfg is not None else 1
    total = 0
    for i, row in enumerate(rows):
        for name, v in zip("thw", row):
            if v <= 0:
                raise ValueError(f"grid_thw row {i} = {row}: {name} must be positive, got {v}")
        if row[1] % m or row[2] % m:
            raise ValueError(f"grid_thw row {i} = {row}: h and w must be multiples of "
                             f"spatial_merge_size {m} (odd size)")
        total += row[0] * row[1] * row[2]
    if total > _MAX_PATCHES:
        raise ValueError(f"grid_thw describes {total} patches, more than {_MAX_PATCHES}")
    return np.array(rows, np.int64)


# ---- numba kernels (grid: int64 [k, 3], validated) ---------------------------------------------
@numba.njit(cache=True)
def _fill_rotary(grid, m, flat):
    """flat: int32 [2 * rows] view of [rows, 2]; first N rows = (h, w) patch coordinates in
    merge-unit-major order, repeated over t. Writes go through slices indexed from 0 so LLVM can
    drop negative-index handling and vectorise the per-frame copies (~4x faster)."""
    r = 0
    for g in range(grid.shape[0]):
        t, h, w = grid[g, 0], grid[g, 1], grid[g, 2]
        n2 = 2 * h * w
        first = flat[r:r + n2]
        q = 0
        for hb in range(h // m):
            for wb in range(w // m):
                for i in range(m):
                    for j in range(m):
                        first[q] = hb * m + i
                        first[q + 1] = wb * m + j
                        q += 2
        r += n2
        for _ in range(1, t):
            dst = flat[r:r + n2]
            for q in range(n2):
                dst[q] = first[q]
            r += n2


@numba.njit(cache=True)
def _fill_segments(cu, block, seg, kv_start, kv_count):
    """Frame id per row (-1 for padding) and the contiguous key-block range of each query block.

    cu: int64 [F + 1] frame boundaries. Like every kernel here it allocates nothing: array
    creation inside njit code roughly doubles compile time, and first-call latency matters.
    """
    for f in range(cu.shape[0] - 1):
        for r in range(cu[f], cu[f + 1]):
            seg[r] = f
    n = cu[cu.shape[0] - 1]
    for r in range(n, seg.shape[0]):
        seg[r] = -1
    for i in range(kv_start.shape[0]):
        first, last = i * block, (i + 1) * block - 1
        # Padding rows only see padding rows of their own block, so a padding tail never widens KB.
        start = cu[seg[first]] // block if first < n else i
        end = (cu[seg[last] + 1] - 1) // block if last < n else i
        kv_start[i] = start
        kv_count[i] = end - start + 1


@numba.njit(cache=True)
def _fill_window_order(grid, m, wm, index, cu):
    """HF window order: index[p] = merge unit at window position p; cu = cu_window_seqlens (patches).

    Windows are wm x wm merge units tiled over each frame, row-major; edge windows are smaller.
    HF's extra all-padding windows (when a side divides evenly) are never emitted, which is
    exactly what its `unique_consecutive` leaves.
    """
    cu[0] = 0
    p = 0
    win = 0
    base = 0
    for g in range(grid.shape[0]):
        lh, lw = grid[g, 1] // m, grid[g, 2] // m
        for _ in range(grid[g, 0]):
            for y0 in range(0, lh, wm):
                for x0 in range(0, lw, wm):
                    for y in range(y0, min(y0 + wm, lh)):
                        for x in range(x0, min(x0 + wm, lw)):
                            index[p] = base + y * lw + x
                            p += 1
                    win += 1
                    cu[win] = p * m * m
            base += lh * lw


@numba.njit(cache=True)
def _fill_window_slots(index, cu, unit, tokens, slot):
    """tokens[w, j] = row at position j of window w (rows 4u..4u+3 per merge unit u); slot = inverse."""
    width = tokens.shape[1]
    for w in range(cu.shape[0] - 1):
        j = 0
        for q in range(cu[w] // unit, cu[w + 1] // unit):
            row = index[q] * unit
            for e in range(unit):
                tokens[w, j] = row + e
                slot[row + e] = w * width + j
                j += 1


# ---- HF-exact index functions ----------------------------------------------------------------
def rotary_ids(grid_thw, cfg: VisionConfig) -> np.ndarray:
    """int32 [N, 2] (h, w) rotary ids == HF `get_vision_position_ids(grid_thw, merge)`."""
    g = validate_grid(grid_thw, cfg)
    out = np.empty((int(np.prod(g, axis=1).sum()), 2), np.int32)
    _fill_rotary(g, cfg.spatial_merge_size, out.reshape(-1))
    return out


def frame_cu_seqlens(grid_thw) -> np.ndarray:
    """int32 [F + 1] per-frame segment boundaries == HF `get_vision_cu_seqlens(grid_thw)`."""
    return _frame_cu(validate_grid(grid_thw)).astype(np.int32)


def _frame_cu(g: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.repeat(g[:, 1] * g[:, 2], g[:, 0]))])


def _window_order(g: np.ndarray, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    m, wm = cfg.spatial_merge_size, cfg.window_merge
    n_windows = int((g[:, 0] * -(-(g[:, 1] // m) // wm) * -(-(g[:, 2] // m) // wm)).sum())
    index = np.empty(int(np.prod(g, axis=1).sum()) // cfg.merge_unit, np.int64)
    cu = np.empty(n_windows + 1, np.int32)
    _fill_window_order(g, m, wm, index, cu)
    return index, cu


def window_index(grid_thw, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(int64 [N / merge_unit], int32 [W + 1]) == HF `get_vision_window_index` (after its
    `unique_consecutive`). Only for windowed (Qwen2.5-VL) configs."""
    if not cfg.windowed:
        raise ValueError(f"window_index needs a windowed config (variant {cfg.variant!r} has no windows)")
    g = validate_grid(grid_thw, cfg)
    return _window_order(g, cfg)


# ---- buckets ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Bucket:
    """Static shapes of one compiled forward."""

    patches: int  # padded patch rows N_pad, a multiple of `block`
    windows: int  # window slots W_pad (0 when the config has no windows)
    key_blocks: int  # KB: most key blocks any query block needs, 1 <= KB <= patches // block
    block: int  # query / key block size of full attention


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """How real sizes round up to bucket sizes. `block` must be a positive multiple of 4 so
    merge units never straddle a block; `growth` > 1 sets the geometric step of the N_pad ladder."""

    block: int = 128
    growth: float = 1.125

    def __post_init__(self):
        if not isinstance(self.block, int) or self.block <= 0 or self.block % 4:
            raise ValueError(f"BucketPolicy.block must be a positive multiple of 4, got {self.block!r}")
        if not self.growth > 1.0:
            raise ValueError(f"BucketPolicy.growth must be > 1, got {self.growth!r}")

    def bucket(self, n_patches: int, n_windows: int, key_blocks: int) -> Bucket:
        patches = patch_ladder_value(n_patches, self)
        if not 1 <= key_blocks <= patches // self.block:
            raise ValueError(f"key_blocks {key_blocks} outside 1..{patches // self.block}")
        return Bucket(patches=patches, windows=coarse_ladder_value(n_windows),
                      key_blocks=min(coarse_ladder_value(key_blocks), patches // self.block),
                      block=self.block)


def patch_ladder(limit: int, policy: BucketPolicy) -> list[int]:
    """All N_pad rungs up to the first one >= `limit`: steps of one block while that is finer than
    `growth`, then geometric (each >= previous * growth, rounded up to a block multiple)."""
    b = policy.block
    rungs = [b]
    while rungs[-1] < limit:
        v = rungs[-1]
        rungs.append(max(v + b, math.ceil(v * policy.growth / b) * b))
    return rungs


def patch_ladder_value(n: int, policy: BucketPolicy) -> int:
    """Smallest N_pad rung >= n."""
    return patch_ladder(n, policy)[-1]


def coarse_ladder_value(n: int) -> int:
    """Smallest of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5x them) >= n; 0 for n <= 0."""
    if n <= 0:
        return 0
    p = 1
    while p < n:
        if p >= 2 and p + p // 2 >= n:
            return p + p // 2
        p *= 2
    return p


# ---- the plan --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Everything the device forward needs for one grid, padded to `bucket`. Arrays are read-only
    (plans are shared through the cache). N = n_patches, N_pad = bucket.patches, B = bucket.block."""

    grid_thw: np.ndarray  # int64 [k, 3]
    n_patches: int
    bucket: Bucket
    pos_ids: np.ndarray  # int32 [N_pad, 2] rotary (h, w) ids; padding rows 0
    segment_ids: np.ndarray  # int32 [N_pad] frame index, -1 for padding rows
    kv_block_start: np.ndarray  # int32 [N_pad // B] first key block of each query block
    kv_block_count: np.ndarray  # int32 [N_pad // B] consecutive key blocks used (1..KB)
    window_tokens: np.ndarray  # int32 [W_pad, window_patches] row per window slot, -1 = empty
    window_slot: np.ndarray  # int32 [N_pad] flat slot (w * window_patches + j) of each real row; padding 0

    def device_arrays(self) -> tuple[np.ndarray, ...]:
        """(pos_ids, segment_ids, kv_block_start, kv_block_count, window_tokens, window_slot)."""
        return (self.pos_ids, self.segment_ids, self.kv_block_start, self.kv_block_count,
                self.window_tokens, self.window_slot)


def make_plan(grid_thw, cfg: VisionConfig, policy: BucketPolicy = BucketPolicy()) -> Plan:
    """Validate `grid_thw` and return its (cached) `Plan`."""
    g = validate_grid(grid_thw, cfg)
    return _make_plan(g.tobytes(), g.shape[0], cfg, policy)


@functools.lru_cache(maxsize=_PLAN_CACHE_SIZE)
def _make_plan(grid_bytes: bytes, k: int, cfg: VisionConfig, policy: BucketPolicy) -> Plan:
    g = np.frombuffer(grid_bytes, np.int64).reshape(k, 3).copy()
    n = int(np.prod(g, axis=1).sum())
    n_pad, b = patch_ladder_value(n, policy), policy.block

    pos = np.zeros((n_pad, 2), np.int32)
    _fill_rotary(g, cfg.spatial_merge_size, pos.reshape(-1))
    seg = np.empty(n_pad, np.int32)
    kv_start = np.empty(n_pad // b, np.int32)
    kv_count = np.empty(n_pad // b, np.int32)
    _fill_segments(_frame_cu(g), b, seg, kv_start, kv_count)

    n_windows = 0
    if cfg.windowed:
        index, cu = _window_order(g, cfg)
        n_windows = len(cu) - 1
    bucket = policy.bucket(n, n_windows, int(kv_count.max()))
    tokens = np.full((bucket.windows, cfg.window_patches), -1, np.int32)
    slot = np.zeros(n_pad, np.int32)
    if cfg.windowed:
        _fill_window_slots(index, cu, cfg.merge_unit, tokens, slot)

    arrays = (g, pos, seg, kv_start, kv_count, tokens, slot)
    for a in arrays:
        a.flags.writeable = False
    return Plan(grid_thw=g, n_patches=n, bucket=bucket, pos_ids=pos, segment_ids=seg,
                kv_block_start=kv_start, kv_block_count=kv_count, window_tokens=tokens, window_slot=slot)
