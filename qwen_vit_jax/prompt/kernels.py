"""The numba kernel behind `lm_inputs`, `rope_index` and `plan_splice`: one dispatch per request,
one pass over each row's ids, reading the family's row of rules (`PromptConfig.knobs`).

Pass 1, per row: the row's token types (`row_types`, as the family's processor writes
mm_token_type_ids, or the given ones), then its positions. A row is walked over its unmasked tokens
only (HF drops masked tokens before grouping, so a hole in the mask joins what is on either side of
it). Text takes the next position; a vision run takes its grid's (t, h, w) positions from the
current one; an audio run counts on like text. Grids, audio lengths and time scales are consumed in
order over the whole batch, as HF's iterators are (row_positions.py). Pass 2: the splice's row
indices of the columns from `start` on (the new tokens; 0: all), now that every kind's token count
is known. The kernel never raises: it returns an error record that positions.py turns into a
ValueError naming the row and the item.
"""

from __future__ import annotations

import numba
import numpy as np

from .config import K_AUDIO, K_GLM, K_IMAGE, K_PAD, K_VEND_GLM, K_VIDEO, K_VSTART_GLM
from .row_positions import (
    AS_FOUND,
    AUDIO,
    E_BAD_MASK,
    E_BAD_TYPE,
    E_COUNT,
    E_EMPTY_ROW,
    E_LEFT_OVER,
    E_PARTIAL_VIDEO,
    IMAGE,
    NOT_GIVEN,
    TEXT,
    VIDEO,
    as_pos,
    fail,
    positions_row,
    put,
    result,
    text_only_row,
)


@numba.njit(cache=True)
def row_types(ids, b, knobs, out, start):
    """Row b's token types (out: [L]), as the family's processor writes mm_token_type_ids: the
    placeholder ids, and for GLM-4V (one placeholder for both) image tokens between
    <|begin_of_video|> and <|end_of_video|> are video. Returns the image, video and audio tokens
    from column `start` on."""
    ci = cv = ca = 0
    image, video, audio = knobs[K_IMAGE], knobs[K_VIDEO], knobs[K_AUDIO]
    if knobs[K_GLM]:
        vstart, vend = knobs[K_VSTART_GLM], knobs[K_VEND_GLM]
        depth = 0  # <|begin_of_video|> minus <|end_of_video|> so far, this token included
        for j in range(ids.shape[1]):
            x = ids[b, j]
            depth += (x == vstart) - (x == vend)
            t = (VIDEO if depth > 0 else IMAGE) if x == image else TEXT
            out[j] = t
    else:
        for j in range(ids.shape[1]):  # branch-free (ids are distinct): vectorised
            x = ids[b, j]
            out[j] = (x == image) * IMAGE + (x == video) * VIDEO + (x == audio) * AUDIO
    for j in range(start, ids.shape[1]):
        t = out[j]
        ci += t == IMAGE
        cv += t == VIDEO
        ca += t == AUDIO
    return ci, cv, ca


@numba.njit(cache=True)
def token_types(ids, knobs, out):
    """Every row's types (out: int32 [B, L])."""
    for b in range(ids.shape[0]):
        row_types(ids, b, knobs, out[b], 0)


@numba.njit(cache=True)
def _splice_rows(tbuf, start, want, found, rows, visual, deep_rows):
    """The splice's rows of columns start.. (see splice.py): each position's row of the table
    [text (B * L'); image rows; video rows; audio rows], L' = L - start; the visual positions; the
    joint deepstack rows ([image rows; video rows]). Returns V, the visual positions."""
    nb, length = tbuf.shape
    width = length - start
    # a kind's rows in the table: as given, as found, or none (its tokens keep their text rows)
    n_image = found[0] if want[0] == AS_FOUND else max(want[0], 0)
    n_video = found[1] if want[1] == AS_FOUND else max(want[1], 0)
    base_image = nb * width
    base_video = base_image + n_image
    base_audio = base_video + n_video
    use_image, use_video, use_audio = want[0] != NOT_GIVEN, want[1] != NOT_GIVEN, want[2] != NOT_GIVEN
    si = sv = sa = 0
    v = 0
    for b in range(nb):
        for j in range(start, length):
            c = j - start
            k = tbuf[b, j]
            r = b * width + c
            vis = False
            if k == IMAGE:
                if use_image:
                    r = base_image + si
                    vis = True
                    deep_rows[v] = si
                    v += 1
                si += 1
            elif k == VIDEO:
                if use_video:
                    r = base_video + sv
                    vis = True
                    deep_rows[v] = n_image + sv
                    v += 1
                sv += 1
            elif k == AUDIO:
                if use_audio:
                    r = base_audio + sa
                sa += 1
            rows[b, c] = r
            visual[b, c] = vis
    return v


@numba.njit(cache=True)
def _unmasked(mask, b, have_mask, idx, pos, pad):
    """Row b's unmasked columns into idx (returns their count n, or -1 - j for a mask value other
    than 0 / 1 at column j); writes `pad` at the masked ones. One contiguous span (no mask, left or
    right padding) is filled without a per-column branch."""
    length = idx.shape[0]
    if not have_mask:
        for j in range(length):
            idx[j] = j
        return length
    n = 0
    bad = 0
    for j in range(length):  # vectorised: no exit inside
        m = mask[b, j]
        bad |= m & ~1
        n += m
    if bad:
        for j in range(length):
            if mask[b, j] != 0 and mask[b, j] != 1:
                return -1 - j
    lo = 0
    while lo < length and mask[b, lo] == 0:
        lo += 1
    hi = length
    while hi > lo and mask[b, hi - 1] == 0:
        hi -= 1
    if hi - lo == n:  # one span
        for c in range(n):
            idx[c] = lo + c
        for j in range(lo):
            put(pos, b, j, pad, pad, pad)
        for j in range(hi, length):
            put(pos, b, j, pad, pad, pad)
        return n
    n = 0
    for j in range(length):
        if mask[b, j]:
            idx[n] = j
            n += 1
        else:
            put(pos, b, j, pad, pad, pad)
    return n


@numba.njit(cache=True)
def lm_rows(
    ids,
    types,
    mask,
    images,
    videos,
    times,
    audio_len,
    knobs,
    aiv,
    text_only,
    start,
    want_image,
    want_video,
    want_audio,
    pos,
    deltas,
    rows,
    visual,
    deep_rows,
):
    """Positions (pass 1) and the splice's rows (pass 2) of a batch, in one dispatch.

    ids int64 [B, L]; types int32 [B, L] (or [0, 0]: from ids, `row_types`); mask uint8 or int64
    [B, L] (or [0, 0]: no padding); images / videos int64 [k, 3] (checked as plan.as_grid checks);
    times float32 [2 + videos]: image_b, video_b, then each video's a (HF's time scaling
    f32(f32(k) * a) * b; images: a = 1); audio_len int64 [audios] (tokens per audio); knobs:
    PromptConfig.knobs; aiv: the family's audio-in-video layout or 0; text_only: 1 for the Omni
    thinkers' branch without grids (positions cumsum(mask) - 1, padding 1); start: the first
    column the splice covers; want_*: a kind's embedding rows (NOT_GIVEN, AS_FOUND or a count to
    check).
    Out: pos [3, B, L] int64 or float32 and deltas [B, 1] (pos of shape [0, 0, 0]: no positions);
    rows int32 [B, L - start], visual bool [B, L - start], deep_rows int32 [B * (L - start)]
    (rows of shape [0, 0]: no splice).
    Returns the error record (7 ints, code 0: none), then V (the visual positions) and the image,
    video and audio tokens of the splice's columns.
    """
    nb, length = ids.shape
    work = np.zeros(17, np.int64)
    err, counts, state, want = work[:7], work[7:10], work[10:14], work[14:]
    want[0], want[1], want[2] = want_image, want_video, want_audio
    want_pos = pos.shape[1] == nb and nb > 0
    have_types = types.shape[0] == nb
    have_mask = mask.shape[0] == nb
    tbuf = np.empty((nb, length), np.int32)
    idx = np.empty(length, np.int64)
    pad = as_pos(1 if text_only else knobs[K_PAD], pos)
    for b in range(nb):
        trow = tbuf[b]
        if have_types:
            ci = cv = ca = 0  # scalars: a counts[] increment per token would chain through memory
            for j in range(length):
                t = types[b, j]
                if t < TEXT or t > AUDIO:
                    fail(err, E_BAD_TYPE, b, 0, j, t, 0)
                    return result(err, 0, counts)
                trow[j] = t
                if j >= start:
                    ci += t == IMAGE
                    cv += t == VIDEO
                    ca += t == AUDIO
        else:
            ci, cv, ca = row_types(ids, b, knobs, trow, start)
        counts[0] += ci
        counts[1] += cv
        counts[2] += ca
        if not want_pos:
            continue
        n = _unmasked(mask, b, have_mask, idx, pos, pad)
        if n < 0:
            fail(err, E_BAD_MASK, b, 0, -1 - n, mask[b, -1 - n], 0)
            return result(err, 0, counts)
        if text_only:
            text_only_row(mask, have_mask, b, length, pos, deltas)
            continue
        if n == 0:
            fail(err, E_EMPTY_ROW, b, 0, 0, 0, 0)
            return result(err, 0, counts)
        if not positions_row(
            ids, trow, b, idx, n, images, videos, times, audio_len, knobs, aiv, pos, deltas, state, err
        ):
            return result(err, 0, counts)
    if want_pos and not text_only:
        ii, vi, fi, ai = state[0], state[1], state[2], state[3]
        if fi:
            fail(err, E_PARTIAL_VIDEO, -1, VIDEO, vi, fi, videos[vi, 0])
        elif ii != images.shape[0]:
            fail(err, E_LEFT_OVER, -1, IMAGE, 0, ii, images.shape[0])
        elif vi != videos.shape[0]:
            fail(err, E_LEFT_OVER, -1, VIDEO, 0, vi, videos.shape[0])
        elif ai != audio_len.shape[0]:
            fail(err, E_LEFT_OVER, -1, AUDIO, 0, ai, audio_len.shape[0])
        if err[0]:
            return result(err, 0, counts)
    for k in range(3):
        if want[k] >= 0 and counts[k] != want[k]:
            fail(err, E_COUNT, -1, k + 1, 0, counts[k], want[k])
            return result(err, 0, counts)
    v = 0
    if rows.shape[0] == nb and nb > 0:
        v = _splice_rows(tbuf, start, want, counts, rows, visual, deep_rows)
    return result(err, v, counts)
