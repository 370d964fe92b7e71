"""`rope_index`: a prompt's 3-D M-RoPE positions and rope deltas, equal to HF's
`model.model.get_rope_index` of the checkpoint's family; `decode_positions`: the positions of the
next tokens while decoding, equal to HF's `compute_3d_position_ids` with a cache.

The per-token work is one numba pass (kernels.rope_rows); this module checks the inputs' shapes and
turns the kernel's error record into a ValueError naming the row and the item.
"""

from __future__ import annotations

import numpy as np

from qwen_vit_jax.prompt import kernels as K
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
# Stand-ins for what was not given (the kernel tells them by their shape).
_EMPTY_GRID = np.zeros((0, 3), np.int64)
_NO_TYPES = np.zeros((0, 0), np.int32)
_NO_MASK = np.zeros((0, 0), np.uint8)
_NO_AUDIO = np.zeros(0, np.int64)
_NO_TIMES = np.zeros(0, np.float32)
_ONE = np.float32(1.0)
_KNOBS: dict[tuple[int, bool], tuple[PromptConfig, np.ndarray]] = {}


def _knobs(cfg: PromptConfig, audio_in_video: bool) -> np.ndarray:
    """The kernel's int64 row of a PromptConfig (built once per config object)."""
    hit = _KNOBS.get((id(cfg), audio_in_video))
    if hit is not None and hit[0] is cfg:
        return hit[1]
    r = cfg.rules

    def tid(v):
        return K.NO_ID if v is None else v

    k = np.zeros(K.N_KNOBS, np.int64)
    k[K.K_MERGE] = cfg.spatial_merge_size
    k[K.K_SPLIT] = r.split_frames
    k[K.K_ADVANCE] = r.advance
    k[K.K_AIV] = r.audio_in_video if audio_in_video else 0
    k[K.K_PAD] = r.pad_position
    k[K.K_INTEGRAL] = r.integral_time
    k[K.K_IMAGE] = cfg.image_token_id
    k[K.K_VIDEO] = tid(cfg.video_token_id)
    k[K.K_AUDIO] = tid(cfg.audio_token_id)
    k[K.K_GLM] = r.glm_types
    k[K.K_VSTART_GLM] = tid(cfg.video_start_token_id)
    k[K.K_VEND_GLM] = tid(cfg.video_end_token_id)
    k[K.K_VSTART] = tid(cfg.vision_start_token_id)
    k[K.K_ASTART] = tid(cfg.audio_start_token_id)
    k[K.K_TPC] = int(cfg.position_id_per_seconds * cfg.seconds_per_chunk)  # HF: int(pps * seconds_per_chunk)
    if len(_KNOBS) > 256:  # hand-made configs: keep the table small
        _KNOBS.clear()
    _KNOBS[(id(cfg), audio_in_video)] = (cfg, k)
    return k


def _grid(g, name: str) -> np.ndarray:
    if g is None:
        return _EMPTY_GRID
    if type(g) is np.ndarray and g.dtype == np.int64 and g.ndim == 2 and g.shape[1] == 3 and g.flags.c_contiguous:
        return g  # already what the kernel takes: no conversion calls
    a = np.asarray(g)
    if a.ndim != 2 or a.shape[1] != 3 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be an integer array [k, 3] of (t, h, w), got {a.dtype} {a.shape}")
    return np.ascontiguousarray(a, np.int64)


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
    `model.model.get_rope_index` (the Omni thinkers': `thinker.get_rope_index`) of the checkpoint.

    Args:
        source: a PromptConfig or what `prompt_config` takes (a checkpoint directory, converted or HF,
            its config.json, a hub id in the local cache); read once.
        input_ids: int [B, L], placeholders already expanded (one token per merged patch).
        mm_token_type_ids: int [B, L] (0 text, 1 image, 2 video, 3 audio); default: what the family's
            HF processor writes for input_ids (`token_types`).
        image_grid_thw, video_grid_thw: int [k, 3] (t, h, w) in patches, in prompt order over the whole
            batch (row 0's items first).
        second_per_grid_ts: float [videos], seconds per temporal patch (read as float32, as HF's
            processor returns it). Qwen2.5-VL: default 1. The Omni thinkers: required with videos.
        attention_mask: 0 / 1 [B, L]; masked tokens are dropped before grouping, as HF does, and get
            HF's padding value (0; 1 for Qwen2.5-Omni, and for the Omni thinkers' text-only branch).
        audio_seqlens: int [audios], each audio's feature frames (HF: audio_feature_lengths), Omni only.
        use_audio_in_video: every video carries its audio track, laid out as the Omni processors do.
    Returns:
        (position_ids int64 [3, B, L], deltas int64 [B, 1]): deltas = largest position + 1 - the row's
        unmasked length, what `decode_positions` continues from.
    Raises:
        ValueError naming the row and the item: a placeholder run whose length is not its grid's (or
        audio's) token count, more runs than grids or grids left over, a second_per_grid_ts of the
        wrong length, a mask or type array of the wrong shape or values, a row with no unmasked
        token. Qwen3-Omni: a video whose HF temporal positions are fractional (HF keeps them as
        floats; they cannot be int64).
    """
    cfg = prompt_config(source)
    rules = cfg.rules
    ids = input_ids if type(input_ids) is np.ndarray else np.asarray(input_ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ValueError(f"input_ids must be an integer array [B, L], got {ids.dtype} {ids.shape}")
    if ids.dtype != np.int64 or not ids.flags.c_contiguous:
        ids = np.ascontiguousarray(ids, np.int64)
    nb, length = ids.shape
    if attention_mask is None:
        mask = _NO_MASK
    else:
        mask = attention_mask if type(attention_mask) is np.ndarray else np.asarray(attention_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {mask.shape}, input_ids {ids.shape}: they must be equal")
        # one dtype for the kernel (one compiled specialization); values other than 0 / 1 are refused
        mask = _mask_u8(mask)
    if mm_token_type_ids is None:
        types = _NO_TYPES
    else:
        types = np.asarray(mm_token_type_ids)
        if types.shape != ids.shape or types.dtype.kind not in "iu":
            raise ValueError(
                f"mm_token_type_ids must be integers of the shape of input_ids {ids.shape}, "
                f"got {types.dtype} {types.shape}"
            )
        types = np.ascontiguousarray(types, np.int32)
    if rules.text_fallback and image_grid_thw is None and video_grid_thw is None:
        return _text_only(np.ones((nb, length), np.uint8) if mask is _NO_MASK else mask)
    images = _grid(image_grid_thw, "image_grid_thw")
    videos = _grid(video_grid_thw, "video_grid_thw")
    nv = videos.shape[0]
    video_a, image_b, video_b = _time_scales(cfg, second_per_grid_ts, nv)
    alen = _NO_AUDIO if audio_seqlens is None else _audio_lengths(cfg, audio_seqlens)
    if use_audio_in_video and rules.audio_in_video == AIV_NONE:
        raise ValueError(f"use_audio_in_video: {cfg.family} has no audio")

    pos = np.empty((3, nb, length), np.int64)
    deltas = np.empty((nb, 1), np.int64)
    status = np.zeros(11, np.int64)
    knobs = _knobs(cfg, bool(use_audio_in_video))
    K.rope_rows(ids, types, mask, images, videos, video_a, image_b, video_b, alen, knobs, pos, deltas, status)
    if status[0]:
        raise ValueError(_message(status[:7], cfg))
    return pos, deltas


def _time_scales(cfg: PromptConfig, second_per_grid_ts, nv: int):
    """(video_a float32 [videos], image_b, video_b): HF's temporal positions are
    trunc(f32(f32(k) * a) * b) (kernels._time)."""
    rules = cfg.rules
    if second_per_grid_ts is not None:
        s = np.asarray(second_per_grid_ts, np.float32).reshape(-1)
        if s.shape[0] != nv:
            raise ValueError(f"second_per_grid_ts has {s.shape[0]} entries for {nv} videos (video_grid_thw rows)")
    elif rules.time == TIME_OMNI and nv:
        raise ValueError(f"{cfg.family}: second_per_grid_ts is required with videos (HF's thinker reads one per video)")
    elif not nv:
        return _NO_TIMES, _ONE, _ONE
    elif rules.time == TIME_TPS:  # Qwen2.5-VL's default, 1 second per grid: f32(tps) * f32(1) = f32(tps)
        return np.full(nv, np.float32(cfg.tokens_per_second), np.float32), _ONE, _ONE
    else:
        s = np.ones(nv, np.float32)
    if rules.time == TIME_TPS:
        return np.float32(cfg.tokens_per_second) * s, _ONE, _ONE  # float32, as torch's int * float32 tensor
    if rules.time == TIME_OMNI:
        pps = np.float32(cfg.position_id_per_seconds)
        return s, pps, pps
    return np.ones(nv, np.float32), _ONE, _ONE


def _audio_lengths(cfg: PromptConfig, audio_seqlens) -> np.ndarray:
    alen = np.ascontiguousarray(audio_tokens(cfg, audio_seqlens), np.int64)
    if (alen < 1).any():
        i = int(np.argmin(alen))
        raise ValueError(
            f"audio {i}: {int(np.asarray(audio_seqlens).reshape(-1)[i])} feature frames give no audio token"
        )
    return alen


def _mask_u8(mask: np.ndarray) -> np.ndarray:
    """A bool or integer 0 / 1 mask as contiguous uint8 for the kernel; ValueError naming the first
    other value (a uint8 one is left to the kernel's own check)."""
    if mask.dtype == np.bool_:
        return np.ascontiguousarray(mask.view(np.uint8))
    if mask.dtype.kind not in "iu":
        raise ValueError(f"attention_mask must hold 0 / 1 (integers or bools), got {mask.dtype}")
    if mask.dtype == np.uint8:
        return np.ascontiguousarray(mask)
    out = np.empty(mask.shape, np.uint8)
    bad = K.mask_u8(mask, out)  # one pass, no temporaries
    if bad >= 0:
        b, j = divmod(bad, mask.shape[1])
        raise ValueError(f"attention_mask row {b}, column {j}: {mask[b, j]} (only 0 and 1 are accepted)")
    return out


def _mask01(mask: np.ndarray) -> np.ndarray:
    """An integer 0 / 1 mask as uint8; ValueError naming the first other value."""
    if mask.dtype.kind not in "iu":
        raise ValueError(f"attention_mask must hold 0 / 1 (integers or bools), got {mask.dtype}")
    bad = mask & ~np.array(1, mask.dtype)  # nonzero where a value is neither 0 nor 1 (negatives included)
    if bad.any():
        b, j = np.argwhere(bad != 0)[0]
        raise ValueError(f"attention_mask row {b}, column {j}: {mask[b, j]} (only 0 and 1 are accepted)")
    return mask.astype(np.uint8)


def _text_only(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Omni thinkers' branch without image or video grids: positions cumsum(mask) - 1, padding 1."""
    if mask.size and mask.max() > 1:
        _mask01(mask)  # names the first value other than 0 / 1
    m = mask.astype(np.int64)
    p = np.cumsum(m, axis=1) - 1
    p[m == 0] = 1
    deltas = p.max(axis=1, keepdims=True) + 1 - m.sum(axis=1, keepdims=True)
    return np.broadcast_to(p, (3, *p.shape)).copy(), deltas


def _message(err: np.ndarray, cfg: PromptConfig) -> str:
    code, row, kind, index, got, expected, frame = (int(x) for x in err)
    what = f"{_KIND.get(kind, '')} {index}"
    if code == K.E_MORE_RUNS:
        return (
            f"row {row}: {_KIND[kind]} run {index} has no {_GRID_ARG[kind]} entry left "
            f"(more {_KIND[kind]} runs than items)"
        )
    if code == K.E_RUN_LENGTH:
        if kind == 3:
            return f"row {row}: audio {index} has {got} placeholder tokens, its audio_seqlens entry gives {expected}"
        part = f" frame {frame}" if kind == 2 and cfg.rules.split_frames else ""
        return (
            f"row {row}: {what}{part} has a run of {got} placeholder tokens, its grid gives {expected} "
            f"(t * h * w / {cfg.spatial_merge_size}^2{', one frame' if part else ''})"
        )
    if code == K.E_EMPTY_ROW:
        return f"row {row}: no unmasked token (attention_mask is all 0)"
    if code == K.E_AIV_FRAME:
        return f"row {row}: video {index} with use_audio_in_video must follow <vision_start><audio_start> tokens"
    if code == K.E_AIV_TOKEN:
        return (
            f"row {row}: video {index} with its audio: column {got} should be a {_KIND[expected]} token "
            f"(video and audio tokens interleaved as {cfg.family}'s processor lays them out)"
        )
    if code == K.E_AIV_END:
        return f"row {row}: video {index} with its audio must be followed by two text tokens (<audio_end><vision_end>)"
    if code == K.E_FRACTIONAL:
        return (
            f"row {row}: video {index} frame {got}: HF's {cfg.family} places it at a fractional temporal position "
            "(frame * second_per_grid_ts * position_id_per_seconds); int64 positions cannot hold it"
        )
    if code == K.E_BAD_TYPE:
        return f"row {row}, column {index}: mm_token_type_ids value {got} (0 text, 1 image, 2 video, 3 audio)"
    if code == K.E_BAD_MASK:
        return f"attention_mask row {row}, column {index}: {got} (only 0 and 1 are accepted)"
    if code == K.E_LEFT_OVER:
        name = _GRID_ARG[kind]
        return f"{name}: {expected} entries, the prompt has {_KIND[kind]} runs for {got} ({name}[{got}:] left over)"
    if code == K.E_PARTIAL_VIDEO:
        return f"video {index}: the prompt has runs for {got} of its {expected} frames"
    if code == K.E_BAD_GRID:
        return (
            f"{_GRID_ARG[kind]} row {index}: every entry must be >= 1 and h, w multiples of the merge size "
            f"{cfg.spatial_merge_size}"
        )
    return f"rope_index: error {code}"


def decode_positions(deltas, start: int, length: int, attention_mask=None) -> np.ndarray:
    """Positions of the next `length` tokens after `start` tokens (prompt + tokens so far) are cached,
    equal to HF's `compute_3d_position_ids` with a cache of `start` tokens.

    HF: without a mask, arange(start, start + length) + deltas. With one, HF computes
    cumsum(mask) - 1 (0 where the mask is 0) + deltas over the whole mask it is given, the cached
    columns included, as its generate() keeps it ([B, start + length]); the positions of the new
    tokens are its last `length` columns, which is what this returns. (A mask of the new tokens alone
    would restart HF's count at 0: not accepted.)

    Args:
        deltas: int [B, 1] or [B] from `rope_index` (HF's rope_deltas). A mask with a batch that is a
            multiple of B repeats each row's delta (HF's repeat_interleave, e.g. beams).
        start: cached tokens (>= 0). length: new tokens (>= 0).
        attention_mask: 0 / 1 [B', start + length], or None.
    Returns:
        int64 [3, B', length] (B' = B without a mask).
    """
    d = np.asarray(deltas)
    if d.ndim == 1:
        d = d[:, None]
    if d.ndim != 2 or d.shape[1] != 1 or d.dtype.kind not in "iu":
        raise ValueError(f"deltas must be an integer array [B, 1] (rope_index's), got {d.dtype} {d.shape}")
    start, length = int(start), int(length)
    if start < 0 or length < 0:
        raise ValueError(f"start and length must be >= 0, got {start}, {length}")
    d = d.astype(np.int64)
    if attention_mask is None:
        p = np.arange(start, start + length, dtype=np.int64)[None, :] + d  # [B, length]
        return np.broadcast_to(p, (3, *p.shape)).copy()
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
            _mask01(m)  # names the first bad value
    new = m[:, start:].astype(np.int64)  # [B', length]
    # HF: cumsum over the whole mask - 1, 0 where masked, + delta; only the last `length` columns kept
    p = np.cumsum(new, axis=1) + np.count_nonzero(m[:, :start], axis=1)[:, None] - 1
    p[new == 0] = 0
    p += d if m.shape[0] == d.shape[0] else np.repeat(d, m.shape[0] // d.shape[0], axis=0)
    return np.broadcast_to(p, (3, *p.shape)).copy()
