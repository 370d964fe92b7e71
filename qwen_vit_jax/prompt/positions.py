"""`rope_index`: a prompt's 3-D M-RoPE positions and rope deltas, equal to HF's
`model.model.get_rope_index` of the checkpoint's family (in HF's dtype); `decode_positions`: the
positions of the next tokens while decoding, equal to HF's `compute_3d_position_ids` with a cache;
`token_types`: what the family's processor writes as `mm_token_type_ids`.

The per-token work is one numba dispatch (kernels.lm_rows, which also gives the splice's indices:
`lm_inputs`, `plan_splice`); `run` checks the inputs' shapes, grids (plan.as_grid) and dtypes
around it and turns the kernel's error record into a ValueError naming the row and the item.
"""

from __future__ import annotations

import numpy as np

from qwen_vit_jax.plan.grid import Grid, as_grid, checked_grid
from qwen_vit_jax.prompt import kernels as K
from qwen_vit_jax.prompt import row_positions as R
from qwen_vit_jax.prompt.config import (
    AIV_NONE,
    AUDIO_QWEN2_5_OMNI,
    AUDIO_QWEN3_OMNI,
    TIME_OMNI,
    TIME_TPS,
    PromptConfig,
    prompt_config,
)

_KIND = {1: "image", 2: "video", 3: "audio"}
_GRID_ARG = {1: "image_grid_thw", 2: "video_grid_thw", 3: "audio_seqlens"}
# Stand-ins for what was not given or is not wanted (the kernel tells them by their shape).
_EMPTY_GRID = np.zeros((0, 3), np.int64)
_NO_TYPES = np.zeros((0, 0), np.int32)
_NO_MASK = np.zeros((0, 0), np.int64)
_NO_AUDIO = np.zeros(0, np.int64)
_NO_TIMES = np.ones(2, np.float32)  # image_b = video_b = 1, no video
_NO_POS = np.zeros((0, 0, 0), np.int64)
_NO_DELTAS = np.zeros((0, 1), np.int64)
_NO_ROWS = np.zeros((0, 0), np.int32)
_NO_VISUAL = np.zeros((0, 0), np.bool_)
_NO_DEEP = np.zeros(0, np.int32)
_I64, _F32, _I32, _BOOL = (np.dtype(t) for t in (np.int64, np.float32, np.int32, np.bool_))
NOT_GIVEN, AS_FOUND = R.NOT_GIVEN, R.AS_FOUND


def position_dtype(cfg: PromptConfig) -> type:
    """The dtype of a family's positions and deltas, as HF's: float32 for Qwen3-Omni, else int64."""
    return np.float32 if cfg.rules.float_positions else np.int64


def token_types(cfg, input_ids) -> np.ndarray:
    """The modality of every token, as HF's processor of the family writes `mm_token_type_ids`.

    Args:
        cfg: a PromptConfig (or anything `prompt_config` takes).
        input_ids: int [B, L] (or [L]).
    Returns:
        int32 [B, L] (or [L]): 0 text, 1 image, 2 video, 3 audio. GLM-4V: image tokens between
        <|begin_of_video|> and <|end_of_video|> are video (2), as Glm4vProcessor types them.
    """
    cfg = prompt_config(cfg)
    ids = np.asarray(input_ids)
    if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be an integer array [B, L] or [L], got {ids.dtype} {ids.shape}")
    rows = np.ascontiguousarray(ids.reshape(-1, ids.shape[-1]) if ids.size else ids.reshape(1, -1), np.int64)
    out = np.empty(rows.shape, np.int32)
    K.token_types(rows, cfg.knobs, out)  # the kernel's own typing: one definition
    return out.reshape(ids.shape)


def audio_tokens(cfg: PromptConfig, audio_seqlens) -> np.ndarray:
    """The audio tokens of each audio, from its feature frames (`audio_seqlens`), as the family's
    thinker counts them. int64 [audios]."""
    s = np.asarray(audio_seqlens).astype(np.int64, copy=False).reshape(-1)
    if cfg.rules.audio_len == AUDIO_QWEN2_5_OMNI:
        return ((s - 1) // 2 + 1 - 2) // 2 + 1
    if cfg.rules.audio_len == AUDIO_QWEN3_OMNI:  # HF's _get_feat_extract_output_lengths
        chunk = cfg.audio_n_window * 2
        feat = (s % chunk - 1) // 2 + 1
        return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (s // chunk) * 13
    raise ValueError(f"audio_seqlens: {cfg.family} has no audio")


def rope_index(
    source,
    input_ids,
    *,
    mm_token_type_ids=None,
    image_grid_thw=None,
    video_grid_thw=None,
    second_per_grid_ts=None,
    attention_mask=None,
    audio_seqlens=None,
    use_audio_in_video: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The prompt's 3-D M-RoPE positions and rope deltas, equal element for element to HF's
    `model.model.get_rope_index` (the Omni thinkers': `thinker.get_rope_index`) of the checkpoint,
    in HF's dtype: int64, or float32 for Qwen3-Omni (a video's temporal position
    frame * second_per_grid_ts * position_id_per_seconds may be fractional there; HF keeps it).
    `lm_inputs` returns the same with the splice's indices, from the same single kernel call.

    Args:
        source: a PromptConfig or what `prompt_config` takes (a checkpoint directory, converted or HF,
            its config.json, a hub id in the local cache); read once.
        input_ids: int [B, L], placeholders already expanded (one token per merged patch).
        mm_token_type_ids: int [B, L] (0 text, 1 image, 2 video, 3 audio); default: what the family's
            HF processor writes for input_ids (`token_types`).
        image_grid_thw, video_grid_thw: int [k, 3] (t, h, w) in patches (or a `plan.Grid`), in prompt
            order over the whole batch (row 0's items first); checked by `plan.as_grid`.
        second_per_grid_ts: float [videos], seconds per temporal patch (read as float32, as HF's
            processor returns it). Qwen2.5-VL: default 1. The Omni thinkers: required with videos.
        attention_mask: 0 / 1 [B, L]; masked tokens are dropped before grouping, as HF does, and get
            HF's padding value (0; 1 for Qwen2.5-Omni, and for the Omni thinkers' text-only branch).
        audio_seqlens: int [audios], each audio's feature frames (HF: audio_feature_lengths), Omni only.
        use_audio_in_video: every video carries its audio track, laid out as the Omni processors do.
    Returns:
        (position_ids [3, B, L], deltas [B, 1]), int64 (float32 for Qwen3-Omni): deltas = largest
        position + 1 - the row's unmasked length, what `decode_positions` continues from.
    Raises:
        ValueError naming the row and the item: a placeholder run whose length is not its grid's (or
        audio's) token count, more runs than grids or grids left over, a bad grid, a
        second_per_grid_ts of the wrong length, a mask or type array of the wrong shape or values, a
        row with no unmasked token.
    """
    out = run(
        prompt_config(source),
        input_ids,
        mm_token_type_ids,
        image_grid_thw,
        video_grid_thw,
        second_per_grid_ts,
        attention_mask,
        audio_seqlens,
        use_audio_in_video,
    )
    return out[0], out[1]


def run(
    cfg: PromptConfig,
    input_ids,
    mm_token_type_ids=None,
    image_grid_thw=None,
    video_grid_thw=None,
    second_per_grid_ts=None,
    attention_mask=None,
    audio_seqlens=None,
    use_audio_in_video: bool = False,
    positions: bool = True,
    splice: tuple[int, int, int] | None = None,
    start: int = 0,
):
    """The one kernel call behind `rope_index`, `plan_splice` and `lm_inputs` (arguments as
    `rope_index`'s, in its order: the callers pass them positionally).

    positions: compute positions and deltas (then the grids are read and checked). splice: the
    image / video / audio embedding rows (each NOT_GIVEN, AS_FOUND or a count to check) to compute
    the splice's rows of columns `start`.. for; None: no splice.
    Returns (pos, deltas, rows, visual_pos_masks, deepstack_rows, (image, video, audio tokens of the
    splice's columns)); what was not asked for is an empty stand-in (None for the visual positions
    and deepstack rows of a family without deepstack).

    Written for a request's fixed cost (`python -m benchmarks positions`, the one-image prompt: about
    20 µs in all): the usual arrays pass their checks in one condition each, and what only some
    requests bring (token types, videos, audio, the Omni thinkers' rules) is read in one helper.
    """
    ids = input_ids
    if type(ids) is not np.ndarray or ids.dtype is not _I64 or ids.ndim != 2 or not ids.flags.c_contiguous:
        ids = _ids(input_ids)
    shape = ids.shape
    nb, length = shape
    types = _NO_TYPES if mm_token_type_ids is None else _types(mm_token_type_ids, shape)
    mask = attention_mask
    if mask is None or not positions:
        mask = _NO_MASK
    elif type(mask) is not np.ndarray or mask.dtype is not _I64 or mask.shape != shape or not mask.flags.c_contiguous:
        mask = _mask(attention_mask, shape)
    pos, deltas, images, extra = _NO_POS, _NO_DELTAS, _EMPTY_GRID, _PLAIN
    if positions:
        rules = cfg.rules
        if image_grid_thw is not None:
            images = grid(image_grid_thw, cfg.spatial_merge_size, "image_grid_thw")
        if (
            video_grid_thw is not None
            or second_per_grid_ts is not None
            or audio_seqlens is not None
            or use_audio_in_video
            or rules.time == TIME_OMNI
        ):
            extra = _extra(cfg, image_grid_thw, video_grid_thw, second_per_grid_ts, audio_seqlens, use_audio_in_video)
        dtype = _F32 if rules.float_positions else _I64
        pos, deltas = np.empty((3, nb, length), dtype), np.empty((nb, 1), dtype)
    videos, times, alen, aiv, text_only = extra
    rows, visual, deep, want = _NO_ROWS, _NO_VISUAL, _NO_DEEP, _NOT_SPLICED
    if splice is not None:
        if not 0 <= start <= length:
            raise ValueError(f"cached must be between 0 and the prompt's {length} columns, got {start}")
        want, width = splice, length - start
        rows = np.empty((nb, width), _I32)
        if cfg.deepstack:  # the visual positions and deepstack rows: only a deepstack family's model reads them
            visual, deep = np.empty((nb, width), _BOOL), np.empty(nb * width, _I32)
    r = K.lm_rows(
        ids, types, mask, images, videos, times, alen, cfg.knobs, aiv, text_only, start, want[0], want[1], want[2],
        pos, deltas, rows, visual, deep,
    )  # fmt: skip
    if r[0]:
        raise ValueError(_message(r[:7], cfg))
    if visual is _NO_VISUAL:
        return pos, deltas, rows, None, None, r[8:]
    return pos, deltas, rows, visual, deep[: r[7]], r[8:]


def run_images(cfg: PromptConfig, ids, images, mask):
    """`run` of a prompt with images only (positions and the splice of the image rows, no deepstack)
    whose ids, mask and grid are already the kernel's C-ordered int64, as the processors return
    them: the same checks and kernel call without the conversions, for `lm_inputs`' common request
    (`python -m benchmarks positions`, the one-image prompt: 2 of its 18 µs). Returns (pos, deltas,
    rows, image tokens), or None when an array needs converting (then `run` it)."""
    if (
        ids.dtype is not _I64
        or ids.ndim != 2
        or not ids.flags.c_contiguous
        or mask.dtype is not _I64
        or mask.shape != ids.shape
        or not mask.flags.c_contiguous
        or images.dtype is not _I64
        or not images.flags.c_contiguous
    ):
        return None
    images = grid(images, cfg.spatial_merge_size, "image_grid_thw")
    nb, length = ids.shape
    dtype = _F32 if cfg.rules.float_positions else _I64
    pos, deltas, rows = np.empty((3, nb, length), dtype), np.empty((nb, 1), dtype), np.empty((nb, length), _I32)
    r = K.lm_rows(
        ids, _NO_TYPES, mask, images, _EMPTY_GRID, _NO_TIMES, _NO_AUDIO, cfg.knobs, 0, 0, 0, AS_FOUND, NOT_GIVEN,
        NOT_GIVEN, pos, deltas, rows, _NO_VISUAL, _NO_DEEP,
    )  # fmt: skip
    if r[0]:
        raise ValueError(_message(r[:7], cfg))
    return pos, deltas, rows, r[8]


_PLAIN = (_EMPTY_GRID, _NO_TIMES, _NO_AUDIO, 0, 0)  # no video, no audio, no Omni rule at play
_NOT_SPLICED = (NOT_GIVEN, NOT_GIVEN, NOT_GIVEN)


def _extra(cfg: PromptConfig, image_grid_thw, video_grid_thw, second_per_grid_ts, audio_seqlens, use_audio_in_video):
    """What only some requests bring, as the kernel takes it: (videos, times, audio lengths, the
    audio-in-video layout or 0, the Omni thinkers' text-only branch)."""
    rules = cfg.rules
    videos = _EMPTY_GRID if video_grid_thw is None else grid(video_grid_thw, cfg.spatial_merge_size, "video_grid_thw")
    times = _times(cfg, second_per_grid_ts, videos.shape[0])
    alen = _NO_AUDIO if audio_seqlens is None else _audio_lengths(cfg, audio_seqlens)
    if use_audio_in_video and rules.audio_in_video == AIV_NONE:
        raise ValueError(f"use_audio_in_video: {cfg.family} has no audio")
    text_only = int(rules.text_fallback and image_grid_thw is None and video_grid_thw is None)
    return videos, times, alen, rules.audio_in_video if use_audio_in_video else 0, text_only


def _ids(input_ids) -> np.ndarray:
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ValueError(f"input_ids must be an integer array [B, L], got {ids.dtype} {ids.shape}")
    return np.ascontiguousarray(ids, np.int64)


def _types(mm_token_type_ids, shape) -> np.ndarray:
    types = np.asarray(mm_token_type_ids)
    if types.shape != shape or types.dtype.kind not in "iu":
        raise ValueError(
            f"mm_token_type_ids must be integers of the shape of input_ids {shape}, got {types.dtype} {types.shape}"
        )
    return np.ascontiguousarray(types, np.int32)


def _mask(attention_mask, shape) -> np.ndarray:
    """A 0 / 1 mask as the kernel takes it: int64, C order (one dtype: one compiled kernel; the
    processors' own dtype, so theirs pass as they are). The kernel checks the values."""
    mask = attention_mask if type(attention_mask) is np.ndarray else np.asarray(attention_mask)
    if mask.shape != shape:
        raise ValueError(f"attention_mask has shape {mask.shape}, input_ids {shape}: they must be equal")
    if mask.dtype.kind not in "biu":
        raise ValueError(f"attention_mask must hold 0 / 1 (integers or bools), got {mask.dtype}")
    return np.ascontiguousarray(mask, np.int64)


def grid(g, merge: int, name: str) -> np.ndarray:
    """A grid argument as int64 [k, 3] (None or no rows: none), checked as plan.as_grid checks
    (a `plan.Grid` already is), ValueError naming the argument."""
    if type(g) is np.ndarray and g.dtype is _I64 and g.flags.c_contiguous:  # the kernel's own layout: checked only
        try:
            checked_grid(g, merge)
            return g
        except ValueError as e:
            if g.ndim == 2 and g.size == 0:
                return _EMPTY_GRID
            raise ValueError(f"{name}: {e}") from None
    if g is None:
        return _EMPTY_GRID
    if isinstance(g, Grid):
        return as_grid(g, merge=merge).array
    if isinstance(g, (list, tuple, np.ndarray)) and len(g) == 0:
        return _EMPTY_GRID
    try:
        arr, _ = checked_grid(g, merge)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return np.ascontiguousarray(arr, np.int64)


def _times(cfg: PromptConfig, second_per_grid_ts, nv: int) -> np.ndarray:
    """float32 [2 + videos]: image_b, video_b, then each video's a. HF's temporal position of frame
    k is f32(f32(k) * a) * b (kernels' _time; images: a = 1), truncated unless the family keeps
    floats."""
    rules = cfg.rules
    omni = rules.time == TIME_OMNI
    b = cfg.position_id_per_seconds if omni else 1.0
    if second_per_grid_ts is None:
        if omni and nv:
            raise ValueError(
                f"{cfg.family}: second_per_grid_ts is required with videos (HF's thinker reads one per video)"
            )
        if not nv and not omni:
            return _NO_TIMES
        # Qwen2.5-VL's default is 1 second per grid: f32(tokens_per_second) * f32(1) = f32(tokens_per_second)
        return np.array([b, b] + [cfg.tokens_per_second if rules.time == TIME_TPS else 1.0] * nv, _F32)
    s = np.asarray(second_per_grid_ts, _F32).reshape(-1)
    if s.shape[0] != nv:
        raise ValueError(f"second_per_grid_ts has {s.shape[0]} entries for {nv} videos (video_grid_thw rows)")
    times = np.empty(2 + nv, _F32)
    times[:2] = b
    if rules.time == TIME_TPS:
        times[2:] = np.float32(cfg.tokens_per_second) * s  # float32, as torch's int * float32 tensor
    else:
        times[2:] = s if omni else 1
    return times


def _audio_lengths(cfg: PromptConfig, audio_seqlens) -> np.ndarray:
    alen = np.ascontiguousarray(audio_tokens(cfg, audio_seqlens), np.int64)
    if (alen < 1).any():
        i = int(np.argmin(alen))
        raise ValueError(
            f"audio {i}: {int(np.asarray(audio_seqlens).reshape(-1)[i])} feature frames give no audio token"
        )
    return alen


def _message(err, cfg: PromptConfig) -> str:
    code, row, kind, index, got, expected, frame = (int(x) for x in err)
    what = f"{_KIND.get(kind, '')} {index}"
    if code == R.E_MORE_RUNS:
        return (
            f"row {row}: {_KIND[kind]} run {index} has no {_GRID_ARG[kind]} entry left "
            f"(more {_KIND[kind]} runs than items)"
        )
    if code == R.E_RUN_LENGTH:
        if kind == 3:
            return f"row {row}: audio {index} has {got} placeholder tokens, its audio_seqlens entry gives {expected}"
        part = f" frame {frame}" if kind == 2 and cfg.rules.split_frames else ""
        return (
            f"row {row}: {what}{part} has a run of {got} placeholder tokens, its grid gives {expected} "
            f"(t * h * w / {cfg.spatial_merge_size}^2{', one frame' if part else ''})"
        )
    if code == R.E_EMPTY_ROW:
        return f"row {row}: no unmasked token (attention_mask is all 0)"
    if code == R.E_AIV_FRAME:
        return f"row {row}: video {index} with use_audio_in_video must follow <vision_start><audio_start> tokens"
    if code == R.E_AIV_TOKEN:
        return (
            f"row {row}: video {index} with its audio: column {got} should be a {_KIND[expected]} token "
            f"(video and audio tokens interleaved as {cfg.family}'s processor lays them out)"
        )
    if code == R.E_AIV_END:
        return f"row {row}: video {index} with its audio must be followed by two text tokens (<audio_end><vision_end>)"
    if code == R.E_COUNT:  # HF's get_placeholder_mask check
        name = _KIND[kind]
        return (
            f"{name} features and {name} tokens do not match: input_ids hold {got} {name} tokens, "
            f"the {name} embeddings have {expected} rows"
        )
    if code == R.E_BAD_TYPE:
        return f"row {row}, column {index}: mm_token_type_ids value {got} (0 text, 1 image, 2 video, 3 audio)"
    if code == R.E_BAD_MASK:
        return f"attention_mask row {row}, column {index}: {got} (only 0 and 1 are accepted)"
    if code == R.E_LEFT_OVER:
        name = _GRID_ARG[kind]
        return f"{name}: {expected} entries, the prompt has {_KIND[kind]} runs for {got} ({name}[{got}:] left over)"
    if code == R.E_PARTIAL_VIDEO:
        return f"video {index}: the prompt has runs for {got} of its {expected} frames"
    return f"rope_index: error {code}"


def decode_positions(deltas, start: int, length: int, attention_mask=None) -> np.ndarray:
    """Positions of the next `length` tokens after `start` tokens (prompt + tokens so far) are cached,
    equal to HF's `compute_3d_position_ids` with a cache of `start` tokens, in the deltas' dtype
    (int64; float32 for Qwen3-Omni, whose deltas HF keeps as floats).

    HF: without a mask, arange(start, start + length) + deltas. With one, HF computes
    cumsum(mask) - 1 (0 where the mask is 0) + deltas over the whole mask it is given, the cached
    columns included, as its generate() keeps it ([B, start + length]); the positions of the new
    tokens are its last `length` columns, which is what this returns. (A mask of the new tokens alone
    would restart HF's count at 0: not accepted.)

    Args:
        deltas: [B, 1] or [B] from `rope_index` (HF's rope_deltas): integers, or floats (taken as
            float32, as HF's). A mask with a batch that is a multiple of B repeats each row's delta
            (HF's repeat_interleave, e.g. beams).
        start: cached tokens (>= 0). length: new tokens (>= 0).
        attention_mask: 0 / 1 [B', start + length], or None.
    Returns:
        [3, B', length] (B' = B without a mask): int64, or float32 for float deltas (HF adds the
        int64 positions to float32 deltas in float32).
    """
    d = np.asarray(deltas)
    if d.ndim == 1:
        d = d[:, None]
    if d.ndim != 2 or d.shape[1] != 1 or d.dtype.kind not in "iuf":
        raise ValueError(f"deltas must be a numeric array [B, 1] (rope_index's), got {d.dtype} {d.shape}")
    start, length = int(start), int(length)
    if start < 0 or length < 0:
        raise ValueError(f"start and length must be >= 0, got {start}, {length}")
    d = d.astype(np.float32 if d.dtype.kind == "f" else np.int64)
    if attention_mask is None:
        p = np.arange(start, start + length, dtype=np.int64)[None, :]  # [1, length]
    else:
        m = np.asarray(attention_mask)
        if m.ndim != 2 or m.shape[1] != start + length:
            raise ValueError(
                f"attention_mask has shape {m.shape}: decode_positions takes the whole mask, [B, start + length] = "
                f"[B, {start + length}]"
            )
        if m.shape[0] % d.shape[0]:
            raise ValueError(f"attention_mask has {m.shape[0]} rows, not a multiple of the {d.shape[0]} deltas")
        if m.dtype != np.bool_:
            if m.dtype.kind not in "iu":
                raise ValueError(f"attention_mask must hold 0 / 1 (integers or bools), got {m.dtype}")
            if m.size and (m.min() < 0 or m.max() > 1):
                b, j = np.argwhere((m != 0) & (m != 1))[0]
                raise ValueError(f"attention_mask row {b}, column {j}: {m[b, j]} (only 0 and 1 are accepted)")
        new = m[:, start:].astype(np.int64)  # [B', length]
        # HF: cumsum over the whole mask - 1, 0 where masked, + delta; only the last `length` columns kept
        p = np.cumsum(new, axis=1) + np.count_nonzero(m[:, :start], axis=1)[:, None] - 1
        p[new == 0] = 0
        if m.shape[0] != d.shape[0]:
            d = np.repeat(d, m.shape[0] // d.shape[0], axis=0)
    p = p.astype(d.dtype) + d  # float deltas: HF's int64 + float32 is a float32 sum
    return np.broadcast_to(p, (3, *p.shape)).copy()
