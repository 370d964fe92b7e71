"""The numba kernels behind the plan: every loop over rows, frames and windows.

All kernels take a validated grid (int64 [k, 3] rows of (t, h, w) in patches, h and w multiples of
`merge`) or the tables derived from it, and write into arrays the caller allocates. Two tables
carry every walk over the grid, each written once:

  * `frame_starts`: int64 [F + 1], the first row of every frame (frames are contiguous runs of
    h * w rows, in grid order) and N at the end.
  * `window_table`: int64 [W, 6], one row per attention window (columns `WIN_*` below), in HF's
    window order: windows of window x window merge units tiled row-major over each frame, edge
    windows smaller.

Conventions: `merge` is spatial_merge_size (m), a merge unit is m x m patches (mu = m * m rows,
consecutive in pixel_values); `window` is the window side in merge units (cfg.window_merge); rows
and blocks are counted from 0 in the request's (unpermuted) row order.

Kernels write through slices indexed from 0 where it matters: numba then needs no negative-index
handling and LLVM vectorises the inner loops (benchmarks/RESULTS.md, "Host plans vs HF"). A plan is
one call from Python, `build_plan`, compiled together with the helpers it calls. The first compile
is paid once per install (cache=True; later processes load it in well under a second) but it counts,
so plain loops throughout.
"""

from __future__ import annotations

import numba
import numpy as np

# Columns of window_table (all in merge units).
WIN_BASE = 0  # index of the first merge unit of the window's frame in the request
WIN_FRAME_COLS = 1  # merge units per row of that frame (w / m)
WIN_Y0 = 2  # the window's top row in the frame
WIN_X0 = 3  # its left column
WIN_ROWS = 4  # its height (<= window; smaller at the frame's bottom edge)
WIN_COLS = 5  # its width (<= window; smaller at the right edge)


# ---- the two walks over the grid ---------------------------------------------------------------
@numba.njit(cache=True)
def frame_starts(grid):
    """int64 [F + 1]: starts[f] = first row of frame f, starts[F] = N (rows of the grid)."""
    n_frames = 0
    for g in range(grid.shape[0]):
        n_frames += grid[g, 0]
    starts = np.empty(n_frames + 1, np.int64)
    starts[0] = 0
    f = 0
    for g in range(grid.shape[0]):
        size = grid[g, 1] * grid[g, 2]
        for _ in range(grid[g, 0]):
            starts[f + 1] = starts[f] + size
            f += 1
    return starts


@numba.njit(cache=True)
def count_windows(grid, merge, window):
    """Windows of the grid, edge windows included: sum of t * ceil(h/m / window) * ceil(w/m / window)."""
    n = 0
    for g in range(grid.shape[0]):
        n += grid[g, 0] * -(-(grid[g, 1] // merge) // window) * -(-(grid[g, 2] // merge) // window)
    return n


@numba.njit(cache=True)
def window_table(grid, merge, window):
    """int64 [W, 6]: every window of the grid in HF order (columns WIN_*).

    HF's extra all-padding windows (when a side divides evenly) are never emitted, which is exactly
    what its `unique_consecutive` leaves.
    """
    table = np.empty((count_windows(grid, merge, window), 6), np.int64)
    w = 0
    base = 0  # merge units before the current frame
    for g in range(grid.shape[0]):
        unit_rows, unit_cols = grid[g, 1] // merge, grid[g, 2] // merge
        for _ in range(grid[g, 0]):
            for y0 in range(0, unit_rows, window):
                for x0 in range(0, unit_cols, window):
                    table[w, WIN_BASE] = base
                    table[w, WIN_FRAME_COLS] = unit_cols
                    table[w, WIN_Y0] = y0
                    table[w, WIN_X0] = x0
                    table[w, WIN_ROWS] = min(window, unit_rows - y0)
                    table[w, WIN_COLS] = min(window, unit_cols - x0)
                    w += 1
            base += unit_rows * unit_cols
    return table


# ---- HF-exact index arrays ---------------------------------------------------------------------
@numba.njit(cache=True)
def fill_rotary_ids(grid, merge, pos_flat):
    """Rotary (h, w) patch coordinates of every row, padding rows 0.

    pos_flat: int32 [2 * N_pad], the flat view of pos [N_pad, 2]. Rows of a frame come in
    merge-unit-major order (units row-major over the merged grid, the m x m patches of a unit
    row-major inside it); every frame of a grid row has the same ids, so the first is copied.
    """
    r = 0
    for g in range(grid.shape[0]):
        t, h, w = grid[g, 0], grid[g, 1], grid[g, 2]
        frame_len = 2 * h * w
        first = pos_flat[r : r + frame_len]
        q = 0
        for unit_y in range(h // merge):
            for unit_x in range(w // merge):
                for i in range(merge):
                    for j in range(merge):
                        first[q] = unit_y * merge + i
                        first[q + 1] = unit_x * merge + j
                        q += 2
        r += frame_len
        for _ in range(1, t):
            dst = pos_flat[r : r + frame_len]
            for q in range(frame_len):
                dst[q] = first[q]
            r += frame_len
    pad = pos_flat[r:]
    for q in range(pad.shape[0]):
        pad[q] = 0


@numba.njit(cache=True)
def fill_window_order(windows, merge, index, cu):
    """HF's window permutation (`get_vision_window_index` after its `unique_consecutive`).

    windows: int64 [W, 6] (window_table). Outputs: index int64 [N / mu], index[p] = the merge unit
    at window-order position p; cu int32 [W + 1], cu_window_seqlens in rows (patches).
    """
    cu[0] = 0
    p = 0
    for w in range(windows.shape[0]):
        base, cols, y0, x0 = windows[w, WIN_BASE], windows[w, WIN_FRAME_COLS], windows[w, WIN_Y0], windows[w, WIN_X0]
        for y in range(y0, y0 + windows[w, WIN_ROWS]):
            for x in range(x0, x0 + windows[w, WIN_COLS]):
                index[p] = base + y * cols + x
                p += 1
        cu[w + 1] = p * merge * merge


# ---- window slots --------------------------------------------------------------------------------
@numba.njit(cache=True)
def pack_windows(windows, slot_units, win_slot):
    """Best-fit decreasing packing of windows into slots of `slot_units` merge units; returns the
    slot count.

    windows: int64 [W, 6] (window_table); slot_units = window^2. Output win_slot: int64 [W], the slot
    of each window. Windows are taken longest first (a stable counting sort: equal lengths keep HF
    order) and each goes into the open slot with the least remaining room that still fits it, or
    into a new slot. Open slots sit in one LIFO list per room (head[room], linked through next_open),
    so a placement is O(slot_units).
    """
    n_win = windows.shape[0]
    length = np.empty(n_win, np.int64)  # merge units per window
    for w in range(n_win):
        length[w] = windows[w, WIN_ROWS] * windows[w, WIN_COLS]
    count = np.zeros(slot_units + 1, np.int64)
    head = np.full(slot_units + 1, -1, np.int64)
    order = np.empty(n_win, np.int64)  # windows, longest first
    next_open = np.empty(n_win, np.int64)
    for w in range(n_win):
        count[length[w]] += 1
    pos = 0
    for units in range(slot_units, -1, -1):  # start offset of each length, longest first
        k = count[units]
        count[units] = pos
        pos += k
    for w in range(n_win):
        order[count[length[w]]] = w
        count[length[w]] += 1
    n_slots = 0
    for i in range(n_win):
        w = order[i]
        need = length[w]
        slot = -1
        room = slot_units
        for r in range(need, slot_units):  # an open slot always has room < slot_units (it holds a window)
            if head[r] >= 0:
                slot = head[r]
                head[r] = next_open[slot]
                room = r
                break
        if slot < 0:
            slot = n_slots
            n_slots += 1
        win_slot[w] = slot
        room -= need
        if room > 0:  # a full slot is closed for good
            next_open[slot] = head[room]
            head[room] = slot
    return n_slots


@numba.njit(cache=True)
def fill_window_slots(windows, merge, slot_rows, win_slot, n_slots, tokens, ids, row_slot):
    """Scatter rows into their packed slots; empty slot entries get -1.

    windows: int64 [W, 6] (window_table); win_slot: int64 [W] from pack_windows; n_slots: its
    count. Outputs: tokens / ids int32 [W_pad * S] (flat views of [W_pad, S], S = slot_rows,
    W_pad >= n_slots): the row / window id at each slot entry; row_slot int32 [N_pad]: the flat
    entry of each real row (padding rows 0). Inside a slot its windows sit one after another in HF
    order, and each window's rows keep HF's order (rows mu*u .. mu*u + mu - 1 of merge unit u); a
    window row of c merge units is one run of c * mu consecutive rows.
    """
    mu = merge * merge
    used = np.zeros(n_slots, np.int64)  # entries filled per slot
    n_real = 0
    for w in range(windows.shape[0]):
        base, cols, y0, x0 = windows[w, WIN_BASE], windows[w, WIN_FRAME_COLS], windows[w, WIN_Y0], windows[w, WIN_X0]
        run = windows[w, WIN_COLS] * mu
        slot = win_slot[w]
        entry = slot * slot_rows + used[slot]  # flat entry of the window's next row
        for y in range(y0, y0 + windows[w, WIN_ROWS]):
            row0 = (base + y * cols + x0) * mu
            tok, wid, back = tokens[entry : entry + run], ids[entry : entry + run], row_slot[row0 : row0 + run]
            for j in range(run):
                tok[j] = row0 + j
                wid[j] = w
                back[j] = entry + j
            entry += run
        used[slot] = entry - slot * slot_rows
        n_real += windows[w, WIN_ROWS] * windows[w, WIN_COLS] * mu
    pad = row_slot[n_real:]
    for q in range(pad.shape[0]):
        pad[q] = 0
    for slot in range(tokens.shape[0] // slot_rows):
        start = slot * slot_rows + (used[slot] if slot < n_slots else 0)
        tok, wid = tokens[start : (slot + 1) * slot_rows], ids[start : (slot + 1) * slot_rows]
        for j in range(tok.shape[0]):
            tok[j] = -1
            wid[j] = -1


# ---- full-attention tiles ------------------------------------------------------------------------
@numba.njit(cache=True)
def coarse(n):
    """coarse_ladder_value (1, 2, 3, 4, 6, 8, 12, ...: the smallest >= n; 0 for n <= 0), in numba."""
    if n <= 0:
        return 0
    p = 1
    while p < n:
        if p >= 2 and p + p // 2 >= n:
            return p + p // 2
        p *= 2
    return p


@numba.njit(cache=True)
def frame_blocks(starts, block):
    """(first_block, last_block): int64 [F] each, the first and last block of `block` rows that
    hold rows of frame f. starts: int64 [F + 1] (frame_starts)."""
    n_frames = starts.shape[0] - 1
    first_block, last_block = np.empty(n_frames, np.int64), np.empty(n_frames, np.int64)
    for f in range(n_frames):
        first_block[f] = starts[f] // block
        last_block[f] = (starts[f + 1] - 1) // block
    return first_block, last_block


@numba.njit(cache=True)
def align_up(n, a):
    """The least multiple of a >= n."""
    return -(-n // a) * a


@numba.njit(cache=True)
def group_tiles(starts, first_block, last_block, n_blocks, n_pad, key_rows, tiles):
    """Cut every query block's frames into tiles whose keys fit a window of `key_rows` rows;
    returns the number of extra tiles (tiles beyond one per block).

    starts: int64 [F + 1] (frame_starts); first_block / last_block: int64 [F] (frame_blocks). A
    tile is (query block, a run of consecutive frames with rows in it); its keys are the rows from
    its first frame's first row to its last frame's last row. Greedy per block: a frame joins the
    current run while the run's rows stay within key_rows (>= any single frame). Block i's first run
    is tile i, its other runs are extra tiles n_blocks, n_blocks + 1, ... in block order. A block
    without frames (pure padding) gets an empty tile i.

    tiles: int32 [4, T] (rows: block, first frame, last frame, key window start), T >= n_blocks +
    extras, or an empty [4, 0] array to only count. The key window is the key_rows rows from its
    start: the run's first row, moved left where the window would pass n_pad, so it always holds
    the run. An empty tile has first frame 0, last frame -1 and window start 0; unused extra tiles
    stay empty.
    """
    fill = tiles.shape[1] > 0
    if fill:
        for t in range(tiles.shape[1]):
            tiles[0, t], tiles[1, t], tiles[2, t], tiles[3, t] = 0, 0, -1, 0
    last_start = n_pad - key_rows  # the window's last possible start
    n_frames = first_block.shape[0]
    extra = 0
    first_open = 0  # first frame that ends in or after block i
    for i in range(n_blocks):
        while first_open < n_frames and last_block[first_open] < i:
            first_open += 1
        if fill:
            tiles[0, i] = i
        f = first_open
        runs = 0
        while f < n_frames and first_block[f] <= i:  # one run of frames per iteration
            key_start, run_first = starts[f], f
            f += 1
            while f < n_frames and first_block[f] <= i and starts[f + 1] - key_start <= key_rows:
                f += 1
            t = i if runs == 0 else n_blocks + extra
            if fill:
                tiles[0, t], tiles[1, t], tiles[2, t] = i, run_first, f - 1
                tiles[3, t] = min(key_start, last_start)
            if runs > 0:
                extra += 1
            runs += 1
    return extra


KEY_ALIGN = 16  # rows: a tight bucket's key window is its widest run rounded up to this


@numba.njit(cache=True)
def choose_tiles(starts, first_block, last_block, n_blocks, block, n_pad, tight):
    """(K, T): the key rows of every tile's window and the tile count of full attention, chosen to
    minimise T * K (the attention computed per full layer), ties to fewer tiles.

    starts: int64 [F + 1] (frame_starts); first_block / last_block: int64 [F] (frame_blocks).
    Candidates run from the widest frame up to the widest block's union of frames (rows from the
    first row of its first frame to the last row of its last; with that K, T == n_blocks: one tile
    per block, no extras), capped at n_pad. Ladder buckets (not `tight`) keep programs few: K is
    `block` times a coarse-ladder value and T = n_blocks + coarse(extras), so a single frame in its
    rung gets K = n_pad. Tight buckets are one program per recurring grid anyway: K is the widest
    frame rounded up to KEY_ALIGN rows (then 1.25x steps) and T = n_blocks + extras exactly.
    """
    n_frames = first_block.shape[0]
    no_tiles = np.empty((4, 0), np.int32)
    widest_frame = 1
    for f in range(n_frames):
        widest_frame = max(widest_frame, starts[f + 1] - starts[f])
    widest_union = widest_frame
    first_open = 0  # first frame that ends in or after block i
    for i in range(n_blocks):
        while first_open < n_frames and last_block[first_open] < i:
            first_open += 1
        last_open = first_open  # last frame that starts in or before block i
        while last_open + 1 < n_frames and first_block[last_open + 1] <= i:
            last_open += 1
        if first_open < n_frames and first_block[first_open] <= i:
            widest_union = max(widest_union, starts[last_open + 1] - starts[first_open])
    if tight:
        k = min(align_up(widest_frame, KEY_ALIGN), n_pad)
        best_k = min(align_up(widest_union, KEY_ALIGN), n_pad)
    else:
        k = min(block * coarse(-(-widest_frame // block)), n_pad)
        best_k = min(block * coarse(-(-widest_union // block)), n_pad)
    best_t = n_blocks
    while k < best_k:
        extras = group_tiles(starts, first_block, last_block, n_blocks, n_pad, k, no_tiles)
        t = n_blocks + (extras if tight else coarse(extras))
        if t * k < best_t * best_k:
            best_k, best_t = k, t
        if tight:
            k = min(align_up(k + k // 4, KEY_ALIGN), n_pad)
        else:
            k = min(block * coarse(k // block + 1), n_pad)
    return best_k, best_t


# ---- one plan --------------------------------------------------------------------------------------
@numba.njit(cache=True)
def buffer_layout(n_pad, n_tiles, w_pad, slot_rows):
    """Where each array of a plan lies in its int32 buffer: the end offsets of
        pos [N_pad, 2] | seg [N_pad] | row_slot [N_pad] | tiles [4, T] | tokens [W_pad, S] | ids [W_pad, S]
    (each starts where the previous ends; the last end is the buffer's size). The only definition
    of the layout: build_plan writes by it and assembly reads by it (through `.py_func`, plain
    Python)."""
    pos_end = 2 * n_pad
    seg_end = pos_end + n_pad
    slot_end = seg_end + n_pad
    tiles_end = slot_end + 4 * n_tiles
    tokens_end = tiles_end + w_pad * slot_rows
    return pos_end, seg_end, slot_end, tiles_end, tokens_end, tokens_end + w_pad * slot_rows


@numba.njit(cache=True)
def build_plan(grid, merge, window, slot_rows, n_pad, block, tight, w_typical, w_worst, key_rows, out):
    """Every int32 array of one plan, in one buffer laid out by buffer_layout; returns
    (buffer, W_pad, K, T).

    grid: int64 [k, 3] (N real rows); window: side in merge units (0: no window attention,
    W_pad = 0); slot_rows: S; n_pad, block: the bucket's rows and block size; w_typical / w_worst:
    typical_windows / worst_windows of n_pad. W_pad is w_typical whenever the packing fits it, else
    w_worst (always enough). K and T: choose_tiles (`tight`: the bucket is the grid's own), or with
    key_rows > 0 that K (>= the widest frame) and T = n_blocks + the extra tiles it needs. The
    buffer is the front of `out` when that is large enough (a recycled block of the plan buffer
    pool, whose pages are already mapped), else a new array. One buffer, not six arrays: numba
    returns (boxes) one array instead of six, which is most of an image's plan time.
    """
    n_blocks = n_pad // block
    starts = frame_starts(grid)
    first_block, last_block = frame_blocks(starts, block)
    if key_rows > 0:
        n_tiles = n_blocks + group_tiles(
            starts, first_block, last_block, n_blocks, n_pad, key_rows, np.empty((4, 0), np.int32)
        )
    else:
        key_rows, n_tiles = choose_tiles(starts, first_block, last_block, n_blocks, block, n_pad, tight)
    windows = window_table(grid, merge, window) if window > 0 else np.empty((0, 6), np.int64)
    win_slot = np.empty(windows.shape[0], np.int64)
    n_slots = w_pad = 0
    if window > 0:
        n_slots = pack_windows(windows, window * window, win_slot)
        w_pad = w_typical if n_slots <= w_typical else w_worst
        assert n_slots <= w_pad

    pos_end, seg_end, slot_end, tiles_end, tokens_end, size = buffer_layout(n_pad, n_tiles, w_pad, slot_rows)
    buf = out[:size] if out.shape[0] >= size else np.empty(size, np.int32)
    fill_rotary_ids(grid, merge, buf[:pos_end])
    seg = buf[pos_end:seg_end]
    for f in range(starts.shape[0] - 1):
        frame = seg[starts[f] : starts[f + 1]]
        for q in range(frame.shape[0]):
            frame[q] = f
    pad = seg[starts[-1] :]
    for q in range(pad.shape[0]):
        pad[q] = -1
    group_tiles(starts, first_block, last_block, n_blocks, n_pad, key_rows, buf[slot_end:tiles_end].reshape(4, n_tiles))
    row_slot = buf[seg_end:slot_end]
    if window > 0:
        fill_window_slots(
            windows, merge, slot_rows, win_slot, n_slots, buf[tiles_end:tokens_end], buf[tokens_end:size], row_slot
        )
    else:
        for q in range(n_pad):
            row_slot[q] = 0
    return buf, w_pad, key_rows, n_tiles


# ---- splitting a request -----------------------------------------------------------------------------
@numba.njit(cache=True)
def split_chunks(grid, rungs, cap, penalty, min_patches, rows, starts, keys, key_starts):
    """split_grid's cut of a grid into chunks; returns the chunk count C.

    One chunk when the request is a single frame or at most min_patches rows. Otherwise the optimal
    cut, by dynamic programming over frame boundaries (O(F * frames per chunk)): a chunk is frames
    j..i-1 with at most `cap` rows, or a single frame of any size, and costs rungs[first rung >= its
    rows] + penalty; best[i] = least cost of frames 0..i-1, prev[i] = start of the last chunk. Ties
    keep the shortest last chunk (earlier chunks are the larger ones). rungs: int64 [R], ascending,
    ending above any chunk's rows.

    Outputs, int64 arrays the caller allocates: rows / keys [k + F, 3] (each cut splits at most one
    grid row, so k + C - 1 rows suffice), starts / key_starts [F + 1]. Chunk c is
    rows[starts[c]:starts[c + 1]], the grid rows it takes frames from, a video row cut along t where
    a chunk boundary falls inside it; keys[key_starts[c]:key_starts[c + 1]] is the same chunk with
    adjacent rows of equal (h, w) merged: every plan array depends on the frame sequence only, so
    chunks with equal keys share one plan.
    """
    frame_row = frame_starts(grid)  # frame_row[i] = rows of frames 0..i-1
    n_frames = frame_row.shape[0] - 1
    prev = np.empty(n_frames + 1, np.int64)
    prev[n_frames] = 0
    if n_frames > 1 and frame_row[n_frames] > min_patches:
        best = np.empty(n_frames + 1, np.int64)
        best[0] = 0
        for i in range(1, n_frames + 1):
            best[i] = -1
            r = 0
            for j in range(i - 1, -1, -1):
                size = frame_row[i] - frame_row[j]
                if size > cap and j < i - 1:
                    break
                while rungs[r] < size:
                    r += 1
                cost = best[j] + rungs[r] + penalty
                if best[i] < 0 or cost < best[i]:
                    best[i] = cost
                    prev[i] = j
    cuts = np.empty(n_frames + 1, np.int64)  # chunk boundaries (frames), filled from the end
    cuts[n_frames] = n_frames
    n_chunks = 0
    while cuts[n_frames - n_chunks] > 0:
        cuts[n_frames - n_chunks - 1] = prev[cuts[n_frames - n_chunks]]
        n_chunks += 1
    cuts = cuts[n_frames - n_chunks :]

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
