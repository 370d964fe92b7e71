"""From the tower to the language model, against HF's whole model: tiny *ForConditionalGeneration
models (random weights, float32) of Qwen2.5-VL, Qwen3-VL (deepstack), Qwen3.5 (partial rotary),
GLM-4.1V (rotated pairs), the Qwen3-Omni thinker (deepstack, a video at 0.5 s per temporal patch:
12.5 positions per patch, fractional times) and the Qwen2.5-Omni thinker; a batch of two
left-padded prompts with two images and a video.

Reference: HF's whole model (its tower, positions, splice and rotary): its logits, and 8 tokens of
its greedy `generate`. Ours: the checkpoint save_pretrained wrote, converted, encoded by
qvj.VisionEncoder; `lm_inputs` (positions, deltas and the splice plan from one call) and the splice
of those embeddings into HF's token embeddings; HF's language model and lm_head on them, its rotary
module's output replaced by our `mrope_tables` of our positions. Then 8 greedy tokens decoded with
our `decode_positions` and tables through HF's language model and its KV cache. The docs/numerics.md
float32 bar (hf_reference.FLOAT32) on the logits; the same tokens.

Spoiling our side must fail the bar: plain text positions, the images' rows swapped, or the
frequency layout of the other kind (blocks of mrope_section for an interleaving family and back).

GLM-4V's forward masks videos with its image id, so a prompt with images and a video fails there
(tests/test_splice.py shows ours splices it); its reference is run on an image batch and a video
batch separately."""

from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_utils import random_pixels
from lm_models import TOWERS, inner, prompt_config_of, random_batch, tiny_hf

import qwen_vit_jax as qvj
from qwen_vit_jax.families import OMNI
from qwen_vit_jax.prompt.positions import token_types
from qwen_vit_jax.prompt.rope_config import INTERLEAVE, SECTIONS
from qwen_vit_jax.prompt.splice import apply_deepstack, apply_splice
from qwen_vit_jax.tools.hf_reference import FLOAT32, compare

E2E = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v", "qwen3_omni_moe", "qwen2_5_omni"]
SECONDS_PER_GRID = {"qwen2_5_omni": 1.0, "qwen3_omni_moe": 0.5}  # the Omni thinkers read one per video
DEEPSTACK = ("qwen3_vl", "qwen3_omni_moe")
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=E2E)
def case(request, tmp_path_factory):
    """(family, HF whole model, converted checkpoint dir, our encoder)."""
    family = request.param
    model = tiny_hf(family, seed=17)
    root = tmp_path_factory.mktemp(family)
    model.save_pretrained(root / "hf")
    qvj.convert_checkpoint(root / "hf", root / "ours")
    enc = qvj.VisionEncoder.from_pretrained(root / "ours", dtype="float32")
    return family, model, root / "ours", enc


def owner(family, model):
    """What HF's user calls: the whole model, or an Omni model's thinker."""
    return model.thinker if family in OMNI else model


def batches(family):
    if family == "glm4v":  # HF's GLM forward takes images or videos in one call, not both
        return [["image", "image"], ["video"]]
    return [["image", "video", "image"]]


GENERATION_PROMPT = [7, 8, 9]  # what a chat template ends the prompt with (<|im_start|>assistant\n)


def make_batch(family, k, items):
    """A left-padded batch (input_ids, attention_mask, grids and pixels), each row ending in text.

    HF's generate continues each row from its last token's position + 1 (GenerationMixin), its
    forward with a cache (and `decode_positions`) from the largest position + 1: the same when the
    prompt ends with text, as a chat template's generation prompt does (docs/positions.md)."""
    ids, mask, img_thw, vid_thw = random_batch(family, 23 + k, items, left=True)
    assert (mask[:, 0] == 0).any(), "the batch is left-padded"
    tail = np.broadcast_to(np.array(GENERATION_PROMPT, ids.dtype), (len(ids), len(GENERATION_PROMPT)))
    ids, mask = np.concatenate([ids, tail], 1), np.concatenate([mask, np.ones_like(tail)], 1)
    px = [
        None if not len(g) else random_pixels(TOWERS[family], g, seed=s)
        for g, s in ((img_thw, 1 + k), (vid_thw, 2 + k))
    ]
    return ids, mask, img_thw, px[0], vid_thw, px[1]


def hf_kwargs(family, ids, mask, img_thw, img_px, vid_thw, vid_px) -> dict:
    """HF's forward / generate inputs, as a user passes the processor's outputs."""
    kw = dict(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    if img_px is not None:
        kw.update(pixel_values=torch.from_numpy(img_px), image_grid_thw=torch.from_numpy(img_thw))
    if vid_px is not None:
        kw.update(pixel_values_videos=torch.from_numpy(vid_px), video_grid_thw=torch.from_numpy(vid_thw))
    if family in OMNI:
        if vid_px is not None:
            kw["video_second_per_grid"] = torch.full((len(vid_thw),), SECONDS_PER_GRID[family])
    else:
        kw["mm_token_type_ids"] = torch.from_numpy(token_types(prompt_config_of(family), ids))
    return kw


@contextlib.contextmanager
def our_rotary(lm, cfg):
    """HF's language model with its rotary module's output replaced by our tables of the positions
    it is given."""

    def forward(x, position_ids):
        cos, sin = qvj.mrope_tables(cfg, jnp.asarray(position_ids.numpy()), dtype=jnp.float32)
        return torch.from_numpy(np.array(cos)), torch.from_numpy(np.array(sin))

    lm.rotary_emb.forward = forward
    try:
        yield
    finally:
        del lm.rotary_emb.forward


def spoiled_layout(cfg):
    """The config with the other kind of frequency layout (an interleaving family's in blocks)."""
    other = SECTIONS if cfg.rules.mrope == INTERLEAVE else INTERLEAVE
    return dataclasses.replace(cfg, rules=dataclasses.replace(cfg.rules, mrope=other))


class Ours:
    """Our side of one batch: the tower's embeddings, `lm_inputs`, the spliced inputs."""

    def __init__(self, family, ckpt, enc, ids, mask, img_thw, img_px, vid_thw, vid_px):
        self.family, self.ids, self.mask = family, ids, mask
        seconds = SECONDS_PER_GRID.get(family)
        self.inputs = qvj.lm_inputs(
            ckpt,
            ids,
            image_grid_thw=img_thw if img_px is not None else None,
            video_grid_thw=vid_thw if vid_px is not None else None,
            second_per_grid_ts=None if seconds is None or vid_px is None else [seconds] * len(vid_thw),
            attention_mask=mask,
        )
        self.feats, self.deepstack = {}, {}
        for name, px, thw in (("image", img_px, img_thw), ("video", vid_px, vid_thw)):
            if px is None:
                self.feats[name] = self.deepstack[name] = None
            elif family in DEEPSTACK:
                self.feats[name], self.deepstack[name] = enc.encode(px, thw, return_deepstack=True)
            else:
                self.feats[name] = enc.encode(px, thw)

    def lm_call(self, model, text, image=None, positions=None):
        """The language model's keyword arguments for the prompt (image rows possibly replaced)."""
        plan = self.inputs.splice
        image = self.feats["image"] if image is None else image
        emb = apply_splice(plan, text, image, self.feats["video"])
        kw = dict(
            inputs_embeds=torch.from_numpy(np.array(emb)),
            attention_mask=torch.from_numpy(self.mask),
            position_ids=torch.from_numpy(self.inputs.position_ids if positions is None else positions),
        )
        if self.family in DEEPSTACK:
            ds = apply_deepstack(plan, self.deepstack["image"], self.deepstack["video"])
            kw.update(
                visual_pos_masks=torch.from_numpy(plan.visual_pos_masks),
                deepstack_visual_embeds=[torch.from_numpy(np.array(d)) for d in ds],
            )
        return kw


def our_logits(family, model, ckpt, ours, spoil=None) -> np.ndarray:
    """HF's language model and lm_head on our inputs and our rotary. `spoil`: "positions" (plain
    text positions), "order" (the image rows reversed) or "layout" (the other frequency layout)."""
    lm = inner(model).language_model
    cfg = prompt_config_of(family)
    with torch.no_grad():
        text = lm.get_input_embeddings()(torch.from_numpy(ours.ids)).numpy()
    image, positions = None, None
    if spoil == "positions":
        dtype = ours.inputs.position_ids.dtype
        positions = np.broadcast_to(np.cumsum(ours.mask, -1) - 1, ours.inputs.position_ids.shape).astype(dtype)
    elif spoil == "order":
        image = ours.feats["image"][::-1]
    elif spoil == "layout":
        cfg = spoiled_layout(cfg)
    with torch.no_grad(), our_rotary(lm, cfg):
        hidden = lm(**ours.lm_call(model, text, image, positions)).last_hidden_state
        return owner(family, model).lm_head(hidden).numpy()


def our_greedy(family, model, ours) -> np.ndarray:
    """NEW_TOKENS greedy tokens: our prompt inputs, then our decode positions and tables, through HF's
    language model and its KV cache."""
    lm = inner(model).language_model
    head = owner(family, model).lm_head
    cfg = prompt_config_of(family)
    embed = lm.get_input_embeddings()
    with torch.no_grad(), our_rotary(lm, cfg):
        out = lm(**ours.lm_call(model, embed(torch.from_numpy(ours.ids)).numpy()), use_cache=True)
        token = head(out.last_hidden_state[:, -1]).argmax(-1)
        tokens, mask, cache = [token], ours.mask, out.past_key_values
        for _ in range(1, NEW_TOKENS):
            mask = np.concatenate([mask, np.ones((len(mask), 1), mask.dtype)], axis=1)
            pos = qvj.decode_positions(ours.inputs.rope_deltas, mask.shape[1] - 1, 1, attention_mask=mask)
            out = lm(
                inputs_embeds=embed(token[:, None]),
                attention_mask=torch.from_numpy(mask),
                position_ids=torch.from_numpy(pos),
                cache=cache,
                use_cache=True,
            )
            token = head(out.last_hidden_state[:, -1]).argmax(-1)
            tokens.append(token)
            cache = out.past_key_values
    return torch.stack(tokens, 1).numpy()


def test_logits_equal_hf_whole_model(case):
    family, model, ckpt, enc = case
    for k, items in enumerate(batches(family)):
        ids, mask, img_thw, img_px, vid_thw, vid_px = make_batch(family, k, items)
        with torch.no_grad():
            ref = owner(family, model)(**hf_kwargs(family, ids, mask, img_thw, img_px, vid_thw, vid_px)).logits.numpy()
        ours = Ours(family, ckpt, enc, ids, mask, img_thw, img_px, vid_thw, vid_px)
        if family == "qwen3_omni_moe":  # HF's float32 positions, a video's time fractional
            pos = ours.inputs.position_ids
            assert pos.dtype == np.float32 and (pos != np.floor(pos)).any()
        m = compare(*(x.reshape(-1, x.shape[-1]) for x in (our_logits(family, model, ckpt, ours), ref)))
        assert FLOAT32.passes(m), f"{family} {items}: {m}; bar {FLOAT32.describe()}"
        print(f"\n{family} {items}: logits rel {m['rel']:.3g}, max abs / max|ref| {m['max_rel']:.3g}")
        # the bar sees the positions, the splice and the rotary's layout: any one wrong fails it
        for spoil in ("positions", "order", "layout") if k == 0 else ():
            bad = our_logits(family, model, ckpt, ours, spoil=spoil)
            m = compare(bad.reshape(-1, bad.shape[-1]), ref.reshape(-1, ref.shape[-1]))
            assert not FLOAT32.passes(m), f"{family}: {spoil} spoiled still passes ({m})"
            print(f"{family} with {spoil} spoiled: logits rel {m['rel']:.3g}")


def test_greedy_tokens_equal_hf_generate(case):
    """8 tokens: HF's greedy generate (its own positions, rotary and cache) against ours."""
    family, model, ckpt, enc = case
    for k, items in enumerate(batches(family)):
        ids, mask, img_thw, img_px, vid_thw, vid_px = make_batch(family, k, items)
        kw = hf_kwargs(family, ids, mask, img_thw, img_px, vid_thw, vid_px)
        with torch.no_grad():  # no eos: every row runs all NEW_TOKENS steps, as ours does
            ref = (
                owner(family, model)
                .generate(**kw, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)[
                    :, ids.shape[1] :
                ]
                .numpy()
            )
        inputs = Ours(family, ckpt, enc, ids, mask, img_thw, img_px, vid_thw, vid_px)
        pos = inputs.inputs.position_ids
        assert (pos[..., -1] == pos.max(axis=(0, 2))).all(), "each row's last token is at its largest position"
        ours = our_greedy(family, model, inputs)
        assert ref.shape == ours.shape == (len(ids), NEW_TOKENS)
        np.testing.assert_array_equal(ours, ref, err_msg=f"{family} {items}")
