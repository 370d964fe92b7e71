"""Host-side planning: every index the vision forward needs, built in numba from `grid_thw`.

HF derives rotary ids, per-frame cu_seqlens and the Qwen2.5-VL window permutation with small
data-dependent torch ops (and host syncs) on every call. Here they are pure functions of
(grid_thw, config) computed on the host, padded to a static `Bucket`, cached by grid signature,
and shipped to the device in one transfer; the jitted forward only ever sees bucket shapes.

Two layers:
  * HF-exact index functions (`rotary_ids`, `frame_cu_seqlens`, `window_index`), equal element
    for element to `transformers.vision_utils`; tests pin them.
  * `make_plan`, the form the device consumes. Rows stay in the ORIGINAL pixel_values order
    (no permutation of the residual stream): full attention uses per-row frame ids plus a tile
    table (query blocks, split where they straddle long frames, with their key-block ranges),
    window attention gathers rows into fixed-size slots (whole windows packed by best-fit
    decreasing, told apart by window id) and scatters them back.
  * `make_plans` / `split_grid`: a request above the per-program token budget is cut at frame
    boundaries into chunks that each fill a rung well, one plan per chunk.

Buckets are few by construction: N_pad comes from a coarse geometric ladder (2 rungs per octave by
default), W_pad is a function of N_pad for all ordinary inputs, and KB = T = N_pad / block for single
frames, so a stream of single images compiles at most one program per rung.

Speed matters: an uncached plan is on the request path whenever a grid is new. The grid is
validated once; the split is one numba call (`_split_chunks`: the optimal cut and every chunk's
rows, skipped for a single frame); a chunk's plan is one more (`_build_plan`: window packing,
then all its arrays in one buffer, each entry written once). What Python adds is scalar work and
wrapping, so an image costs ~20 us and a large request about one pass over its rows (~40 us per
16k-row chunk, on one core). Large plan buffers come from `_BufferPool`, which recycles the memory
of plans nobody holds any more: fresh pages would cost a page fault each on first write.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import threading
import weakref

import jax
import numba
import numpy as np

from .config import VisionConfig

_MAX_PATCHES = 2**30  # keeps every padded row index comfortably inside int32
_PLAN_CACHE_SIZE = 64  # a plan for ~130k patches holds ~3 MB
_EMPTY = np.empty(0, np.int32)


class _BufferPool:
    """Recycled memory for the flat buffers of large plans (`_make_plan`).

    A fresh multi-100-KB buffer is fresh pages: the first write to each costs a page fault
    (~2.5 us each on a small VM: ~2 ms of a 3 ms plan for a jittered 130k-patch request). The
    pool keeps up to `max_bytes` of power-of-two blocks and hands a block out again once nothing
    references the buffer made from it, so a long-running process builds new plans (cache
    misses and evictions) into pages it has touched before.

    A block is a bytearray; what is handed out is `np.frombuffer(block)`, and we keep a weak
    reference to it. Every view of it (the plan's arrays, numba's slice, a JAX array aliasing
    host memory on CPU) keeps that array alive, because numpy stops collapsing a view's base at
    an array whose own base is not an array; so a dead weak reference means no view is left.
    Buffers below `min_items` int32 come from malloc's heap without faults: not pooled.
    """

    def __init__(self, min_items: int = 1 << 15, max_bytes: int = 32 << 20):
        self.min_items, self.max_bytes = min_items, max_bytes
        self._blocks: list[tuple[bytearray, list]] = []  # (memory, [weakref to the array handed out])
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        """A writable int32 array of at least `n` items that no live array shares, or an empty
        array (small `n`, or the pool is full: the caller allocates)."""
        if n < self.min_items:
            return _EMPTY
        items = 1 << (n - 1).bit_length()
        with self._lock:
            for block, ref in self._blocks:
                if len(block) == 4 * items and ref[0]() is None:
                    return self._hand_out(block, ref)
            if self._bytes + 4 * items > self.max_bytes:
                return _EMPTY
            self._bytes += 4 * items
            self._blocks.append((bytearray(4 * items), [None]))
            return self._hand_out(*self._blocks[-1])

    @staticmethod
    def _hand_out(block: bytearray, ref: list) -> np.ndarray:
        out = np.frombuffer(block, np.int32)
        ref[0] = weakref.ref(out)
        return out


_POOL = _BufferPool()


# ---- validation ------------------------------------------------------------------------------
def validate_grid(grid_thw, cfg: VisionConfig | None = None) -> np.ndarray:
    """Check `grid_thw` ([k, 3] integer (t, h, w) in patches) and return an int64 [k, 3] C-order copy.

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
    if arr.dtype.kind not in "iu":  # bool is kind "b", floats "f", objects "O"
        raise ValueError(f"grid_thw must hold integers, got dtype {arr.dtype}")
    # k is small: plain Python ints are faster than a handful of tiny numpy ops and cannot overflow.
    rows = arr.tolist()
    m = cfg.spatial_merge_size if cfg is not None else 1
    total = 0
    for t, h, w in rows:
        if t <= 0 or h <= 0 or w <= 0 or h % m or w % m:
            _raise_bad_row(rows, m)
        total += t * h * w
    if total > _MAX_PATCHES:
        raise ValueError(f"grid_thw describes {total} patches, more than {_MAX_PATCHES}")
    # Every value is now in (0, 2^30]: the cast is exact for any integer dtype.
    return arr.astype(np.int64, order="C")


def _raise_bad_row(rows: list, m: int):
    """Raise the error for the first invalid row (the slow path of validate_grid)."""
    for i, row in enumerate(rows):
        for name, v in zip("thw", row):
            if v <= 0:
                raise ValueError(f"grid_thw row {i} = {row}: {name} must be positive, got {v}")
        if row[1] % m or row[2] % m:
            raise ValueError(f"grid_thw row {i} = {row}: h and w must be multiples of "
                             f"spatial_merge_size {m} (odd size)")
    raise AssertionError("no invalid row")  # pragma: no cover


# ---- numba kernels (grid: int64 [k, 3], validated) ---------------------------------------------
# Kernels write through slices indexed from 0 where it matters: numba then needs no negative-index
# handling and LLVM vectorises the inner loops (2-4x faster). A plan is ONE call from Python,
# _build_plan, compiled together with the helpers it calls. The first compile is paid once per
# install (cache=True; later processes load it in well under a second) but it counts, so plain
# loops throughout: a single array-to-slice copy added ~5 s to it.
@numba.njit(cache=True)
def _fill_rotary(grid, m, flat):
    """flat: int32 [2 * rows] view of [rows, 2]; first N rows = (h, w) patch coordinates in
    merge-unit-major order, repeated over t; rows past N (padding) = 0."""
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
    pad = flat[r:]
    for q in range(pad.shape[0]):
        pad[q] = 0


@numba.njit(cache=True)
def _fill_segments(grid, seg):
    """Frame id per row, -1 for padding rows. seg: int32 [N_pad]."""
    f = 0
    r0 = 0
    for g in range(grid.shape[0]):
        size = grid[g, 1] * grid[g, 2]
        for _ in range(grid[g, 0]):
            frame = seg[r0:r0 + size]
            for q in range(size):
                frame[q] = f
            f += 1
            r0 += size
    pad = seg[r0:]
    for q in range(pad.shape[0]):
        pad[q] = -1


@numba.njit(cache=True)
def _frame_blocks(grid, block):
    """(fb0, fb1): int64 [F], the first and last block of `block` rows holding each frame."""
    n_frames = 0
    for g in range(grid.shape[0]):
        n_frames += grid[g, 0]
    fb0, fb1 = np.empty(n_frames, np.int64), np.empty(n_frames, np.int64)
    f = r0 = 0
    for g in range(grid.shape[0]):
        size = grid[g, 1] * grid[g, 2]
        for _ in range(grid[g, 0]):
            fb0[f], fb1[f] = r0 // block, (r0 + size - 1) // block
            f += 1
            r0 += size
    return fb0, fb1


@numba.njit(cache=True)
def _coarse(n):
    """coarse_ladder_value, callable from numba kernels."""
    if n <= 0:
        return 0
    p = 1
    while p < n:
        if p >= 2 and p + p // 2 >= n:
            return p + p // 2
        p *= 2
    return p


@numba.njit(cache=True)
def _group_tiles(fb0, fb1, nb, kb, tiles):
    """Cut every query block's frames into tiles whose key ranges span at most `kb` blocks;
    returns the number of extra tiles (tiles beyond one per block).

    A tile is (query block, a run of consecutive frames with rows in it): its key range runs from
    the first block of its first frame to the last block of its last one. Greedy per block: a
    frame joins the current run while the run's range stays within kb blocks (kb >= the span of
    any single frame). Block i's first run is tile i, its other runs are extra tiles NB, NB + 1,
    ... in block order. A block without frames (pure padding) gets an empty tile i.

    tiles: int32 [5, T] (rows: block, first frame, last frame, first key block, key block count),
    T >= NB + extras, or an empty [5, 0] array to only count. An empty tile has first frame 0,
    last frame -1 and count 0; unused extra tiles stay empty.
    """
    fill = tiles.shape[1] > 0
    if fill:
        for t in range(tiles.shape[1]):
            tiles[0, t], tiles[1, t], tiles[2, t], tiles[3, t], tiles[4, t] = 0, 0, -1, 0, 0
    n_frames = fb0.shape[0]
    extra = 0
    fa = 0  # first frame that ends in or after block i
    for i in range(nb):
        while fa < n_frames and fb1[fa] < i:
            fa += 1
        if fill:
            tiles[0, i], tiles[3, i] = i, i
        f = fa
        runs = 0
        while f < n_frames and fb0[f] <= i:  # one run of frames per iteration
            lo, first, last = fb0[f], f, f
            f += 1
            while f < n_frames and fb0[f] <= i and fb1[f] - lo + 1 <= kb:
                last = f
                f += 1
            t = i if runs == 0 else nb + extra
            if fill:
                tiles[0, t], tiles[1, t], tiles[2, t] = i, first, last
                tiles[3, t], tiles[4, t] = lo, fb1[last] - lo + 1
            if runs > 0:
                extra += 1
            runs += 1
    return extra


@numba.njit(cache=True)
def _choose_tiles(fb0, fb1, nb):
    """(KB, T): the key-block trip count and the tile count of full attention, chosen to
    minimise T * KB (the blocks of attention computed per full layer), ties to fewer tiles.

    Candidates: KB on the coarse ladder from the widest single frame's span up to the widest
    block's union of frames (capped at NB; with that one, T == NB: one tile per block, no
    extras). T = NB + coarse(extras). A single frame always gives T == NB: every block holds
    one frame.
    """
    empty = np.empty((5, 0), np.int32)
    k1 = 1
    for f in range(fb0.shape[0]):
        k1 = max(k1, fb1[f] - fb0[f] + 1)
    k_union = 1
    fa = 0
    for i in range(nb):
        while fa < fb0.shape[0] and fb1[fa] < i:
            fa += 1
        fz = fa
        while fz + 1 < fb0.shape[0] and fb0[fz + 1] <= i:
            fz += 1
        if fa < fb0.shape[0] and fb0[fa] <= i:
            k_union = max(k_union, fb1[fz] - fb0[fa] + 1)
    best_kb, best_t = min(_coarse(k_union), nb), nb
    kb = _coarse(k1)
    while kb < best_kb:
        t = nb + _coarse(_group_tiles(fb0, fb1, nb, kb, empty))
        if t * kb < best_t * best_kb:
            best_kb, best_t = kb, t
        kb = _coarse(kb + 1)
    return best_kb, best_t


@numba.njit(cache=True)
def _fill_window_order(grid, m, wm, index, cu):
    """HF window order: index[p] = merge unit at window position p; cu = cu_window_seqlens (patches).

    Windows are wm x wm merge units tiled over each frame, row-major; edge windows are smaller.
    HF's extra all-padding windows (when a side divides evenly) are never emitted, which is
    exactly what its `unique_consecutive` leaves. (_pack_windows and _fill_window_slots walk the
    same tiling.)
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
def _pack_windows(grid, m, wm, win_slot):
    """Best-fit decreasing packing of a grid's windows into slots of wm * wm merge units; returns
    the slot count.

    Output win_slot: int64 [W], the slot of each window (HF window order). Windows are taken
    longest first (a stable counting sort: equal lengths keep HF order) and each goes into the
    open slot with the least remaining room that still fits it, or into a new slot. Open slots
    sit in one LIFO list per room (head[room], linked through nxt), so a placement is O(wm^2).
    """
    n_win = win_slot.shape[0]
    top = wm * wm
    length = np.empty(n_win, np.int64)  # merge units per window, in _fill_window_order's tiling
    w = 0
    for g in range(grid.shape[0]):
        lh, lw = grid[g, 1] // m, grid[g, 2] // m
        for _ in range(grid[g, 0]):
            for y0 in range(0, lh, wm):
                for x0 in range(0, lw, wm):
                    length[w] = (min(y0 + wm, lh) - y0) * (min(x0 + wm, lw) - x0)
                    w += 1
    count = np.empty(top + 1, np.int64)
    head = np.empty(top + 1, np.int64)
    for c in range(top + 1):
        count[c] = 0
        head[c] = -1
    order = np.empty(n_win, np.int64)
    nxt = np.empty(n_win, np.int64)
    for w in range(n_win):
        count[length[w]] += 1
    pos = 0
    for c in range(top, -1, -1):  # start offset of each length, longest first
        k = count[c]
        count[c] = pos
        pos += k
    for w in range(n_win):
        c = length[w]
        order[count[c]] = w
        count[c] += 1
    slots = 0
    for i in range(n_win):
        w = order[i]
        c = length[w]
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
def _fill_window_slots(grid, m, wm, win_slot, n_slots, tokens, ids, slot):
    """Scatter rows into their packed slots; empty entries get -1.

    tokens / ids: flat int32 views of [W_pad, S] (S = (wm * m)^2 rows per slot), W_pad >= n_slots;
    slot: int32 [N_pad] (padding rows get 0); win_slot: int64 [W] from _pack_windows. Windows are
    visited in HF order, so inside a slot its windows sit one after another in HF order, and each
    window's rows keep HF's order (rows mu*u .. mu*u + mu - 1 of merge unit u, mu = m * m). A
    window row of x1 - x0 merge units is one run of (x1 - x0) * mu consecutive rows: three
    contiguous writes.
    """
    mu = m * m
    s_rows = wm * wm * mu
    fill = np.empty(n_slots, np.int64)
    for sl in range(n_slots):
        fill[sl] = 0
    w = 0
    base = 0  # merge units before the current frame
    for g in range(grid.shape[0]):
        lh, lw = grid[g, 1] // m, grid[g, 2] // m
        for _ in range(grid[g, 0]):
            for y0 in range(0, lh, wm):
                for x0 in range(0, lw, wm):
                    x1 = min(x0 + wm, lw)
                    run = (x1 - x0) * mu
                    sl = win_slot[w]
                    e = sl * s_rows + fill[sl]  # flat entry of the window's next row
                    for y in range(y0, min(y0 + wm, lh)):
                        row0 = (base + y * lw + x0) * mu
                        tok, wid, back = tokens[e:e + run], ids[e:e + run], slot[row0:row0 + run]
                        for j in range(run):
                            tok[j] = row0 + j
                            wid[j] = w
                            back[j] = e + j
                        e += run
                    fill[sl] = e - sl * s_rows
                    w += 1
            base += lh * lw
    pad = slot[base * mu:]
    for q in range(pad.shape[0]):
        pad[q] = 0
    for sl in range(tokens.shape[0] // s_rows):
        used = fill[sl] if sl < n_slots else 0
        tok, wid = tokens[sl * s_rows + used:(sl + 1) * s_rows], ids[sl * s_rows + used:(sl + 1) * s_rows]
        for j in range(tok.shape[0]):
            tok[j] = -1
            wid[j] = -1


@numba.njit(cache=True)
def _build_plan(grid, m, wm, s, n_pad, b, w_typical, w_worst, out):
    """Every int32 array of one plan, in ONE flat buffer; returns (buf, W_pad, KB, T).

    grid: int64 [k, 3], validated, N rows; m: spatial merge size; wm: window side in merge units
    (0: no window attention, W_pad = 0); s: slot width S; n_pad, b: the bucket's rows and block;
    w_typical / w_worst: typical_windows / worst_windows of n_pad. W_pad is w_typical whenever the
    packing fits it, else w_worst (proven enough). KB and T: _choose_tiles. Layout of buf
    (NB = n_pad // b), see _plan_views:
        pos [N_pad, 2] | seg [N_pad] | slot [N_pad] | tiles [5, T] | tokens [W_pad, S] | ids [W_pad, S]
    One buffer rather than eight arrays: one allocation, one array for numba to box and one
    setflags; the views cost less than any of those. buf is the front of `out` (int32, from
    _BufferPool) when it is large enough, else a new array.
    """
    nb = n_pad // b
    n_win = 0  # windows, edge windows included (_n_windows)
    if wm > 0:
        for g in range(grid.shape[0]):
            n_win += grid[g, 0] * -(-(grid[g, 1] // m) // wm) * -(-(grid[g, 2] // m) // wm)
    win_slot = np.empty(n_win, np.int64)
    packed = w_pad = 0
    if wm > 0:
        packed = _pack_windows(grid, m, wm, win_slot)
        w_pad = w_typical if packed <= w_typical else w_worst
        assert packed <= w_pad
    fb0, fb1 = _frame_blocks(grid, b)
    kb, n_tiles = _choose_tiles(fb0, fb1, nb)
    size = 4 * n_pad + 5 * n_tiles + 2 * w_pad * s
    buf = out[:size] if out.shape[0] >= size else np.empty(size, np.int32)
    _fill_rotary(grid, m, buf[:2 * n_pad])
    _fill_segments(grid, buf[2 * n_pad:3 * n_pad])
    t0 = 4 * n_pad + 5 * n_tiles
    _group_tiles(fb0, fb1, nb, kb, buf[4 * n_pad:t0].reshape(5, n_tiles))
    slot = buf[3 * n_pad:4 * n_pad]
    if wm > 0:
        _fill_window_slots(grid, m, wm, win_slot, packed, buf[t0:t0 + w_pad * s],
                           buf[t0 + w_pad * s:t0 + 2 * w_pad * s], slot)
    else:
        for q in range(n_pad):
            slot[q] = 0
    return buf, w_pad, kb, n_tiles


@numba.njit(cache=True)
def _split_chunks(grid, rungs, cap, penalty, min_patches, rows, starts, keys, key_starts):
    """split_grid's cut of a validated grid into chunks; returns the chunk count C.

    One chunk when the request is a single frame or at most min_patches rows. Otherwise the
    optimal cut, by dynamic programming over frame boundaries (O(F * frames per chunk)): a chunk
    is frames j..i-1 with at most `cap` rows, or a single frame of any size, and costs
    rungs[first rung >= its rows] + penalty; best[i] = least cost of frames 0..i-1, prev[i] =
    start of the last chunk. Ties keep the shortest last chunk (earlier chunks are the larger
    ones). rungs: int64, ascending, ending above any chunk's rows.

    Outputs, int64 arrays the caller allocates: rows / keys [k + F, 3] (each cut splits at most
    one grid row, so k + C - 1 rows suffice), starts / key_starts [F + 1]. Chunk c is
    rows[starts[c]:starts[c + 1]], the grid rows it takes frames from, a video row cut along t
    where a chunk boundary falls inside it; keys[key_starts[c]:key_starts[c + 1]] is the same
    chunk with adjacent rows of equal (h, w) merged: every plan array depends on the frame
    sequence only, so chunks with equal keys share one plan.
    """
    k = grid.shape[0]
    n_frames = 0
    for g in range(k):
        n_frames += grid[g, 0]
    cum = np.empty(n_frames + 1, np.int64)  # cum[i] = rows of frames 0..i-1
    cum[0] = 0
    f = 0
    for g in range(k):
        size = grid[g, 1] * grid[g, 2]
        for _ in range(grid[g, 0]):
            cum[f + 1] = cum[f] + size
            f += 1
    prev = np.empty(n_frames + 1, np.int64)
    prev[n_frames] = 0
    if n_frames > 1 and cum[n_frames] > min_patches:
        best = np.empty(n_frames + 1, np.int64)
        best[0] = 0
        for i in range(1, n_frames + 1):
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
    cuts = np.empty(n_frames + 1, np.int64)  # chunk boundaries (frames), filled from the end
    cuts[n_frames] = n_frames
    n_chunks = 0
    while cuts[n_frames - n_chunks] > 0:
        cuts[n_frames - n_chunks - 1] = prev[cuts[n_frames - n_chunks]]
        n_chunks += 1
    cuts = cuts[n_frames - n_chunks:]

    n_rows = n_keys = 0
    g = 0
    row_end = grid[0, 0]  # frames in grid rows 0..g
    for c in range(n_chunks):
        starts[c] = n_rows
        key_starts[c] = n_keys
        a, b = cuts[c], cuts[c + 1]
        while a < b:
            while row_end <= a:
                g += 1
                row_end += grid[g, 0]
            take = min(b, row_end) - a
            h, w = grid[g, 1], grid[g, 2]
            rows[n_rows, 0] = take
            rows[n_rows, 1] = h
            rows[n_rows, 2] = w
            n_rows += 1
            if n_keys > key_starts[c] and keys[n_keys - 1, 1] == h and keys[n_keys - 1, 2] == w:
                keys[n_keys - 1, 0] += take
            else:
                keys[n_keys, 0] = take
                keys[n_keys, 1] = h
                keys[n_keys, 2] = w
                n_keys += 1
            a += take
    starts[n_chunks] = n_rows
    key_starts[n_chunks] = n_keys
    return n_chunks


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


def _n_windows(rows: list, m: int, wm: int) -> int:
    """Windows of a grid given as a list of (t, h, w) rows (edge windows included)."""
    return sum(t * -(-(h // m) // wm) * -(-(w // m) // wm) for t, h, w in rows)


def _window_order(g: np.ndarray, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    m, wm = cfg.spatial_merge_size, cfg.window_merge
    index = np.empty(int(np.prod(g, axis=1).sum()) // cfg.merge_unit, np.int64)
    cu = np.empty(_n_windows(g.tolist(), m, wm) + 1, np.int32)
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
        raise ValueError(f"to_spatial: rows has {total} rows; grid_thw has {n} patches "
                         f"({n // (m * m)} merged tokens)")
    merged = total != n or m == 1
    lead, c = rows.shape[:-2], rows.shape[-1]
    out, start = [], 0
    for t, h, w in g.tolist():
        if merged:
            size = t * (h // m) * (w // m)
            out.append(rows[..., start:start + size, :].reshape(*lead, t, h // m, w // m, c))
        else:
            size = t * h * w
            x = rows[..., start:start + size, :].reshape(*lead, t, h // m, w // m, m, m, c)
            k = len(lead)  # [.., t, hb, wb, i, j, C] -> [.., t, hb, i, wb, j, C] -> [.., t, h, w, C]
            x = x.transpose(*range(k), k, k + 1, k + 3, k + 2, k + 4, k + 5)
            out.append(x.reshape(*lead, t, h, w, c))
        start += size
    return out


# ---- buckets ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Bucket:
    """Static shapes of one compiled forward."""

    patches: int  # padded patch rows N_pad: a rung of the policy's ladder
    windows: int  # window slots W_pad (0 when the config has no windows)
    key_blocks: int  # KB: key blocks each attention tile visits, 1 <= KB <= patches // block
    block: int  # rows per query / key block of full attention (a multiple of 4, divides patches)
    tiles: int  # T: full-attention tiles, patches // block (one per query block) + extra tiles
    window_rows: int = 0  # S: rows per window slot (cfg.window_patches; 0 without a window size)


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
        table = _rung_tuple(self)
        return table[bisect.bisect_left(table, n)]

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


@functools.lru_cache(maxsize=32)
def _rung_tuple(policy: BucketPolicy) -> tuple[int, ...]:
    """_rung_table as Python ints: bisect on it is ~10x faster than np.searchsorted for one value."""
    return tuple(_rung_table(policy).tolist())


def coarse_ladder_value(n: int) -> int:
    """Smallest of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5x them) >= n; 0 for n <= 0."""
    return int(_coarse(int(n)))


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
    return _typical_slots(n_pad, cfg.window_patches) if cfg.windowed else 0


def worst_windows(n_pad: int, cfg: VisionConfig) -> int:
    """W_pad that any packing of n_pad rows fits (0 without windows); see the comment above."""
    return _worst_slots(n_pad, cfg.window_patches, cfg.merge_unit) if cfg.windowed else 0


def _typical_slots(n_pad: int, s: int) -> int:
    return -(-n_pad * 9 // (8 * s)) + 2


def _worst_slots(n_pad: int, s: int, mu: int) -> int:
    return -(-n_pad // (mu * (s // (2 * mu) + 1))) + 1


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
    rows, starts, _, _ = _split(validate_grid(grid_thw, cfg), policy)
    return [rows[a:b] for a, b in zip(starts, starts[1:])]


def _split(g: np.ndarray, policy: BucketPolicy) -> tuple[np.ndarray, list[int], np.ndarray, list[int]]:
    """split_grid of a validated grid as (rows, starts, keys, key_starts): chunk c is
    rows[starts[c]:starts[c + 1]], its plan key (adjacent rows of equal (h, w) merged) is
    keys[key_starts[c]:key_starts[c + 1]] (int64 [., 3] arrays; see _split_chunks)."""
    rows = g.tolist()
    n_frames = sum(r[0] for r in rows)
    if n_frames == 1:  # one frame: one chunk (skips a numba call)
        return g, [0, 1], g, [0, 1]
    k = len(rows)
    out, keys = np.empty((k + n_frames, 3), np.int64), np.empty((k + n_frames, 3), np.int64)
    starts, key_starts = np.empty(n_frames + 1, np.int64), np.empty(n_frames + 1, np.int64)
    n_chunks = _split_chunks(g, _rung_table(policy), policy.max_patches, chunk_penalty(policy),
                             policy.min_patches, out, starts, keys, key_starts)
    return out, starts[:n_chunks + 1].tolist(), keys, key_starts[:n_chunks + 1].tolist()


# ---- the plan --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """One chunk of a request, planned for the device: the host-to-device contract of the forward.

    A registered JAX pytree. Its leaves are the int32 index arrays below (and `span`); its static
    metadata is the `bucket` alone, so a `jax.jit` taking a Plan compiles once per bucket, whatever
    the grid; `jax.device_put(plan)` moves every array in one call; `Plan.abstract(bucket)` is the
    shape-only plan of a bucket, for ahead-of-time compiles. Host arrays are read-only (plans are
    shared through the cache). N = n_patches, N_pad = bucket.patches, B = bucket.block,
    S = bucket.window_rows, W_pad = bucket.windows, T = bucket.tiles, KB = bucket.key_blocks.

    Rows stay in the request's original order (frames contiguous, each run of merge_unit rows one
    merge unit); rows N .. N_pad - 1 are padding.

    Window attention: slot w holds whole windows packed one after another (window_tokens[w] their
    rows, window_ids[w] their window ids); a row attends to the keys of its slot with the same
    window id (window_ids[q] == window_ids[k] != -1).

    Full attention: tile t is query block tile_block[t] restricted to frames tile_first_frame[t] ..
    tile_last_frame[t], whose keys lie in the tile_key_count[t] (<= KB) key blocks from
    tile_key_start[t]. Tiles 0 .. N_pad / B - 1 are the blocks in order; the rest are extra tiles
    for blocks that straddle frames (attention.segment_attention adds them back). An empty tile has
    first frame 0, last frame -1 and key count 0.

    `grid_thw` (this chunk's grid) is host-only: a Plan rebuilt from its leaves (after
    `jax.device_put`, or inside a traced function) has grid_thw None. `span` travels as a leaf, so
    `n_patches`, `take` and `unpad` work on any concrete plan.
    """

    bucket: Bucket
    pos_ids: np.ndarray  # int32 [N_pad, 2] rotary (h, w) ids; padding rows 0
    segment_ids: np.ndarray  # int32 [N_pad] frame index, -1 for padding rows
    window_tokens: np.ndarray  # int32 [W_pad, S] row at each slot entry, -1 = empty
    window_ids: np.ndarray  # int32 [W_pad, S] window (0..W-1, HF order) at each slot entry, -1 = empty
    window_slot: np.ndarray  # int32 [N_pad] flat slot entry (w * S + j) of each real row; padding 0
    tile_block: np.ndarray  # int32 [T] query block of each full-attention tile
    tile_first_frame: np.ndarray  # int32 [T] first frame of the tile's run of frames
    tile_last_frame: np.ndarray  # int32 [T] last frame of the run (-1: empty tile)
    tile_key_start: np.ndarray  # int32 [T] first key block of the tile's frames
    tile_key_count: np.ndarray  # int32 [T] key blocks of the tile's frames (0..KB)
    span: np.ndarray  # int32 [3]: this chunk's first row in the request, its real rows N, the request's rows
    grid_thw: np.ndarray | None = None  # int64 [k, 3] this chunk's grid (host only)

    ARRAYS = ("pos_ids", "segment_ids", "window_tokens", "window_ids", "window_slot", "tile_block",
              "tile_first_frame", "tile_last_frame", "tile_key_start", "tile_key_count", "span")

    @classmethod
    def abstract(cls, bucket: Bucket) -> Plan:
        """The plan of `bucket` as shape/dtype structs (what `jax.jit(...).lower` takes)."""
        n, t, w, s = bucket.patches, bucket.tiles, bucket.windows, bucket.window_rows
        shapes = dict(pos_ids=(n, 2), segment_ids=(n,), window_tokens=(w, s), window_ids=(w, s), window_slot=(n,),
                      tile_block=(t,), tile_first_frame=(t,), tile_last_frame=(t,), tile_key_start=(t,),
                      tile_key_count=(t,), span=(3,))
        return cls(bucket=bucket, **{k: jax.ShapeDtypeStruct(v, np.int32) for k, v in shapes.items()})

    @property
    def offset(self) -> int:
        """This chunk's first row in the request's pixel_values."""
        return self._span(0)

    @property
    def n_patches(self) -> int:
        """Real rows (patches) of this chunk."""
        return self._span(1)

    @property
    def request_patches(self) -> int:
        """Rows of the whole request this chunk was planned from."""
        return self._span(2)

    def _span(self, i: int) -> int:
        try:
            return int(self.span[i])
        except Exception as e:  # a traced plan: jax.errors.ConcretizationTypeError and kin
            raise TypeError("this Plan is traced (it was passed into a jitted function): row counts and "
                            "unpad/take need a concrete plan; close over the plan instead of passing it "
                            "as an argument, or call unpad outside the function") from e

    def take(self, pixel_values, dtype=None) -> np.ndarray:
        """This chunk's rows of the request's pixel_values, zero-padded to the bucket.

        Args:
          pixel_values: [request_patches, patch_dim] the whole request's rows (HF patch order).
          dtype: of the result (default: pixel_values' dtype if floating, else float32).
        Returns:
          np.ndarray [bucket.patches, patch_dim]: rows offset .. offset + n_patches, then zeros.
        """
        px = np.asarray(pixel_values)
        if px.ndim != 2:
            raise ValueError(f"pixel_values must be 2-D [N, patch_dim], got shape {px.shape}")
        if px.shape[0] != self.request_patches:
            raise ValueError(f"pixel_values has {px.shape[0]} rows but the plan's request has "
                             f"sum(t*h*w) = {self.request_patches}")
        if dtype is None:
            dtype = px.dtype if np.issubdtype(px.dtype, np.floating) else np.float32
        out = np.zeros((self.bucket.patches, px.shape[1]), dtype)  # [N_pad, P]
        a, n = self.offset, self.n_patches
        out[:n] = px[a:a + n]
        return out

    def unpad(self, y):
        """The real rows of a forward output: y[..., :rows, :] where y's second-to-last axis has the
        bucket's patch rows (hidden states: n_patches real rows) or its merged rows, bucket.patches
        / merge_unit (tokens: n_patches / merge_unit real rows). NumPy or JAX arrays; inside a
        traced function only for a plan it closes over."""
        rows, padded = y.shape[-2], self.bucket.patches
        if rows == 0 or padded % rows or self.n_patches % (padded // rows):
            raise ValueError(f"unpad: y has {rows} rows on its second-to-last axis; this plan's bucket has "
                             f"{padded} patch rows (or that divided by the merge unit)")
        return y[..., :self.n_patches // (padded // rows), :]

    def _flatten_with_keys(self):
        return [(jax.tree_util.GetAttrKey(k), getattr(self, k)) for k in self.ARRAYS], self.bucket

    @classmethod
    def _unflatten(cls, bucket, leaves):
        return cls(bucket, *leaves)


jax.tree_util.register_pytree_with_keys(Plan, Plan._flatten_with_keys, Plan._unflatten)


def make_plan(grid_thw, cfg: VisionConfig, policy: BucketPolicy | None = None) -> Plan:
    """Validate `grid_thw` and return its (cached) `Plan`: ONE plan for the whole grid, never split
    (N_pad = policy.rung(N) even above max_patches)."""
    g = validate_grid(grid_thw, cfg)
    return _make_plan(g.tobytes(), g.shape[0], cfg, policy or BucketPolicy())


def make_plans(grid_thw, cfg: VisionConfig, policy: BucketPolicy | None = None) -> list[Plan]:
    """Validate `grid_thw` and return one (cached) `Plan` per chunk of `split_grid`, in order.

    One plan for any request that fits the policy's largest bucket (max_patches); a larger one is
    cut at frame boundaries. Each plan's grid_thw is its chunk's grid and its span says which rows
    of the request's pixel_values it takes (`Plan.take`).
    """
    policy = policy or BucketPolicy()
    g = validate_grid(grid_thw, cfg)
    if g.shape[0] == 1 and g[0, 0] == 1:  # one frame (an image): one chunk, nothing to split
        return [_make_plan(g.tobytes(), 1, cfg, policy)]
    return list(_make_plans(g.tobytes(), g.shape[0], cfg, policy))


@functools.lru_cache(maxsize=_PLAN_CACHE_SIZE)
def _make_plans(grid_bytes: bytes, k: int, cfg: VisionConfig, policy: BucketPolicy) -> tuple[Plan, ...]:
    """One plan per chunk. Chunks with the same frames share one plan's arrays: the plan is cached
    under the chunk's merged rows, so the chunks of a long video ([[10, h, w], [2, h, w]],
    [[8, h, w], [4, h, w]], ...) build one plan and differ only in grid_thw and span."""
    g = _grid(grid_bytes, k)
    total = int((g[:, 0] * g[:, 1] * g[:, 2]).sum())
    rows, starts, keys, key_starts = _split(g, policy)
    key_bytes, row = keys.tobytes(), 3 * keys.itemsize  # a key is a slice of it: no per-chunk array
    plans, offset = [], 0
    for c in range(len(starts) - 1):
        k0, k1 = key_starts[c], key_starts[c + 1]
        plan = _make_plan(key_bytes[row * k0:row * k1], k1 - k0, cfg, policy)
        n = plan.n_patches
        if k1 - k0 != starts[c + 1] - starts[c]:  # rows were merged: the chunk's own grid
            grid = rows[starts[c]:starts[c + 1]].copy()
            grid.setflags(write=False)
            plan = dataclasses.replace(plan, grid_thw=grid)
        if n != total:  # one chunk of several: its own rows of the request
            plan = dataclasses.replace(plan, span=_span(offset, n, total))
        plans.append(plan)
        offset += n
    return tuple(plans)


def _span(offset: int, n: int, total: int) -> np.ndarray:
    span = np.array([offset, n, total], np.int32)
    span.setflags(write=False)
    return span


@functools.lru_cache(maxsize=_PLAN_CACHE_SIZE)
def _make_plan(grid_bytes: bytes, k: int, cfg: VisionConfig, policy: BucketPolicy) -> Plan:
    """Build one plan: the bucket from Python ints, the arrays in one numba call (_build_plan)."""
    g = _grid(grid_bytes, k)
    rows = g.tolist()
    n, n_frames = sum(t * h * w for t, h, w in rows), sum(t for t, _, _ in rows)
    n_pad = policy.rung(n)
    b = policy.block_size(n_pad)
    m, s = cfg.spatial_merge_size, cfg.window_patches
    if cfg.windowed:  # (typical_windows / worst_windows, without re-reading cfg's properties)
        wm, w_typical, w_worst = cfg.window_merge, _typical_slots(n_pad, s), _worst_slots(n_pad, s, m * m)
    else:  # Qwen2-VL, or a Qwen2.5-VL config without window layers
        wm = w_typical = w_worst = 0
    # buffer size bound: W_pad <= w_worst; T <= NB + coarse(extras) <= NB + 4 F (a block's extra
    # tiles are fewer than its frames, a frame of r rows is in at most r / B + 2 blocks)
    out = _POOL.take(4 * n_pad + 2 * w_worst * s + 5 * (n_pad // b + 4 * n_frames))
    buf, w_pad, kb, n_tiles = _build_plan(g, m, wm, s, n_pad, b, w_typical, w_worst, out)
    buf.setflags(write=False)  # before slicing: the views inherit it
    g.setflags(write=False)
    pos, seg, slot, tiles, tokens, ids = _plan_views(buf, n_pad, n_tiles, w_pad, s)
    bucket = Bucket(n_pad, w_pad, kb, b, n_tiles, s)
    return Plan(bucket=bucket, pos_ids=pos, segment_ids=seg, window_tokens=tokens, window_ids=ids,
                window_slot=slot, tile_block=tiles[0], tile_first_frame=tiles[1], tile_last_frame=tiles[2],
                tile_key_start=tiles[3], tile_key_count=tiles[4], span=_span(0, n, n), grid_thw=g)


def _plan_views(buf: np.ndarray, n_pad: int, n_tiles: int, w_pad: int, s: int) -> tuple[np.ndarray, ...]:
    """(pos, seg, slot, tiles, tokens, ids): the arrays of _build_plan's buffer."""
    t0, i0 = 4 * n_pad + 5 * n_tiles, 4 * n_pad + 5 * n_tiles + w_pad * s
    return (buf[:2 * n_pad].reshape(n_pad, 2), buf[2 * n_pad:3 * n_pad], buf[3 * n_pad:4 * n_pad],
            buf[4 * n_pad:t0].reshape(5, n_tiles), buf[t0:i0].reshape(w_pad, s), buf[i0:].reshape(w_pad, s))


def _grid(grid_bytes: bytes, k: int) -> np.ndarray:
    """The int64 [k, 3] grid of a cache key, writable (numba compiles its kernels for writable
    arrays only; a read-only one would be another compile)."""
    return np.ndarray((k, 3), np.int64, bytearray(grid_bytes))
