"""The numba kernel behind `rope_index`: one pass over each row's ids, reading the family's row of
rules (config.RopeRules, packed into `knobs`).

A row is walked over its unmasked tokens only (HF drops masked tokens before grouping, so a hole in
the mask joins what is on either side of it). Text takes the next position; a vision run takes its
grid's (t, h, w) positions from the current one; an audio run counts on like text. Grids, audio
lengths and time scales are consumed in order over the whole batch, as HF's iterators are. The
kernel never raises: it writes an error record (`err`) that positions.py turns into a ValueError
naming the row and the item.
"""

from __future__ import annotations

import numba
import numpy as np

# knobs: int64 [N_KNOBS]
(
    K_MERGE,
    K_SPLIT,
    K_ADVANCE,
    K_AIV,
    K_PAD,
    K_INTEGRAL,
    K_IMAGE,
    K_VIDEO,
    K_AUDIO,
    K_GLM,
    K_VSTART_GLM,
    K_VEND_GLM,
    K_VSTART,
    K_ASTART,
    K_TPC,
    N_KNOBS,
) = range(16)
NO_ID = -(1 << 62)  # an id no token has (a family without that token)

# err: int64 [7] = (code, row, kind, index, got, expected, frame)
E_OK = 0
E_MORE_RUNS = 1  # more runs of a kind than its grids / lengths: (code, row, kind, index, 0, 0)
E_RUN_LENGTH = 2  # a run's length is not its item's token count: (code, row, kind, index, got, expected)
E_EMPTY_ROW = 3  # no unmasked token in the row
E_AIV_FRAME = 4  # an audio-in-video block not right after <vision_start><audio_start>: (.., video, 0, 0)
E_AIV_TOKEN = 5  # a token of an audio-in-video block of the wrong kind: (.., video, column, expected kind)
E_AIV_END = 6  # the two tokens after a Qwen2.5-Omni audio-in-video block are missing or not text: (.., video)
E_FRACTIONAL = 7  # a fractional temporal position (Qwen3-Omni): (.., video, frame, 0)
E_BAD_TYPE = 8  # a token type outside 0..3: (.., 0, column, type, 0)
E_BAD_MASK = 9  # an attention_mask value other than 0 / 1: (.., 0, column, value, 0)
E_BAD_GRID = 10  # a grid entry < 1, or h / w not a multiple of the merge size: (.., kind, index, 0, 0)
E_LEFT_OVER = 11  # items no run used: (code, -1, kind, 0, used, given)
E_PARTIAL_VIDEO = 12  # a video with runs for only some of its frames: (code, -1, VIDEO, video, frames, t)
# kinds, as token types
IMAGE, VIDEO, AUDIO = 1, 2, 3


# Explicit signatures on the helpers called with literal arguments: without them numba compiles one
# specialization per call site's literal types (34 of `_fail`), most of a cold compile's time.
@numba.njit("void(int64[:], int64, int64, int64, int64, int64, int64)", cache=True)
def _fail(err, code, row, kind, index, got, expected):
    err[0] = code
    err[1] = row
    err[2] = kind
    err[3] = index
    err[4] = got
    err[5] = expected
    err[6] = 0


@numba.njit(cache=True)
def _time(k, a, b):
    """HF's temporal position of frame k, in float32 as torch computes it: f32(f32(k) * a) * b."""
    return np.float32(np.float32(np.float32(k) * a) * b)


@numba.njit("boolean(int64[:, :], int64, int64, int64, int64, int64[:])", cache=True)
def _check_grid(grid, i, merge, kind, row, err):
    t, h, w = grid[i, 0], grid[i, 1], grid[i, 2]
    if t < 1 or h < 1 or w < 1 or h % merge != 0 or w % merge != 0:
        _fail(err, E_BAD_GRID, row, kind, i, 0, 0)
        return False
    return True


@numba.njit(
    "int64(int64[:, :, :], int64, int64[:], int64, int64, int64, int64, float32, float32, int64, boolean, int64, "
    "int64, int64[:])",
    cache=True,
)
def _block(pos, b, idx, k, gt, gh, gw, a, bb, st, integral, row, item, err):
    """Write one vision item's [gt, gh, gw] positions at compressed columns k.. from start `st`.
    Returns the block's largest position, or -1 on an error."""
    top = np.int64(-1)
    c = k
    for ti in range(gt):
        f = _time(ti, a, bb)
        tp = np.int64(f)  # torch's .long(): truncation (positions are >= 0)
        if integral and np.float32(tp) != f:
            _fail(err, E_FRACTIONAL, row, VIDEO, item, ti, 0)
            return -1
        for hi in range(gh):
            for wi in range(gw):
                j = idx[c]
                pos[0, b, j] = st + tp
                pos[1, b, j] = st + hi
                pos[2, b, j] = st + wi
                c += 1
        top = max(top, st + tp)
    return max(top, st + max(gh, gw) - 1)


@numba.njit(cache=True)
def _chunks(vals, n, tpc, out):
    """HF's get_chunked_index over vals[:n] (already relative to the block start): chunk ends into
    out; returns the chunk count. A new chunk starts at the first value >= (chunks so far) * tpc,
    one threshold per token (a jump over several thresholds makes one-token chunks, as HF does)."""
    count = 0
    chunk = 1
    for i in range(n):
        if vals[i] >= chunk * tpc:
            out[count] = i
            count += 1
            chunk += 1
    out[count] = n
    return count + 1


@numba.njit("int64(int64[:, :, :], int64, int64, int64, int64, int64)", cache=True)
def _put(pos, b, j, p0, p1, p2):
    pos[0, b, j] = p0
    pos[1, b, j] = p1
    pos[2, b, j] = p2
    return max(p0, max(p1, p2))


@numba.njit(
    "UniTuple(int64, 3)(int64[:, :, :], int32[:], int64, int64[:], int64, int64, int64[:, :], int64, int64, "
    "float32, float32, int64, int64[:], int64, int64[:])",
    cache=True,
)
def _audio_in_video(pos, trow, b, idx, k, n, grid, vi, st, a, bb, alen, knobs, row, err):
    """One video with its audio track from compressed column k: positions of the V video and A audio
    tokens in the family's interleaving, each token's kind checked. Returns (next column, largest
    position of the last piece HF appends, largest position of the block), next column -1 on an error."""
    merge = knobs[K_MERGE]
    gt, gh, gw = grid[vi, 0], grid[vi, 1] // merge, grid[vi, 2] // merge
    hw = gh * gw
    nv = gt * hw
    tv = np.empty(gt, np.int64)
    for ti in range(gt):
        f = _time(ti, a, bb)
        tv[ti] = np.int64(f)
        if knobs[K_INTEGRAL] and np.float32(tv[ti]) != f:
            _fail(err, E_FRACTIONAL, row, VIDEO, vi, ti, 0)
            return -1, 0, 0
    if k + nv + alen > n:
        _fail(err, E_AIV_TOKEN, row, VIDEO, vi, n, VIDEO)
        return -1, 0, 0
    c = k
    last = np.int64(-1)
    top = np.int64(-1)
    if knobs[K_AIV] == 1:  # Qwen2.5-Omni: chunk j of the video, then chunk j of the audio
        tpc = knobs[K_TPC]
        vals = np.empty(nv, np.int64)
        for i in range(nv):
            vals[i] = tv[i // hw]
        vend = np.empty(nv + 1, np.int64)
        aend = np.empty(alen + 1, np.int64)
        nvc = _chunks(vals, nv, tpc, vend)
        avals = np.arange(alen)
        nac = _chunks(avals, alen, tpc, aend)
        v0 = 0
        a0 = 0
        for ch in range(max(nvc, nac)):
            if ch < nvc:
                last = -1
                for i in range(v0, vend[ch]):
                    if trow[idx[c]] != VIDEO:
                        _fail(err, E_AIV_TOKEN, row, VIDEO, vi, idx[c], VIDEO)
                        return -1, 0, 0
                    r = i % hw
                    last = max(last, _put(pos, b, idx[c], st + vals[i], st + r // gw, st + r % gw))
                    c += 1
                v0 = vend[ch]
                top = max(top, last)
            if ch < nac:
                last = -1
                for i in range(a0, aend[ch]):
                    if trow[idx[c]] != AUDIO:
                        _fail(err, E_AIV_TOKEN, row, VIDEO, vi, idx[c], AUDIO)
                        return -1, 0, 0
                    last = max(last, _put(pos, b, idx[c], st + i, st + i, st + i))
                    c += 1
                a0 = aend[ch]
                top = max(top, last)
        return c, last, top
    # Qwen3-Omni: one token at a time, the video's first on equal temporal positions, then the rest
    i = 0
    ai = 0
    while i < nv and ai < alen:
        if tv[i // hw] <= ai:
            if trow[idx[c]] != VIDEO:
                _fail(err, E_AIV_TOKEN, row, VIDEO, vi, idx[c], VIDEO)
                return -1, 0, 0
            r = i % hw
            last = _put(pos, b, idx[c], st + tv[i // hw], st + r // gw, st + r % gw)
            i += 1
        else:
            if trow[idx[c]] != AUDIO:
                _fail(err, E_AIV_TOKEN, row, VIDEO, vi, idx[c], AUDIO)
                return -1, 0, 0
            last = _put(pos, b, idx[c], st + ai, st + ai, st + ai)
            ai += 1
        top = max(top, last)
        c += 1
    if i < nv:  # the tail is one piece: its largest position
        last = -1
        while i < nv:
            if trow[idx[c]] != VIDEO:
                _fail(err, E_AIV_TOKEN, row, VIDEO, vi, idx[c], VIDEO)
                return -1, 0, 0
            r = i % hw
            last = max(last, _put(pos, b, idx[c], st + tv[i // hw], st + r // gw, st + r % gw))
            i += 1
            c += 1
    elif ai < alen:
        last = -1
        while ai < alen:
            if trow[idx[c]] != AUDIO:
                _fail(err, E_AIV_TOKEN, row, VIDEO, vi, idx[c], AUDIO)
                return -1, 0, 0
            last = max(last, _put(pos, b, idx[c], st + ai, st + ai, st + ai))
            ai += 1
            c += 1
    return c, last, max(top, last)


@numba.njit(cache=True)
def _types_of_row(ids, b, knobs, out):  # out: int32 [L]
    """A row's token types from its ids, as the family's processor writes mm_token_type_ids."""
    if knobs[K_GLM]:
        depth = 0  # <|begin_of_video|> minus <|end_of_video|> so far, this token included
        for j in range(ids.shape[1]):
            x = ids[b, j]
            if x == knobs[K_VSTART_GLM]:
                depth += 1
            if x == knobs[K_VEND_GLM]:
                depth -= 1
            out[j] = (VIDEO if depth > 0 else IMAGE) if x == knobs[K_IMAGE] else 0
        return
    for j in range(ids.shape[1]):
        x = ids[b, j]
        out[j] = (
            IMAGE if x == knobs[K_IMAGE] else (VIDEO if x == knobs[K_VIDEO] else (AUDIO if x == knobs[K_AUDIO] else 0))
        )


@numba.njit(cache=True)
def rope_rows(ids, types, mask, images, videos, video_a, image_b, video_b, audio_len, knobs, pos, deltas, status):
    """Positions of every row (see the module docstring).

    ids int64 [B, L]; types int32 [B, L] (or [0, 0]: taken from ids, as the family's processor types them);
    mask uint8 [B, L] (or [0, 0]: no padding);
    images / videos int64 [k, 3]; video_a float32 [videos] and image_b / video_b float32: HF's time
    scaling f32(f32(k) * a) * b (images: a = 1); audio_len int64 [audios] (tokens per audio).
    Out: pos int64 [3, B, L], deltas int64 [B, 1], status int64 [11]: the error record err (status[:7],
    status[0] == 0: no error) and what was consumed (status[7:]: images, videos, frames into the
    current video, audios).
    """
    nb, length = ids.shape
    merge = knobs[K_MERGE]
    split = knobs[K_SPLIT]
    advance_max = knobs[K_ADVANCE] == 1
    aiv = knobs[K_AIV]
    pad = knobs[K_PAD]
    integral = knobs[K_INTEGRAL] == 1
    err = status[:7]
    have_types = types.shape[0] == nb
    have_mask = mask.shape[0] == nb
    idx = np.empty(length, np.int64)
    trow = np.empty(length, np.int32)
    ii = 0
    vi = 0
    fi = 0
    ai = 0
    for i in range(images.shape[0]):
        if not _check_grid(images, i, merge, IMAGE, -1, err):
            return
    for i in range(videos.shape[0]):
        if not _check_grid(videos, i, merge, VIDEO, -1, err):
            return
    for b in range(nb):
        if have_types:
            for j in range(length):
                trow[j] = types[b, j]
        else:
            _types_of_row(ids, b, knobs, trow)
        n = 0
        for j in range(length):
            m = mask[b, j] if have_mask else 1
            if m == 1:
                idx[n] = j
                n += 1
            elif m == 0:
                pos[0, b, j] = pad
                pos[1, b, j] = pad
                pos[2, b, j] = pad
            else:
                _fail(err, E_BAD_MASK, b, 0, j, m, 0)
                return
        if n == 0:
            _fail(err, E_EMPTY_ROW, b, 0, 0, 0, 0)
            return
        cur = np.int64(0)
        top = np.int64(-1)
        hold = False  # Qwen2.5-Omni: the next text token repeats the current position
        k = 0
        while k < n:
            j = idx[k]
            t = trow[j]
            if t == 0:
                pos[0, b, j] = cur
                pos[1, b, j] = cur
                pos[2, b, j] = cur
                top = max(top, cur)
                if hold:
                    hold = False
                else:
                    cur += 1
                k += 1
                continue
            if hold or t < 0 or t > 3:
                if hold:
                    _fail(err, E_AIV_END, b, VIDEO, vi - 1, 0, 0)
                else:
                    _fail(err, E_BAD_TYPE, b, 0, j, t, 0)
                return
            r = 1
            while k + r < n and trow[idx[k + r]] == t:
                r += 1
            if t == AUDIO:
                if ai >= audio_len.shape[0]:
                    _fail(err, E_MORE_RUNS, b, AUDIO, ai, 0, 0)
                    return
                if r != audio_len[ai]:
                    _fail(err, E_RUN_LENGTH, b, AUDIO, ai, r, audio_len[ai])
                    return
                for c in range(r):
                    _put(pos, b, idx[k + c], cur + c, cur + c, cur + c)
                cur += r
                top = max(top, cur - 1)
                ai += 1
                k += r
                continue
            if t == VIDEO and aiv != 0:
                if vi >= videos.shape[0]:
                    _fail(err, E_MORE_RUNS, b, VIDEO, vi, 0, 0)
                    return
                if ai >= audio_len.shape[0]:
                    _fail(err, E_MORE_RUNS, b, AUDIO, ai, 0, 0)
                    return
                if (
                    k < 2
                    or trow[idx[k - 2]] != 0
                    or trow[idx[k - 1]] != 0
                    or ids[b, idx[k - 2]] != knobs[K_VSTART]
                    or ids[b, idx[k - 1]] != knobs[K_ASTART]
                ):
                    _fail(err, E_AIV_FRAME, b, VIDEO, vi, 0, 0)
                    return
                if aiv == 1:  # <vision_start><audio_start> share one position; the block starts after it
                    p = pos[0, b, idx[k - 2]]
                    _put(pos, b, idx[k - 1], p, p, p)
                    st = p + 1
                else:
                    st = cur
                c, last, blk = _audio_in_video(
                    pos, trow, b, idx, k, n, videos, vi, st, video_a[vi], video_b, audio_len[ai], knobs, b, err
                )
                if c < 0:
                    return
                top = max(top, blk)
                cur = last + 1
                hold = aiv == 1  # Qwen2.5-Omni: <audio_end><vision_end> share one position too
                if hold and (c + 2 > n or trow[idx[c]] != 0 or trow[idx[c + 1]] != 0):
                    _fail(err, E_AIV_END, b, VIDEO, vi, 0, 0)
                    return
                vi += 1
                ai += 1
                k = c
                continue
            if t == IMAGE:
                if ii >= images.shape[0]:
                    _fail(err, E_MORE_RUNS, b, IMAGE, ii, 0, 0)
                    return
                gt, gh, gw = images[ii, 0], images[ii, 1] // merge, images[ii, 2] // merge
                a, bb, item = np.float32(1.0), image_b, ii
            else:
                if vi >= videos.shape[0]:
                    _fail(err, E_MORE_RUNS, b, VIDEO, vi, 0, 0)
                    return
                gh, gw = videos[vi, 1] // merge, videos[vi, 2] // merge
                gt = 1 if split else videos[vi, 0]
                a, bb, item = video_a[vi], video_b, vi
            if r != gt * gh * gw:
                _fail(err, E_RUN_LENGTH, b, t, item, r, gt * gh * gw)
                if t == VIDEO and split:
                    err[6] = fi
                return
            blk = _block(pos, b, idx, k, gt, gh, gw, a, bb, cur, integral, b, item, err)
            if blk < 0:
                return
            top = max(top, blk)
            cur = blk + 1 if advance_max else cur + max(gh, gw)
            if t == IMAGE:
                ii += 1
            elif split:
                fi += 1
                if fi == videos[vi, 0]:
                    vi += 1
                    fi = 0
            else:
                vi += 1
            k += r
        if hold:
            _fail(err, E_AIV_END, b, VIDEO, vi - 1, 0, 0)
            return
        deltas[b, 0] = top + 1 - n
    status[7] = ii
    status[8] = vi
    status[9] = fi
    status[10] = ai
    if fi:
        _fail(err, E_PARTIAL_VIDEO, -1, VIDEO, vi, fi, videos[vi, 0])
    elif ii != images.shape[0]:
        _fail(err, E_LEFT_OVER, -1, IMAGE, 0, ii, images.shape[0])
    elif vi != videos.shape[0]:
        _fail(err, E_LEFT_OVER, -1, VIDEO, 0, vi, videos.shape[0])
    elif ai != audio_len.shape[0]:
        _fail(err, E_LEFT_OVER, -1, AUDIO, 0, ai, audio_len.shape[0])


@numba.njit(cache=True)
def mask_u8(mask, out):
    """An integer attention mask [B, L] (any int dtype, e.g. the processors' int64) copied into out
    uint8 [B, L] in one pass; returns the flat index of the first value other than 0 / 1 (-1: none),
    instead of numpy's and / any / astype temporaries."""
    nb, length = mask.shape
    for b in range(nb):
        bad = 0
        for j in range(length):  # no exit inside, so LLVM vectorises it; a bad row is searched after
            v = mask[b, j]
            bad |= v & ~1  # nonzero for any value but 0 / 1 (negatives included)
            out[b, j] = v
        if bad:
            for j in range(length):
                if mask[b, j] != 0 and mask[b, j] != 1:
                    return b * length + j
    return -1
