"""The positions of one prompt row, for kernels.lm_rows: text runs cut into HF's pieces, vision
blocks, audio runs, the Omni thinkers' audio-in-video blocks and text-only branch.

Positions are int64, or float32 for a family whose HF code keeps them as floats (Qwen3-Omni: a
video's time may be fractional): every position value goes through `as_pos`, so the float32 kernel
rounds where torch's float32 tensors do. Nothing here raises: an error is written to the record
`err` (`fail`), which positions.py turns into a ValueError naming the row and the item.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types as nbt
from numba.extending import overload

from .config import (
    K_ADVANCE,
    K_AIV,
    K_ASTART,
    K_MERGE,
    K_SPLIT,
    K_TPC,
    K_VSTART,
)

# The error record: (code, row, kind, index, got, expected, frame); the kernel returns it followed by
# (V, image tokens, video tokens, audio tokens) of the splice's columns.
E_OK = 0
E_MORE_RUNS = 1  # more runs of a kind than its grids / lengths: (code, row, kind, index, 0, 0)
E_RUN_LENGTH = 2  # a run's length is not its item's token count: (code, row, kind, index, got, expected)
E_EMPTY_ROW = 3  # no unmasked token in the row
E_AIV_FRAME = 4  # an audio-in-video block not right after <vision_start><audio_start>: (.., video, 0, 0)
E_AIV_TOKEN = 5  # a token of an audio-in-video block of the wrong kind: (.., video, column, expected kind)
E_AIV_END = 6  # the two tokens after a Qwen2.5-Omni audio-in-video block are missing or not text: (.., video)
E_COUNT = 7  # a kind's token count differs from its embedding rows: (code, -1, kind, 0, tokens, rows)
E_BAD_TYPE = 8  # a token type outside 0..3: (.., 0, column, type, 0)
E_BAD_MASK = 9  # an attention_mask value other than 0 / 1: (.., 0, column, value, 0)
E_LEFT_OVER = 11  # items no run used: (code, -1, kind, 0, used, given)
E_PARTIAL_VIDEO = 12  # a video with runs for only some of its frames: (code, -1, VIDEO, video, frames, t)
# kinds, as token types
TEXT, IMAGE, VIDEO, AUDIO = 0, 1, 2, 3
NOT_GIVEN = -1  # a kind's embeddings are not spliced: its tokens keep their text rows (HF)
AS_FOUND = -2  # a kind's embedding rows are its token count (lm_inputs: the grids checked it)


# Explicit signatures on the helpers called with literal arguments: without them numba compiles one
# specialization per call site's literal types, most of a cold compile's time.
@numba.njit("void(int64[:], int64, int64, int64, int64, int64, int64)", cache=True)
def fail(err, code, row, kind, index, got, expected):
    err[0] = code
    err[1] = row
    err[2] = kind
    err[3] = index
    err[4] = got
    err[5] = expected
    err[6] = 0


@numba.njit("UniTuple(int64, 11)(int64[:], int64, int64[:])", cache=True)
def result(err, v, counts):
    return err[0], err[1], err[2], err[3], err[4], err[5], err[6], v, counts[0], counts[1], counts[2]


def as_pos(x, pos):
    """x as a position of `pos`'s dtype (numba only)."""


@overload(as_pos)
def _as_pos_impl(x, pos):
    if isinstance(pos.dtype, nbt.Float):
        return lambda x, pos: np.float32(x)  # rounds as a float32 torch tensor op does
    return lambda x, pos: np.int64(x)


def time_pos(f, pos):
    """A float32 temporal position f as a position of `pos`'s dtype (numba only)."""


@overload(time_pos)
def _time_pos_impl(f, pos):
    if isinstance(pos.dtype, nbt.Float):
        return lambda f, pos: f  # kept as HF keeps it (Qwen3-Omni)
    return lambda f, pos: np.int64(f)  # torch's .long(): truncation (positions are >= 0)


@numba.njit(cache=True)
def _time(k, a, b):
    """HF's temporal position of frame k, in float32 as torch computes it: f32(f32(k) * a) * b."""
    return np.float32(np.float32(np.float32(k) * a) * b)


@numba.njit(cache=True)
def put(pos, b, j, p0, p1, p2):
    pos[0, b, j] = p0
    pos[1, b, j] = p1
    pos[2, b, j] = p2
    return max(p0, max(p1, p2))


@numba.njit(cache=True)
def _block(rp0, rp1, rp2, idx, k, gt, gh, gw, a, bb, st):
    """One vision item's [gt, gh, gw] positions (into the row's t, h, w views rp0, rp1, rp2) at
    compressed columns k.. from start `st`; returns the block's largest position."""
    top = as_pos(-1, rp0)
    n = gt * gh * gw
    contiguous = idx[k + n - 1] - idx[k] == n - 1  # no masked hole inside
    c = k
    j = np.uint64(idx[k])  # unsigned: numba checks no negative index, so the stores vectorise
    for ti in range(gt):
        tp = as_pos(st + time_pos(_time(ti, a, bb), rp0), rp0)
        for hi in range(gh):
            hp = as_pos(st + hi, rp0)
            if contiguous:
                for wi in range(gw):
                    q = j + np.uint64(wi)
                    rp0[q] = tp
                    rp1[q] = hp
                    rp2[q] = as_pos(st + wi, rp0)
                j += np.uint64(gw)
            else:
                for wi in range(gw):
                    q = idx[c + wi]
                    rp0[q] = tp
                    rp1[q] = hp
                    rp2[q] = as_pos(st + wi, rp0)
            c += gw
        top = max(top, tp)
    return max(top, as_pos(st + (max(gh, gw) - 1), rp0))


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


@numba.njit(cache=True)
def _audio_in_video(pos, trow, b, idx, k, n, grid, vi, st, a, bb, alen, knobs, err):
    """One video with its audio track from compressed column k: positions of the V video and A audio
    tokens in the family's interleaving, each token's kind checked. Returns (next column, largest
    position of the last piece HF appends, largest position of the block), next column -1 on an
    error (written to err)."""
    merge = knobs[K_MERGE]
    gt, gh, gw = grid[vi, 0], grid[vi, 1] // merge, grid[vi, 2] // merge
    hw = gh * gw
    nv = gt * hw
    tv = np.empty(gt, np.float32)
    for ti in range(gt):
        tv[ti] = _time(ti, a, bb)
    none = as_pos(0, pos)
    if k + nv + alen > n:
        fail(err, E_AIV_TOKEN, b, VIDEO, vi, n, VIDEO)
        return -1, none, none
    c = k
    last = as_pos(-1, pos)
    top = as_pos(-1, pos)
    if knobs[K_AIV] == 1:  # Qwen2.5-Omni (int positions): chunk j of the video, then chunk j of the audio
        tpc = knobs[K_TPC]
        vals = np.empty(nv, np.int64)
        for i in range(nv):
            vals[i] = np.int64(tv[i // hw])
        vend = np.empty(nv + 1, np.int64)
        aend = np.empty(alen + 1, np.int64)
        nvc = _chunks(vals, nv, tpc, vend)
        nac = _chunks(np.arange(alen), alen, tpc, aend)
        v0 = 0
        a0 = 0
        for ch in range(max(nvc, nac)):
            if ch < nvc:
                last = as_pos(-1, pos)
                for i in range(v0, vend[ch]):
                    if trow[idx[c]] != VIDEO:
                        fail(err, E_AIV_TOKEN, b, VIDEO, vi, idx[c], VIDEO)
                        return -1, none, none
                    r = i % hw
                    p = put(
                        pos,
                        b,
                        idx[c],
                        as_pos(st + vals[i], pos),
                        as_pos(st + r // gw, pos),
                        as_pos(st + r % gw, pos),
                    )
                    last = max(last, p)
                    c += 1
                v0 = vend[ch]
                top = max(top, last)
            if ch < nac:
                last = as_pos(-1, pos)
                for i in range(a0, aend[ch]):
                    if trow[idx[c]] != AUDIO:
                        fail(err, E_AIV_TOKEN, b, VIDEO, vi, idx[c], AUDIO)
                        return -1, none, none
                    p = as_pos(st + i, pos)
                    last = max(last, put(pos, b, idx[c], p, p, p))
                    c += 1
                a0 = aend[ch]
                top = max(top, last)
        return c, last, top
    # Qwen3-Omni: one token at a time, the video's first on equal temporal positions, then the rest
    i = 0
    ai = 0
    while i < nv and ai < alen:
        vt = as_pos(st + time_pos(tv[i // hw], pos), pos)
        at = as_pos(st + ai, pos)
        if vt <= at:
            if trow[idx[c]] != VIDEO:
                fail(err, E_AIV_TOKEN, b, VIDEO, vi, idx[c], VIDEO)
                return -1, none, none
            r = i % hw
            last = put(pos, b, idx[c], vt, as_pos(st + r // gw, pos), as_pos(st + r % gw, pos))
            i += 1
        else:
            if trow[idx[c]] != AUDIO:
                fail(err, E_AIV_TOKEN, b, VIDEO, vi, idx[c], AUDIO)
                return -1, none, none
            last = put(pos, b, idx[c], at, at, at)
            ai += 1
        top = max(top, last)
        c += 1
    if i < nv or ai < alen:  # the tail is one piece: its largest position
        last = as_pos(-1, pos)
    while i < nv:
        if trow[idx[c]] != VIDEO:
            fail(err, E_AIV_TOKEN, b, VIDEO, vi, idx[c], VIDEO)
            return -1, none, none
        r = i % hw
        vt = as_pos(st + time_pos(tv[i // hw], pos), pos)
        last = max(last, put(pos, b, idx[c], vt, as_pos(st + r // gw, pos), as_pos(st + r % gw, pos)))
        i += 1
        c += 1
    while ai < alen:
        if trow[idx[c]] != AUDIO:
            fail(err, E_AIV_TOKEN, b, VIDEO, vi, idx[c], AUDIO)
            return -1, none, none
        at = as_pos(st + ai, pos)
        last = max(last, put(pos, b, idx[c], at, at, at))
        ai += 1
        c += 1
    return c, last, max(top, last)


@numba.njit(cache=True)
def text_only_row(mask, have_mask, b, length, pos, deltas):
    """The Omni thinkers' branch without image and video grids: cumsum(mask) - 1, padding 1."""
    cur = as_pos(0, pos)
    top = as_pos(-1, pos)
    for j in range(length):
        if not have_mask or mask[b, j] == 1:
            put(pos, b, j, cur, cur, cur)
            top = max(top, cur)
            cur = as_pos(cur + 1, pos)
        else:
            one = as_pos(1, pos)
            put(pos, b, j, one, one, one)
            top = max(top, one)
    deltas[b, 0] = as_pos(as_pos(top + 1, pos) - cur, pos)


@numba.njit(cache=True)
def run_end(trow, j, end, t):
    """The end of the run of token type t at trow[j] (int8, a row padded past its end), at most
    `end`: eight tokens a step where it can (one 8-byte compare once compiled; unsigned indices:
    numba checks no negative index)."""
    e = j + 1
    while e + 8 <= end:
        u = np.uint64(e)
        same = trow[u] == t
        for i in range(1, 8):
            same &= trow[u + np.uint64(i)] == t
        if not same:
            break
        e += 8
    while e < end and trow[e] == t:
        e += 1
    return e


@numba.njit(cache=True)
def _run_length(trow, idx, k, n, t, flat, lo, expect):
    """The length of the run of token type t from compressed column k. A run of its item's length
    `expect` is checked without a branch per token (vectorised); otherwise it is scanned."""
    if 0 < expect and k + expect <= n:
        bad = 0
        if flat:
            run = trow[lo + k : lo + k + expect]  # a view indexed from 0: the loop vectorises
            for c in range(expect):
                bad |= run[c] != t
            after = k + expect == n or trow[lo + k + expect] != t
        else:
            for c in range(k, k + expect):
                bad |= trow[idx[c]] != t
            after = k + expect == n or trow[idx[k + expect]] != t
        if not bad and after:
            return expect
    if flat:
        return run_end(trow, lo + k, lo + n, t) - lo - k
    r = 1
    while k + r < n and trow[idx[k + r]] == t:
        r += 1
    return r


@numba.njit(cache=True)
def _piece(rp0, rp1, rp2, idx, lo, hi, base, contiguous):
    """HF's piece of text tokens: columns idx[lo:hi] of the row's t, h, w views at base + 0, 1, ...
    Returns the last position written (base - 1 when empty)."""
    if contiguous:
        j = np.uint64(idx[lo])  # unsigned: no negative-index check, so the stores vectorise
        for c in range(hi - lo):
            p = as_pos(base + c, rp0)
            q = j + np.uint64(c)
            rp0[q] = p
            rp1[q] = p
            rp2[q] = p
    else:
        for c in range(hi - lo):
            p = as_pos(base + c, rp0)
            q = idx[lo + c]
            rp0[q] = p
            rp1[q] = p
            rp2[q] = p
    return as_pos(base + (hi - lo - 1), rp0)


@numba.njit(cache=True)
def positions_row(ids, trow, b, idx, n, images, videos, times, audio_len, knobs, aiv, pos, deltas, state, err):
    """Row b's positions over its n unmasked columns idx[:n]. times: float32 [image_b, video_b,
    video_a...]. state: the items consumed so far (image, video, frame into the current video,
    audio), updated. Returns False on an error (written to err).

    A run of text tokens is cut as HF cuts it: the end tokens of the item before it (from that
    item's largest position + 1), the text, the start tokens of the item after it, each piece from
    where the last one left off. With int64 positions the cuts change nothing; with float32 ones
    they round where HF's float32 tensors do."""
    merge = knobs[K_MERGE]
    split = knobs[K_SPLIT]
    advance_max = knobs[K_ADVANCE] == 1
    image_b, video_b = times[0], times[1]
    ii, vi, fi, ai = state[0], state[1], state[2], state[3]
    rp0, rp1, rp2 = pos[0, b], pos[1, b], pos[2, b]  # the row's t, h, w positions (a view costs two atomics)
    cur = as_pos(0, pos)
    top = as_pos(-1, pos)
    hold = False  # Qwen2.5-Omni: the next text token repeats the current position
    eos = 0  # the end tokens HF gives the item before (<vision_end>, or <audio_end><vision_end>)
    k = np.int64(0)  # not a literal: numba would first compile the helpers it is passed to for k = 0 alone
    lo = idx[0]
    flat = idx[n - 1] - lo == n - 1  # the row's unmasked tokens are one span: read trow itself
    while k < n:
        t = trow[idx[k]]
        expect = 0  # the run's length if it is its item's (a vision item's grid, an audio's length)
        if t == IMAGE and ii < images.shape[0]:
            expect = images[ii, 0] * (images[ii, 1] // merge) * (images[ii, 2] // merge)
        elif t == VIDEO and aiv == 0 and vi < videos.shape[0]:
            expect = (1 if split else videos[vi, 0]) * (videos[vi, 1] // merge) * (videos[vi, 2] // merge)
        elif t == AUDIO and ai < audio_len.shape[0]:
            expect = audio_len[ai]
        r = _run_length(trow, idx, k, n, t, flat, lo, expect)
        if t == TEXT:
            if hold:  # <audio_end> and <vision_end> share one position (checked: two text tokens)
                put(pos, b, idx[k], cur, cur, cur)
                hold = False
                k += 1
                r -= 1
            after = k + r < n  # an item follows: its start tokens end this run
            e = min(eos, r)
            bos = min((2 if aiv != 0 and trow[idx[k + r]] == VIDEO else 1) if after else 0, r - e)
            contiguous = idx[k + r - 1] - idx[k] == r - 1
            base = cur
            if e:  # the end tokens, then HF restarts from the largest position + 1
                last = _piece(rp0, rp1, rp2, idx, k, k + e, base, contiguous)
                top = max(top, last)
                base = as_pos(last + 1, pos)
            if r - bos > e:  # the text
                top = max(top, _piece(rp0, rp1, rp2, idx, k + e, k + r - bos, base, contiguous))
                base = as_pos(base + (r - bos - e), pos)
            if bos:  # the next item's start tokens; the item starts after them
                top = max(top, _piece(rp0, rp1, rp2, idx, k + r - bos, k + r, base, contiguous))
                base = as_pos(base + bos, pos)
            cur = base
            eos = 0
            k += r
            continue
        if hold:
            fail(err, E_AIV_END, b, VIDEO, vi - 1, 0, 0)
            return False
        if t == AUDIO:
            if ai >= audio_len.shape[0]:
                fail(err, E_MORE_RUNS, b, AUDIO, ai, 0, 0)
                return False
            if r != audio_len[ai]:
                fail(err, E_RUN_LENGTH, b, AUDIO, ai, r, audio_len[ai])
                return False
            last = _piece(rp0, rp1, rp2, idx, k, k + r, cur, idx[k + r - 1] - idx[k] == r - 1)
            top = max(top, last)
            cur = as_pos(last + 1, pos)
            ai += 1
            eos = 1
            k += r
            continue
        if t == VIDEO and aiv != 0:
            if vi >= videos.shape[0]:
                fail(err, E_MORE_RUNS, b, VIDEO, vi, 0, 0)
                return False
            if ai >= audio_len.shape[0]:
                fail(err, E_MORE_RUNS, b, AUDIO, ai, 0, 0)
                return False
            if (
                k < 2
                or trow[idx[k - 2]] != TEXT
                or trow[idx[k - 1]] != TEXT
                or ids[b, idx[k - 2]] != knobs[K_VSTART]
                or ids[b, idx[k - 1]] != knobs[K_ASTART]
            ):
                fail(err, E_AIV_FRAME, b, VIDEO, vi, 0, 0)
                return False
            if aiv == 1:  # <vision_start><audio_start> share one position; the block starts after it
                p = pos[0, b, idx[k - 2]]
                put(pos, b, idx[k - 1], p, p, p)
                st = as_pos(p + 1, pos)
            else:
                st = cur
            c, last, blk = _audio_in_video(
                pos, trow, b, idx, k, n, videos, vi, st, times[2 + vi], video_b, audio_len[ai], knobs, err
            )
            if c < 0:
                return False
            top = max(top, blk)
            cur = as_pos(last + 1, pos)
            hold = aiv == 1  # Qwen2.5-Omni: <audio_end><vision_end> share one position too
            if hold and (c + 2 > n or trow[idx[c]] != TEXT or trow[idx[c + 1]] != TEXT):
                fail(err, E_AIV_END, b, VIDEO, vi, 0, 0)
                return False
            vi += 1
            ai += 1
            eos = 2
            k = c
            continue
        if t == IMAGE:
            if ii >= images.shape[0]:
                fail(err, E_MORE_RUNS, b, IMAGE, ii, 0, 0)
                return False
            gt, gh, gw = images[ii, 0], images[ii, 1] // merge, images[ii, 2] // merge
            a, bb, item = np.float32(1.0), image_b, ii
        else:
            if vi >= videos.shape[0]:
                fail(err, E_MORE_RUNS, b, VIDEO, vi, 0, 0)
                return False
            gh, gw = videos[vi, 1] // merge, videos[vi, 2] // merge
            gt = 1 if split else videos[vi, 0]
            a, bb, item = times[2 + vi], video_b, vi
        if r != gt * gh * gw:
            fail(err, E_RUN_LENGTH, b, t, item, r, gt * gh * gw)
            if t == VIDEO and split:
                err[6] = fi
            return False
        blk = _block(rp0, rp1, rp2, idx, k, gt, gh, gw, a, bb, cur)
        top = max(top, blk)
        cur = as_pos(blk + 1, pos) if advance_max else as_pos(cur + max(gh, gw), pos)
        if t == IMAGE:
            ii += 1
        elif split:
            fi += 1
            if fi == videos[vi, 0]:
                vi += 1
                fi = 0
        else:
            vi += 1
        eos = 1
        k += r
    if hold:
        fail(err, E_AIV_END, b, VIDEO, vi - 1, 0, 0)
        return False
    deltas[b, 0] = as_pos(as_pos(top + 1, pos) - n, pos)
    state[0], state[1], state[2], state[3] = ii, vi, fi, ai
    return True
