"""From the tower to the language model, against HF's whole model: tiny *ForConditionalGeneration
models (random weights, float32) of Qwen2.5-VL, Qwen3-VL (deepstack), GLM-4.1V and the Qwen2.5-Omni
thinker, a batch of two left-padded prompts with two images and a video.

Reference: HF's logits of the whole model (its tower, its positions, its splice). Ours: the
checkpoint save_pretrained wrote, converted, encoded by qvj.VisionEncoder; our `splice` of those
embeddings into HF's token embeddings, our `rope_index` positions; then HF's language model and
lm_head on them. The docs/numerics.md float32 bar (hf_reference.FLOAT32) on the logits.

GLM-4V's forward masks videos with its image id, so a prompt with images and a video fails there
(tests/test_splice.py shows ours splices it); its reference is run on an image batch and a video
batch separately."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qwen_vit_jax as qvj
from qwen_vit_jax.prompt.positions import token_types
from qwen_vit_jax.tools.hf_reference import FLOAT32, compare
from tests.hf_utils import random_pixels
from tests.test_splice import FAMILIES, TOWERS, inner, prompt_config_of, random_batch, tiny_hf

SECONDS_PER_GRID = 1.0  # the Omni thinker reads one per video: 2 frames per patch at 2 fps


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    """(family, HF whole model, converted checkpoint dir, our encoder)."""
    family = request.param
    model = tiny_hf(family, seed=17)
    root = tmp_path_factory.mktemp(family)
    model.save_pretrained(root / "hf")
    qvj.convert_checkpoint(root / "hf", root / "ours")
    enc = qvj.VisionEncoder.from_pretrained(root / "ours", dtype="float32")
    return family, model, root / "ours", enc


def _pixels(family, grids, seed):
    if not len(grids):
        return None
    return random_pixels(TOWERS[family], grids, seed=seed)


def hf_logits(family, model, ids, mask, img_thw, img_px, vid_thw, vid_px) -> np.ndarray:
    """HF's whole model, as a user calls it with the processor's outputs."""
    kw = dict(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    if img_px is not None:
        kw.update(pixel_values=torch.from_numpy(img_px), image_grid_thw=torch.from_numpy(img_thw))
    if vid_px is not None:
        kw.update(pixel_values_videos=torch.from_numpy(vid_px), video_grid_thw=torch.from_numpy(vid_thw))
    if family == "qwen2_5_omni":
        owner = model.thinker
        if vid_px is not None:
            kw["video_second_per_grid"] = torch.full((len(vid_thw),), SECONDS_PER_GRID)
    else:
        owner = model
        kw["mm_token_type_ids"] = torch.from_numpy(token_types(prompt_config_of(family), ids))
    with torch.no_grad():
        return owner(**kw).logits.numpy()


def our_logits(family, model, ckpt, enc, ids, mask, img_thw, img_px, vid_thw, vid_px, spoil=None) -> np.ndarray:
    """Our tower, splice and positions; HF's language model and lm_head. `spoil`: "positions" (plain
    text positions instead of M-RoPE) or "order" (the image rows reversed): the bar must then fail."""
    deep = family == "qwen3_vl"
    feats, deepstack = {}, {}
    for name, px, thw in (("image", img_px, img_thw), ("video", vid_px, vid_thw)):
        if px is None:
            feats[name] = deepstack[name] = None
        elif deep:
            feats[name], deepstack[name] = enc.encode(px, thw, return_deepstack=True)
        else:
            feats[name] = enc.encode(px, thw)
    owner = model.thinker if family == "qwen2_5_omni" else model
    lm = inner(model).language_model
    with torch.no_grad():
        text = lm.get_input_embeddings()(torch.from_numpy(ids)).numpy()
    extra = {}
    if deep:
        emb, visual, ds = qvj.splice(
            ckpt,
            ids,
            text,
            feats["image"],
            feats["video"],
            image_deepstack=deepstack["image"],
            video_deepstack=deepstack["video"],
        )
        extra = dict(
            visual_pos_masks=torch.from_numpy(visual),
            deepstack_visual_embeds=[torch.from_numpy(np.array(d)) for d in ds],
        )
    else:
        emb = qvj.splice(ckpt, ids, text, feats["image"], feats["video"])
    seconds = None if family != "qwen2_5_omni" or vid_px is None else [SECONDS_PER_GRID] * len(vid_thw)
    pos, _ = qvj.rope_index(
        ckpt,
        ids,
        image_grid_thw=img_thw if img_px is not None else None,
        video_grid_thw=vid_thw if vid_px is not None else None,
        second_per_grid_ts=seconds,
        attention_mask=mask,
    )
    if spoil == "positions":
        pos = np.broadcast_to(np.cumsum(mask, -1) - 1, pos.shape).copy()
    elif spoil == "order":
        emb = qvj.splice(ckpt, ids, text, feats["image"][::-1], feats["video"])
    with torch.no_grad():
        hidden = lm(
            inputs_embeds=torch.from_numpy(np.array(emb)),
            attention_mask=torch.from_numpy(mask),
            position_ids=torch.from_numpy(pos),
            **extra,
        ).last_hidden_state
        return owner.lm_head(hidden).numpy()


def test_logits_equal_hf_whole_model(case):
    family, model, ckpt, enc = case
    batches = [["image", "video", "image"]]
    if family == "glm4v":  # HF's GLM forward takes images or videos in one call, not both
        batches = [["image", "image"], ["video"]]
    for k, items in enumerate(batches):
        ids, mask, img_thw, vid_thw = random_batch(family, 23 + k, items, left=True)
        assert (mask[:, 0] == 0).any(), "the batch is left-padded"
        img_px, vid_px = _pixels(family, img_thw, 1 + k), _pixels(family, vid_thw, 2 + k)
        ref = hf_logits(family, model, ids, mask, img_thw, img_px, vid_thw, vid_px)
        ours = our_logits(family, model, ckpt, enc, ids, mask, img_thw, img_px, vid_thw, vid_px)
        m = compare(ours.reshape(-1, ours.shape[-1]), ref.reshape(-1, ref.shape[-1]))
        assert FLOAT32.passes(m), f"{family} {items}: {m}; bar {FLOAT32.describe()}"
        print(f"\n{family} {items}: logits rel {m['rel']:.3g}, max abs / max|ref| {m['max_rel']:.3g}")
        # the bar sees the positions and the splice: either one wrong fails it
        for spoil in ("positions", "order") if k == 0 else ():
            bad = our_logits(family, model, ckpt, enc, ids, mask, img_thw, img_px, vid_thw, vid_px, spoil=spoil)
            m = compare(bad.reshape(-1, bad.shape[-1]), ref.reshape(-1, ref.shape[-1]))
            assert not FLOAT32.passes(m), f"{family}: {spoil} spoiled still passes ({m})"
            print(f"{family} with {spoil} spoiled: logits rel {m['rel']:.3g}")
