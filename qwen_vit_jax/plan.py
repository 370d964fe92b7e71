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
    table, window attention gathers rows into fixed-size slots (whole windows packed by best-fit
    decreasing, told apart by window id) and scatters them back.
  * `make_plans` / `split_grid`: a request above the per-program token budget is cut at frame
    boundaries into chunks that each fill a rung well, one plan per chunk.

Buckets are few by construction: N_pad comes from a coarse geometric ladder (2 rungs per octave by
default), W_pad is a function of N_pad for all ordinary inputs, and KB = N_pad / block for single
frames, so a stream of single images compiles at most one program per rung.
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
def _pack_windows(cu, unit, width, count, order, win_slot, head, nxt):
    """Best-fit decreasing packing of windows into slots of `width` rows; returns the slot count.

    cu: int32 [W + 1] window boundaries (rows). Windows are taken longest first (a stable
    counting sort: equal lengths keep HF order) and each goes into the open slot with the least
    remaining room that still fits it, or into a new slot. Rooms are multiples of `unit`, so open
    slots sit in one LIFO list per room (head[room // unit], linked through nxt): a placement is
    O(width // unit). Work arrays: count int64 [width // unit + 1], order / win_slot / nxt int64 [W],
    head int64 [width // unit + 1]. Output: win_slot[w] = slot of window w.
    """
    n_win = cu.shape[0] - 1
    top = width // unit
    for c in range(top + 1):
        count[c] = 0
        head[c] = -1
    for w in range(n_win):
        count[(cu[w + 1] - cu[w]) // unit] += 1
    pos = 0
    for c in range(top, -1, -1):  # start offset of each length, longest first
        k = count[c]
        count[c] = pos
        pos += k
    for w in range(n_win):
        c = (cu[w + 1] - cu[w]) // unit
        order[count[c]] = w
        count[c] += 1
    slots = 0
    for i in range(n_win):
        w = order[i]
        c = (cu[w + 1] - cu[w]) // unit
        s = -1
        room = top
        for r in range(c, top):  # an open slot always has room < top (it holds a window)
            if head[r] >= 0:
                s = head[r]
                head[r] = nxt[s]
                room = r
                break
        if s < 0:
            s = slots
            slots += 1
        win_slot[w] = s
        room -= c
        if room > 0:  # a full slot is closed for good
            nxt[s] = head[room]
            head[room] = s
    return slots


@numba.njit(cache=True)
def _fill_packed_slots(index, cu, unit, width, win_slot, fill, tokens, ids, slot):
    """Scatter rows into their packed slots. Windows are visited in HF order, so inside a slot its
    windows sit one after another in HF order and each window's rows keep HF's order (rows
    4u..4u+3 per merge unit u). tokens / ids: flat int32 views of [W_pad, width] prefilled with -1;
    slot: int32 [N_pad] zeros; fill: int64 work array >= slot count."""
    for s in range(fill.shape[0]):
        fill[s] = 0
    for w in range(cu.shape[0] - 1):
        s = win_slot[w]
        e0 = s * width + fill[s]  # flat entry of the window's first row
        length = cu[w + 1] - cu[w]
        tok = tokens[e0:e0 + length]
        wid = ids[e0:e0 + length]
        j = 0
        for q in range(cu[w] // unit, cu[w + 1] // unit):
            row = index[q] * unit
            for e in range(unit):
                tok[j] = row + e
                wid[j] = w
                slot[row + e] = e0 + j
                j += 1
        fill[s] += length


@numba.njit(cache=True)
def _split_frames(cum, rungs, cap, penalty, best, prev):
    """Optimal cut of a frame sequence into chunks (dynamic programming over frame boundaries).

    cum: int64 [F + 1] cumulative frame lengths. A chunk is frames j..i-1 with at most `cap` rows,
    or a single frame of any size; it costs rungs[first rung >= its rows] + penalty. best[i] = least
    cost of frames 0..i-1, prev[i] = start of the last chunk. rungs: int64, ascending, ending at or
    above max(cap, largest frame). Ties keep the shortest last chunk (so earlier chunks are the
    larger ones). O(F * frames per chunk).
    """
    best[0] = 0
    for i in range(1, cum.shape[0]):
        best[i] = -1
        r = 0
        for j in range(i - 1, -1, -1):
            size = cum[i] - cum[j]
            if size > cap and j < i - 1:
                break
            while rungs[r] < size:
                r += 1
            c = best[j] + rungs[r] + penalty
            if best[i] < 0 or c < best[i]:
                best[i] = c
                prev[i] = j


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


# ---- buckets ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Bucket:
    """Static shapes of one compiled forward."""

    patches: int  # padded patch rows N_pad: a rung of the policy's ladder
    windows: int  # window slots W_pad (0 when the config has no windows)
    key_blocks: int  # KB: key blocks each query block visits, 1 <= KB <= patches // block
    block: int  # rows per query / key block of full attention (a multiple of 4, divides patches)


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """How real sizes round up to bucket sizes.

    The N_pad ladder is geometric with `per_octave` rungs per doubling: 2^k * (1 + j / per_octave),
    j = 0 .. per_octave - 1, rounded up to a multiple of 4, from `min_patches` up (default: 64, 96,
    128, 192, 256, ...). The default `min_patches` is 64, not smaller, for exactness: XLA's CPU dot
    takes another kernel (another summation order) below ~60 rows, so a tiny image in a tiny
    bucket would differ (~1e-6) from the same image in a larger one; from 64 rows up every row's
    result is bitwise independent of the row count. A rung of N_pad rows is cut into ceil(N_pad / block) equal
    blocks of a multiple of 4 rows (merge units never straddle a block); a rung for which that does
    not divide is snapped up to the next size that does. Coarse on purpose: every distinct rung is
    a compiled program, and the mean padding of a ratio-r ladder is only ~(r - 1) / 2.
    `max_patches` is the token budget of one program: `make_plans` splits larger requests at frame
    boundaries (`split_grid`).
    """

    block: int = 128
    per_octave: int = 2
    min_patches: int = 64
    max_patches: int = 16384

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.block) or self.block <= 0 or self.block % 4:
            raise ValueError(f"BucketPolicy.block must be a positive multiple of 4, got {self.block!r}")
        if not is_int(self.per_octave) or self.per_octave < 1:
            raise ValueError(f"BucketPolicy.per_octave must be an int >= 1, got {self.per_octave!r}")
        if not is_int(self.min_patches) or self.min_patches <= 0 or self.min_patches % 4:
            raise ValueError(f"BucketPolicy.min_patches must be a positive multiple of 4, "
                             f"got {self.min_patches!r}")
        if not is_int(self.max_patches) or self.max_patches < self.min_patches:
            raise ValueError(f"BucketPolicy.max_patches must be an int >= min_patches {self.min_patches}, "
                             f"got {self.max_patches!r}")

    def rungs(self, limit: int) -> list[int]:
        """All N_pad rungs up to (and including) the first one >= `limit`."""
        table = _rung_table(self)
        return table[: int(np.searchsorted(table, limit)) + 1].tolist()

    def rung(self, n: int) -> int:
        """Smallest rung >= n (n may exceed max_patches: one frame over budget gets its own rung)."""
        table = _rung_table(self)
        return int(table[int(np.searchsorted(table, n))])

    def block_size(self, patches: int) -> int:
        """Rows per block of a `patches`-row bucket: patches // ceil(patches / block)."""
        return patches // -(-patches // self.block)


def _snap(r: int, block: int) -> int:
    """Smallest r' >= r (r a multiple of 4) that ceil(r' / block) blocks of a multiple of 4 rows
    tile exactly. Two rounds at most: once r' is a multiple of 4 * nb with nb = ceil(r / block),
    r' <= nb * block (itself such a multiple), so nb no longer changes."""
    while True:
        step = 4 * -(-r // block)
        r2 = -(-r // step) * step
        if r2 == r:
            return r
        r = r2


@functools.lru_cache(maxsize=32)
def _rung_table(policy: BucketPolicy) -> np.ndarray:
    """int64 ladder from min_patches until past 2 * _MAX_PATCHES (every valid grid has a rung)."""
    p = policy.per_octave
    rungs = [_snap(policy.min_patches, policy.block)]
    k = 0
    while rungs[-1] < 2 * _MAX_PATCHES:
        for j in range(p):
            v = _snap(-(-(2**k * (p + j)) // (4 * p)) * 4, policy.block)  # ceil4(2^k (1 + j/p)), exact
            if v > rungs[-1]:
                rungs.append(v)
        k += 1
    table = np.array(rungs, np.int64)
    table.flags.writeable = False
    return table


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


# Window slots. The W windows of a plan (each <= S = window_patches rows, a multiple of the merge
# unit mu) are packed by best-fit decreasing into W_pad slots of S rows. A single image tiled into
# 64-row windows needs about N / S slots plus a few for its edge windows, which pair up; so
#     typical(N_pad) = ceil(9/8 * N_pad / S) + 2
# covers every ordinary input (tests check all single images up to 64 x 64 patches), and then W_pad
# is a function of N_pad alone: one bucket per rung. Only inputs made mostly of windows just over
# S/2 rows (e.g. many 6 x 6-patch frames) need more; they get
#     worst(N_pad) = ceil(N_pad / f) + 1,  f = mu * (S // (2 mu) + 1)  (= S/2 + mu when S/mu is even)
# which always suffices: with best-fit (or first-fit) decreasing at most one slot ends up at most
# half full. (If slots A, then B, both held <= S/2 rows at the end, the window that opened B did
# not fit into A, whose room was then >= S/2, so that window alone exceeded S/2.) Every other slot
# holds > S/2 rows, i.e. >= f rows as fills are multiples of mu, hence slots <= floor(N / f) + 1.
def typical_windows(n_pad: int, cfg: VisionConfig) -> int:
    """W_pad of ordinary inputs of a bucket with n_pad rows (0 without windows)."""
    if not cfg.windowed:
        return 0
    return -(-n_pad * 9 // (8 * cfg.window_patches)) + 2


def worst_windows(n_pad: int, cfg: VisionConfig) -> int:
    """W_pad that any packing of n_pad rows fits (0 without windows); see the comment above."""
    if not cfg.windowed:
        return 0
    mu, s = cfg.merge_unit, cfg.window_patches
    return -(-n_pad // (mu * (s // (2 * mu) + 1))) + 1


def _window_slots(n_pad: int, packed: int, cfg: VisionConfig) -> int:
    typical = typical_windows(n_pad, cfg)
    if packed <= typical:
        return typical
    worst = worst_windows(n_pad, cfg)
    assert packed <= worst, (packed, worst, n_pad)
    return worst


# ---- splitting large requests ------------------------------------------------------------------
def chunk_penalty(policy: BucketPolicy) -> int:
    """What one more chunk costs in `split_grid`'s objective, in padded rows: max_patches // 100
    (at least min_patches). It stands for a program launch, a transfer and a likelier extra compile,
    and makes a request that fits the budget split only when that saves more than 1% of a full
    program (e.g. [[5, 36, 36]]: 8192 rows as one chunk, 4096 + 3072 as two)."""
    return max(policy.min_patches, policy.max_patches // 100)


def split_grid(grid_thw, cfg: VisionConfig, policy: BucketPolicy = BucketPolicy()) -> list[np.ndarray]:
    """Cut a request into consecutive chunks of frames, each an int64 [k_i, 3] grid.

    Frames are independent, so a video row [t, h, w] may be cut along t. Each chunk holds at most
    policy.max_patches rows (a single larger frame is a chunk of its own), and the cut minimises
    sum(rung(chunk rows)) + chunk_penalty * chunks exactly, by dynamic programming over frame
    boundaries. Concatenating the chunks' frames gives the request's frames in order.
    """
    g = validate_grid(grid_thw, cfg)
    sizes = g[:, 1] * g[:, 2]
    frames = np.repeat(sizes, g[:, 0])
    n_frames = len(frames)
    if n_frames == 1 or int(sizes @ g[:, 0]) <= policy.min_patches:
        return [g]
    cum = np.zeros(n_frames + 1, np.int64)
    np.cumsum(frames, out=cum[1:])
    table = _rung_table(policy)
    top = int(np.searchsorted(table, max(policy.max_patches, int(frames.max()))))
    best = np.empty(n_frames + 1, np.int64)
    prev = np.empty(n_frames + 1, np.int64)
    _split_frames(cum, table[: top + 1], policy.max_patches, chunk_penalty(policy), best, prev)
    cuts = [n_frames]
    while cuts[-1] > 0:
        cuts.append(int(prev[cuts[-1]]))
    cuts.reverse()
    if len(cuts) == 2:
        return [g]
    # Frame f of the request is frame f - row_start[r] of grid row r.
    row_end = np.cumsum(g[:, 0]).tolist()
    rows = g.tolist()
    chunks, r = [], 0
    for a, b in zip(cuts[:-1], cuts[1:]):
        out = []
        while a < b:
            while row_end[r] <= a:
                r += 1
            take = min(b, row_end[r]) - a
            out.append([take, rows[r][1], rows[r][2]])
            a += take
        chunks.append(np.array(out, np.int64))
    return chunks


# ---- the plan --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Everything the device forward needs for one grid, padded to `bucket`. Arrays are read-only
    (plans are shared through the cache). N = n_patches, N_pad = bucket.patches, B = bucket.block,
    S = cfg.window_patches, W_pad = bucket.windows.

    Window attention: slot w holds whole windows packed one after another (window_tokens[w] their
    rows, window_ids[w] their window ids); a row attends to the keys of its slot with the same
    window id (window_ids[q] == window_ids[k] != -1).
    """

    grid_thw: np.ndarray  # int64 [k, 3]
    n_patches: int
    bucket: Bucket
    pos_ids: np.ndarray  # int32 [N_pad, 2] rotary (h, w) ids; padding rows 0
    segment_ids: np.ndarray  # int32 [N_pad] frame index, -1 for padding rows
    kv_block_start: np.ndarray  # int32 [N_pad // B] first key block of each query block
    kv_block_count: np.ndarray  # int32 [N_pad // B] consecutive key blocks used (1..KB)
    window_tokens: np.ndarray  # int32 [W_pad, S] row at each slot entry, -1 = empty
    window_ids: np.ndarray  # int32 [W_pad, S] window (0..W-1, HF order) at each slot entry, -1 = empty
    window_slot: np.ndarray  # int32 [N_pad] flat slot entry (w * S + j) of each real row; padding 0

    def device_arrays(self) -> tuple[np.ndarray, ...]:
        """(pos_ids, segment_ids, kv_block_start, kv_block_count, window_tokens, window_ids, window_slot)."""
        return (self.pos_ids, self.segment_ids, self.kv_block_start, self.kv_block_count,
                self.window_tokens, self.window_ids, self.window_slot)


def make_plan(grid_thw, cfg: VisionConfig, policy: BucketPolicy = BucketPolicy()) -> Plan:
    """Validate `grid_thw` and return its (cached) `Plan`: ONE plan for the whole grid, never split
    (N_pad = policy.rung(N) even above max_patches)."""
    g = validate_grid(grid_thw, cfg)
    return _make_plan(g.tobytes(), g.shape[0], cfg, policy)


def make_plans(grid_thw, cfg: VisionConfig, policy: BucketPolicy = BucketPolicy()) -> list[Plan]:
    """Validate `grid_thw` and return one (cached) `Plan` per chunk of `split_grid`, in order; each
    plan's grid_thw is its chunk's grid."""
    g = validate_grid(grid_thw, cfg)
    return list(_make_plans(g.tobytes(), g.shape[0], cfg, policy))


@functools.lru_cache(maxsize=_PLAN_CACHE_SIZE)
def _make_plans(grid_bytes: bytes, k: int, cfg: VisionConfig, policy: BucketPolicy) -> tuple[Plan, ...]:
    g = np.frombuffer(grid_bytes, np.int64).reshape(k, 3)
    return tuple(_chunk_plan(c, cfg, policy) for c in split_grid(g, cfg, policy))


def _chunk_plan(chunk: np.ndarray, cfg: VisionConfig, policy: BucketPolicy) -> Plan:
    """make_plan(chunk), sharing arrays between chunks with the same frames: adjacent rows of equal
    (h, w) merge into one row first (every array depends on the frame sequence only), so the
    chunks of a long video ([[10, h, w], [2, h, w]], [[8, h, w], [4, h, w]], ...) build one plan."""
    rows = []
    for t, h, w in chunk.tolist():
        if rows and rows[-1][1:] == [h, w]:
            rows[-1][0] += t
        else:
            rows.append([t, h, w])
    if len(rows) == len(chunk):
        return _make_plan(chunk.tobytes(), len(chunk), cfg, policy)
    merged = np.array(rows, np.int64)
    plan = _make_plan(merged.tobytes(), len(merged), cfg, policy)
    grid = chunk.copy()
    grid.flags.writeable = False
    return dataclasses.replace(plan, grid_thw=grid)


@functools.lru_cache(maxsize=_PLAN_CACHE_SIZE)
def _make_plan(grid_bytes: bytes, k: int, cfg: VisionConfig, policy: BucketPolicy) -> Plan:
    g = np.frombuffer(grid_bytes, np.int64).reshape(k, 3).copy()
    n = int(np.prod(g, axis=1).sum())
    n_pad = policy.rung(n)
    b = policy.block_size(n_pad)
    nb = n_pad // b

    pos = np.zeros((n_pad, 2), np.int32)
    _fill_rotary(g, cfg.spatial_merge_size, pos.reshape(-1))
    seg = np.empty(n_pad, np.int32)
    kv_start = np.empty(nb, np.int32)
    kv_count = np.empty(nb, np.int32)
    _fill_segments(_frame_cu(g), b, seg, kv_start, kv_count)
    key_blocks = min(coarse_ladder_value(int(kv_count.max())), nb)

    s = cfg.window_patches
    slot = np.zeros(n_pad, np.int32)
    if cfg.windowed:
        index, cu = _window_order(g, cfg)
        n_win, top = len(cu) - 1, s // cfg.merge_unit
        win_slot, work = np.empty(n_win, np.int64), np.empty(n_win, np.int64)
        packed = _pack_windows(cu, cfg.merge_unit, s, np.empty(top + 1, np.int64), np.empty(n_win, np.int64),
                               win_slot, np.empty(top + 1, np.int64), work)
        w_pad = _window_slots(n_pad, packed, cfg)
        tokens = np.full((w_pad, s), -1, np.int32)
        ids = np.full((w_pad, s), -1, np.int32)
        _fill_packed_slots(index, cu, cfg.merge_unit, s, win_slot, work[:packed], tokens.reshape(-1),
                           ids.reshape(-1), slot)
    else:
        w_pad = 0
        tokens = np.full((0, s), -1, np.int32)
        ids = np.full((0, s), -1, np.int32)
    bucket = Bucket(patches=n_pad, windows=w_pad, key_blocks=key_blocks, block=b)

    arrays = (g, pos, seg, kv_start, kv_count, tokens, ids, slot)
    for a in arrays:
        a.flags.writeable = False
    return Plan(grid_thw=g, n_patches=n, bucket=bucket, pos_ids=pos, segment_ids=seg,
                kv_block_start=kv_start, kv_block_count=kv_count, window_tokens=tokens,
                window_ids=ids, window_slot=slot)
