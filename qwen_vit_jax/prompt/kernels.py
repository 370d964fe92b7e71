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

from .config import K_AUDIO, K_GLM, K_IMAGE, K_MERGE, K_PAD, K_VEND_GLM, K_VIDEO, K_VSTART_GLM
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
    run_end,
    text_only_row,
)


@numba.njit(cache=True)
def row_types(ids, b, knobs, out):
    """Row b's token types (out: [L]), as the family's processor writes mm_token_type_ids: the
    placeholder ids, and for GLM-4V (one placeholder for both) image tokens between
    <|begin_of_video|> and <|end_of_video|> are video."""
    image, video, audio = knobs[K_IMAGE], knobs[K_VIDEO], knobs[K_AUDIO]
    if knobs[K_GLM]:
        vstart, vend = knobs[K_VSTART_GLM], knobs[K_VEND_GLM]
        depth = 0  # <|begin_of_video|> minus <|end_of_video|> so far, this token included
        for j in range(ids.shape[1]):
            x = ids[b, j]
            depth += (x == vstart) - (x == vend)
            out[j] = (VIDEO if depth > 0 else IMAGE) if x == image else TEXT
    else:
        row = ids[b]
        for j in range(ids.shape[1]):  # branch-free (the ids differ): vectorised
            x = row[j]
            out[j] = np.int8(x == image) + np.int8(2) * np.int8(x == video) + np.int8(3) * np.int8(x == audio)


@numba.njit(cache=True)
def token_types(ids, knobs, out):
    """Every row's types (out: int32 [B, L])."""
    for b in range(ids.shape[0]):
        row_types(ids, b, knobs, out[b])


@numba.njit(cache=True)
def _count(tbuf, width, length, start, counts):
    """The image, video and audio tokens of columns start.. into counts (tbuf: the rows of types,
    int8, each padded to `width`), run by run."""
    for b in range(tbuf.shape[0] // width):
        row = tbuf[b * width : (b + 1) * width]
        j = start
        while j < length:
            t = row[j]
            e = run_end(row, j, length, t)
            if t != TEXT:
                counts[t - 1] += e - j
            j = e


@numba.njit(cache=True)
def _splice_rows(tbuf, width, start, rows_of, rows, visual, deep_rows, seen):
    """The splice's rows of columns start.. (see splice.py): each position's row of the table
    [text (B * L'); image rows; video rows; audio rows], L' = L - start, a kind's rows_of[k] rows
    (NOT_GIVEN: none, its tokens keep their own rows); the visual positions; the joint deepstack
    rows ([image rows; video rows]). tbuf: the rows of types (int8, each padded to `width`). Counts
    each kind's tokens into seen; returns V, the visual positions. Run by run of one token type:
    each run is a few vectorised fills."""
    nb, cols = rows.shape
    length = start + cols
    n_image, n_video = max(rows_of[0], 0), max(rows_of[1], 0)
    base = (nb * cols, nb * cols + n_image, nb * cols + n_image + n_video)
    deep_base = (0, n_image, 0)
    with_visual = visual.shape[0] == nb  # a deepstack family's (its model reads them)
    v = 0
    for b in range(nb):
        row = tbuf[b * width : (b + 1) * width]
        j = start
        while j < length:
            t = row[j]
            e = run_end(row, j, length, t)
            c, r = j - start, e - j
            # views indexed from 0: no negative-index check in the loops, so they vectorise
            rrow = rows[b, c : c + r]
            if t == TEXT or rows_of[t - 1] == NOT_GIVEN:  # the token's own (text) row
                first = b * cols + c
                for i in range(r):
                    rrow[i] = first + i
                if with_visual:
                    visual[b, c : c + r] = False
            else:
                first = base[t - 1] + seen[t - 1]
                for i in range(r):
                    rrow[i] = first + i
                if with_visual:
                    visual[b, c : c + r] = t != AUDIO
                if with_visual and t != AUDIO:
                    first = deep_base[t - 1] + seen[t - 1]
                    drow = deep_rows[v : v + r]
                    for i in range(r):
                        drow[i] = first + i
                    v += r
            if t != TEXT:
                seen[t - 1] += r
            j = e
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
        after = pos[:, b, hi:]  # a view indexed from 0: no negative-index check
        for j in range(length - hi):
            after[0, j] = after[1, j] = after[2, j] = pad
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

    ids int64 [B, L]; types int32 [B, L] (or [0, 0]: from ids, `row_types`); mask int64 [B, L]
    (or [0, 0]: no padding); images / videos int64 [k, 3] (checked as plan.as_grid checks);
    times float32 [2 + videos]: image_b, video_b, then each video's a (HF's time scaling
    f32(f32(k) * a) * b; images: a = 1); audio_len int64 [audios] (tokens per audio); knobs:
    PromptConfig.knobs; aiv: the family's audio-in-video layout or 0; text_only: 1 for the Omni
    thinkers' branch without grids (positions cumsum(mask) - 1, padding 1); start: the first
    column the splice covers; want_*: a kind's embedding rows (NOT_GIVEN, AS_FOUND or a count to
    check).
    Out: pos [3, B, L] int64 or float32 and deltas [B, 1] (pos of shape [0, 0, 0]: no positions);
    rows int32 [B, L - start], visual bool [B, L - start], deep_rows int32 [B * (L - start)]
    (rows of shape [0, 0]: no splice; visual of shape [0, 0]: no visual positions nor deepstack rows).
    Returns the error record (7 ints, code 0: none), then V (the visual positions) and the image,
    video and audio tokens of the splice's columns.
    """
    nb, length = ids.shape
    work = np.zeros(24, np.int64)  # one allocation for the small arrays
    err, counts, state, rows_of, seen = work[:7], work[7:10], work[10:14], work[14:17], work[17:20]
    want_pos = pos.shape[1] == nb and nb > 0
    have_types = types.shape[0] == nb
    have_mask = mask.shape[0] == nb
    width = (length + 8) // 8 * 8  # each row's types padded (with -1) to whole 8-byte words
    tbuf = np.empty(nb * width, np.int8)
    idx = np.empty(length, np.int64)
    pad = as_pos(1 if text_only else knobs[K_PAD], pos)
    for b in range(nb):
        trow = tbuf[b * width : (b + 1) * width]
        for j in range(length, width):
            trow[j] = -1
        if have_types:
            for j in range(length):
                t = types[b, j]
                if t < TEXT or t > AUDIO:
                    fail(err, E_BAD_TYPE, b, 0, j, t, 0)
                    return result(err, 0, counts)
                trow[j] = t
        else:
            row_types(ids, b, knobs, trow)
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
    v = 0
    if rows.shape[0] == nb and nb > 0:
        if AS_FOUND in (want_image, want_video, want_audio):  # the rows a kind has are its tokens
            if want_pos and not text_only and start == 0:  # its items' tokens: the runs matched them
                merge = knobs[K_MERGE] ** 2
                for i in range(images.shape[0]):
                    counts[0] += images[i, 0] * images[i, 1] * images[i, 2] // merge
                for i in range(videos.shape[0]):
                    counts[1] += videos[i, 0] * videos[i, 1] * videos[i, 2] // merge
                counts[2] = audio_len.sum()
            else:
                _count(tbuf, width, length, start, counts)
        rows_of[0] = counts[0] if want_image == AS_FOUND else want_image
        rows_of[1] = counts[1] if want_video == AS_FOUND else want_video
        rows_of[2] = counts[2] if want_audio == AS_FOUND else want_audio
        v = _splice_rows(tbuf, width, start, rows_of, rows, visual, deep_rows, seen)
        for k in range(3):  # HF's get_placeholder_mask check (and masked placeholders, as found)
            if rows_of[k] >= 0 and seen[k] != rows_of[k]:
                fail(err, E_COUNT, -1, k + 1, 0, seen[k], rows_of[k])
                break
        counts[0], counts[1], counts[2] = seen[0], seen[1], seen[2]
    return result(err, v, counts)
