"""`lm_inputs`: everything the host computes for one request of the language model, from one numba
dispatch: the prompt's positions and rope deltas (`rope_index`'s) and the splice's indices
(`plan_splice`'s), for the whole prompt or for the tokens after a cached prefix.

    inp = qvj.lm_inputs(ckpt, input_ids, image_grid_thw=thw, attention_mask=mask)
    emb = apply_splice(inp.splice, text_embeds, image_embeds)     # one gather, in your jit
    cos, sin = qvj.mrope_tables(ckpt, inp.position_ids)           # the rotary of those positions
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .config import TIME_OMNI, PromptConfig, prompt_config
from .positions import AS_FOUND, NOT_GIVEN, run, run_images
from .splice import SplicePlan


class LMInputs(NamedTuple):
    """The host half of a language model's inputs for one request.

    position_ids: [3, B, L - cached] (int64; float32 for Qwen3-Omni), the positions of the new
        tokens (`rope_index`'s, its last L - cached columns).
    rope_deltas: [B, 1], same dtype: what `decode_positions` continues from.
    splice: the SplicePlan of the new tokens (`plan_splice`'s over input_ids[:, cached:]), its row
        counts the image / video / audio tokens there (None for a kind not given).
    """

    position_ids: np.ndarray
    rope_deltas: np.ndarray
    splice: SplicePlan


def lm_inputs(
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
    cached: int = 0,
) -> LMInputs:
    """`rope_index` and `plan_splice` of one prompt in one kernel call (the same results as the two
    calls, which stay as views of it).

    Args:
        source, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
            attention_mask, audio_seqlens, use_audio_in_video: as `rope_index`.
        cached: tokens already in the KV cache (a prefix cache): the positions depend on the whole
            prompt and are computed for it, but only those of input_ids[:, cached:] are returned, and
            the splice covers those columns (the embeddings of the items in them, in order).
    Returns:
        LMInputs(position_ids, rope_deltas, splice). The splice takes the image rows when
        image_grid_thw is given (their count is the image tokens of the new columns), likewise video
        (video_grid_thw) and audio (audio_seqlens); a kind not given keeps its tokens' text
        embeddings, as in HF.
    Raises:
        ValueError as `rope_index`, and for `cached` outside 0..L.
    """
    cfg = source if type(source) is PromptConfig else prompt_config(source)
    if (
        type(image_grid_thw) is np.ndarray  # the common request, its arrays already the kernel's: the short
        and mm_token_type_ids is None  # way in (the positions suite, the one-image prompt: 2 of 18 µs)
        and video_grid_thw is None
        and second_per_grid_ts is None
        and audio_seqlens is None
        and not use_audio_in_video
        and not cached
        and not cfg.deepstack
        and cfg.rules.time != TIME_OMNI
        and type(input_ids) is np.ndarray
        and type(attention_mask) is np.ndarray
    ):
        out = run_images(cfg, input_ids, image_grid_thw, attention_mask)
        if out is not None:
            return LMInputs(out[0], out[1], SplicePlan(out[2], None, None, out[3], None, None))
    want = (
        NOT_GIVEN if image_grid_thw is None else AS_FOUND,
        NOT_GIVEN if video_grid_thw is None else AS_FOUND,
        NOT_GIVEN if audio_seqlens is None else AS_FOUND,
    )
    pos, deltas, rows, visual, deep, counts = run(
        cfg,
        input_ids,
        mm_token_type_ids,
        image_grid_thw,
        video_grid_thw,
        second_per_grid_ts,
        attention_mask,
        audio_seqlens,
        use_audio_in_video,
        True,
        want,
        cached,
    )
    plan = SplicePlan(
        rows,
        visual,
        deep,
        None if image_grid_thw is None else counts[0],
        None if video_grid_thw is None else counts[1],
        None if audio_seqlens is None else counts[2],
    )
    return LMInputs(pos[:, :, cached:] if cached else pos, deltas, plan)
