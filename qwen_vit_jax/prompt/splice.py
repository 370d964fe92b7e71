"""The tower's embeddings into the text embeddings at the placeholder tokens: HF's
`get_placeholder_mask` + `masked_scatter` (and, for the deepstack towers, the `visual_pos_masks` and
`deepstack_visual_embeds` of Qwen3-VL's forward), as a host plan and one device gather.

    emb = qvj.splice(ckpt, input_ids, text_embeds, image_embeds, video_embeds)        # [B, L, D]
    emb, visual_pos_masks, deepstack = qvj.splice(ckpt, ids, text, img, vid, image_deepstack=ds_img,
                                                  video_deepstack=ds_vid)            # deepstack towers

Split for a user's own `jax.jit`: the host part (`plan_splice`, numpy + numba, no device work) returns a
`SplicePlan` (a pytree: its index arrays are leaves, the row counts static), and `apply_splice` /
`apply_deepstack` are pure jnp functions of it:

    plan = plan_splice(ckpt, input_ids, image_rows=len(img), video_rows=len(vid))
    emb = jax.jit(apply_splice)(plan, text, img, vid)

How: the rows [text (B * L); image; video; audio] are one table; position p of the flattened prompt
takes row `plan.rows[p]` (its own text row, or the next image / video / audio row in prompt order).
masked_scatter fills the masked positions in row-major order with the feature rows in order: the
same rows, so the result is equal bit for bit (features are cast to the text dtype first, as HF
does). Which tokens are image / video / audio is `token_types` (HF's processor's
`mm_token_type_ids`); for every family but GLM-4V that is `input_ids == <the placeholder id>`, HF's
mask. GLM-4V's forward masks videos with its image id too (one placeholder id for both), so a prompt
with images and a video fails there; we splice by the processor's types (image tokens between
<|begin_of_video|> and <|end_of_video|> are video), which is what that prompt means.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .config import prompt_config
from .positions import NOT_GIVEN, run


@dataclasses.dataclass(slots=True, eq=False)  # not frozen: its __init__ would cost lm_inputs 1.5 µs of ~20
class SplicePlan:
    """Where every prompt position takes its embedding from (built on the host by `plan_splice`).

    rows: int32 [B, L]: the row of the table [text (B * L); image; video; audio] position (b, l) takes.
    visual_pos_masks: bool [B, L]: the image and video positions whose embeddings were given (HF's
        Qwen3-VL `visual_pos_masks`; what the deepstack features are added at). None for a family
        without deepstack (its language model takes none), as is deepstack_rows.
    deepstack_rows: int32 [V], V = visual_pos_masks.sum(): the row of [image deepstack; video
        deepstack] each visual position takes, in row-major order (HF's joint deepstack tensor).
    image_rows, video_rows, audio_rows: the feature rows the plan expects (None: none given, the
        placeholder tokens keep their text embeddings, as in HF). Static: part of the tree's structure.
    A value: build a new plan rather than change one.
    """

    rows: np.ndarray
    visual_pos_masks: np.ndarray | None
    deepstack_rows: np.ndarray | None
    image_rows: int | None = None
    video_rows: int | None = None
    audio_rows: int | None = None


jax.tree_util.register_dataclass(
    SplicePlan,
    data_fields=["rows", "visual_pos_masks", "deepstack_rows"],
    meta_fields=["image_rows", "video_rows", "audio_rows"],
)


def plan_splice(
    source, input_ids, image_rows=None, video_rows=None, audio_rows=None, *, mm_token_type_ids=None
) -> SplicePlan:
    """The host half of `splice`: one numba pass over the ids, nothing on the device (the kernel
    `rope_index` and `lm_inputs` share).

    Args:
        source: what `prompt_config` takes (a checkpoint directory, its config.json, a hub id in the
            local cache, a PromptConfig).
        input_ids: int [B, L], placeholders expanded (one token per embedding row).
        image_rows, video_rows, audio_rows: the number of image / video / audio embedding rows that
            will be spliced in, or None when that modality's embeddings are not given (its tokens
            keep their text embeddings, as in HF's forward).
        mm_token_type_ids: int [B, L], the processor's types; default: `token_types(source, input_ids)`
            (computed in the same pass).
    Returns:
        SplicePlan.
    Raises:
        ValueError when a given count differs from the number of that modality's tokens (HF's
        get_placeholder_mask check), naming both.
    """
    want = []
    want_rows = (image_rows, video_rows, audio_rows)
    for name, n in zip(("image_rows", "video_rows", "audio_rows"), want_rows):
        if n is not None and (not isinstance(n, (int, np.integer)) or n < 0):
            raise ValueError(f"{name} must be an int >= 0 or None, got {n!r}")
        want.append(NOT_GIVEN if n is None else int(n))
    _, _, rows, visual, deepstack_rows, _ = run(
        prompt_config(source), input_ids, mm_token_type_ids=mm_token_type_ids, positions=False, splice=tuple(want)
    )
    return SplicePlan(rows, visual, deepstack_rows, *(None if n is None else int(n) for n in want_rows))


def _check_features(plan: SplicePlan, name: str, x, width: int):
    """x's static shape against the plan's count (a check of shapes only: fine under jit)."""
    expected = getattr(plan, f"{name}_rows")
    if x is None:
        if expected:
            raise ValueError(f"the plan splices {expected} {name} rows, but no {name} embeddings were given")
        return
    if expected is None:
        raise ValueError(f"{name} embeddings were given, but the plan was made without {name} rows")
    if x.ndim != 2 or x.shape[0] != expected or x.shape[1] != width:
        raise ValueError(
            f"{name} features and {name} tokens do not match: the plan has {expected} {name} tokens of "
            f"width {width}, the {name} embeddings have shape {tuple(x.shape)}"
        )


def apply_splice(plan: SplicePlan, text_embeds, image_embeds=None, video_embeds=None, audio_embeds=None):
    """The device half of `splice`: one gather, pure jnp (jit it, or call it inside your own jit).

    Args:
        plan: from `plan_splice` (its counts must match the embeddings given).
        text_embeds: [B, L, D] the token embeddings of input_ids.
        image_embeds, video_embeds, audio_embeds: [n, D] rows in prompt order (the tower's output,
            all items concatenated), cast to text_embeds' dtype.
    Returns:
        inputs_embeds [B, L, D], text_embeds' dtype.
    """
    text_embeds = jnp.asarray(text_embeds)
    if text_embeds.ndim != 3 or text_embeds.shape[:2] != plan.rows.shape:
        raise ValueError(
            f"text_embeds has shape {tuple(text_embeds.shape)}, input_ids {plan.rows.shape}: want [B, L, D]"
        )
    b, l, d = text_embeds.shape
    parts = [text_embeds.reshape(b * l, d)]  # [B, L, D] -> [B * L, D]
    for name, x in (("image", image_embeds), ("video", video_embeds), ("audio", audio_embeds)):
        x = None if x is None else jnp.asarray(x)
        _check_features(plan, name, x, d)
        if x is not None:
            parts.append(x.astype(text_embeds.dtype))
    table = jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]  # [B * L + n, D]
    out = jnp.take(table, jnp.asarray(plan.rows).reshape(-1), axis=0, mode="clip")  # [B * L, D]
    return out.reshape(b, l, d)


def _layers(name: str, feats, rows: int | None, width_of) -> list | None:
    if feats is None:
        return None
    if rows is None:
        raise ValueError(f"{name}_deepstack was given without {name} embeddings")
    feats = [jnp.asarray(f) for f in feats]
    for k, f in enumerate(feats):
        if f.ndim != 2 or f.shape[0] != rows:
            raise ValueError(
                f"{name}_deepstack[{k}] has shape {tuple(f.shape)}: want [{rows}, D] ({rows} {name} tokens)"
            )
    width_of.update(f.shape[1] for f in feats)
    return feats


def apply_deepstack(plan: SplicePlan, image_deepstack=None, video_deepstack=None, dtype=None) -> list:
    """The deepstack features at the visual positions, one [V, D] array per deepstack layer (HF's
    Qwen3-VL `deepstack_visual_embeds`): one gather over all layers, pure jnp.

    Args:
        plan: from `plan_splice`.
        image_deepstack, video_deepstack: one [n, D] array per deepstack layer (the tower's
            `return_deepstack=True` output), given for every modality whose embeddings the plan
            splices.
        dtype: the output dtype (default: the features', as HF keeps them).
    Returns:
        list of [V, D] arrays, V = plan.visual_pos_masks.sum().
    """
    if plan.deepstack_rows is None:
        raise ValueError("apply_deepstack: the plan has no deepstack rows (its family's language model takes none)")
    widths: set[int] = set()
    img = _layers("image", image_deepstack, plan.image_rows, widths)
    vid = _layers("video", video_deepstack, plan.video_rows, widths)
    for name, feats, rows in (("image", img, plan.image_rows), ("video", vid, plan.video_rows)):
        if feats is None and rows is not None:
            raise ValueError(f"deepstack features were given, but none for the {rows} {name} tokens")
    given = [f for f in (img, vid) if f is not None]
    if not given:
        raise ValueError("apply_deepstack: no deepstack features given")
    if len({len(f) for f in given}) != 1 or len(widths) != 1:
        raise ValueError(
            f"image and video deepstack features differ: {[len(f) for f in given]} layers, widths {sorted(widths)}"
        )
    stacks = [jnp.stack(f) for f in given]  # each [K, n, D]
    dtype = dtype or jnp.result_type(*stacks)
    table = jnp.concatenate([s.astype(dtype) for s in stacks], axis=1)  # [K, n_image + n_video, D]
    out = jnp.take(table, jnp.asarray(plan.deepstack_rows), axis=1, mode="clip")  # [K, V, D]
    return list(out)


def splice(
    source,
    input_ids,
    text_embeds,
    image_embeds=None,
    video_embeds=None,
    *,
    image_deepstack=None,
    video_deepstack=None,
    audio_embeds=None,
    mm_token_type_ids=None,
):
    """The language model's input embeddings: HF's `get_placeholder_mask` + `masked_scatter`.

    Args:
        source: what `prompt_config` takes (a checkpoint directory, its config.json, a hub id in the
            local cache, a PromptConfig).
        input_ids: int [B, L], placeholders expanded (`expand_placeholders`).
        text_embeds: [B, L, D] the language model's token embeddings of input_ids.
        image_embeds, video_embeds: [n, D] the tower's output for the prompt's images / videos, all
            items concatenated in prompt order (`VisionEncoder.encode`). None: not spliced (those
            tokens keep their text embeddings, as in HF).
        image_deepstack, video_deepstack: the deepstack towers' (Qwen3-VL) one [n, D] array per
            deepstack layer; give them for every modality whose embeddings are given.
        audio_embeds: [n, D] the Omni thinkers' audio encoder output (audio tokens).
        mm_token_type_ids: int [B, L], the processor's types (default: `token_types`).
    Returns:
        inputs_embeds: jax array [B, L, D] in text_embeds' dtype; with deepstack features given, the
        tuple (inputs_embeds, visual_pos_masks numpy bool [B, L], deepstack_embeds: one [V, D] jax
        array per deepstack layer, V = visual_pos_masks.sum()), as HF's Qwen3-VL forward builds them.
    Raises:
        ValueError naming both counts when a modality's token count differs from its rows (HF's
        check), and for arrays of the wrong shape.
    """
    counts = [None if x is None else int(np.shape(x)[0]) for x in (image_embeds, video_embeds, audio_embeds)]
    plan = plan_splice(source, input_ids, *counts, mm_token_type_ids=mm_token_type_ids)
    emb = apply_splice(plan, text_embeds, image_embeds, video_embeds, audio_embeds)
    if image_deepstack is None and video_deepstack is None:
        return emb
    deepstack = apply_deepstack(plan, image_deepstack, video_deepstack)
    return emb, plan.visual_pos_masks, deepstack
