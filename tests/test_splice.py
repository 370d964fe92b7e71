"""`splice` against HF's own forward code (get_placeholder_mask + masked_scatter, and Qwen3-VL's
visual_pos_masks / deepstack_visual_embeds), bit for bit, on random batched prompts; its count
checks; the host / device split under jit; and `expand_placeholders` against HF's processors' text
expansion (replace_*_token + get_text_with_replacements), compared through a fake vocabulary.

The tiny HF models here (`tiny_hf`) have a text model as wide as the tower's output and token ids
inside its vocabulary, so their whole forward runs (tests/test_lm_end_to_end.py uses them too)."""

from __future__ import annotations

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import qwen_vit_jax as qvj
from qwen_vit_jax.families import OMNI
from qwen_vit_jax.presets import PRESETS
from qwen_vit_jax.prompt.config import IMAGE, VIDEO, config_from_dict
from qwen_vit_jax.prompt.positions import token_types
from qwen_vit_jax.prompt.splice import apply_deepstack, apply_splice, plan_splice
from qwen_vit_jax.tools.hf_reference import (
    AUDIO_CONFIG,
    TEXT_CONFIG,
    TEXT_CONFIG_GLM4V,
    TEXT_CONFIG_QWEN3,
    TEXT_CONFIG_QWEN3_5,
    hf_vision_config,
    reinit_,
    text_config,
)

WIDTH = 32  # the tower's output = the text model's hidden size
_SMALL = dict(depth=2, width=32, num_heads=2, intermediate_size=48, out_dim=WIDTH)
TOWERS = {
    "qwen2_5_vl": dataclasses.replace(PRESETS["qwen2.5-vl-3b"], **_SMALL, fullatt_block_indexes=(1,)),
    "qwen3_vl": dataclasses.replace(
        PRESETS["qwen3-vl-8b"], **_SMALL, num_position_embeddings=16, deepstack_layers=(0, 1)
    ),
    "glm4v": dataclasses.replace(
        PRESETS["glm-4.1v-9b"],
        **dict(_SMALL, intermediate_size=WIDTH),  # GLM: the block MLP width is out_dim
        merger_intermediate_size=40,
        num_position_embeddings=16,
    ),
}
TOWERS["qwen2_5_omni"] = dataclasses.replace(TOWERS["qwen2_5_vl"], family="qwen2_5_omni")
FAMILIES = list(TOWERS)  # the splice and placeholder tests'; tests/test_lm_end_to_end.py adds two more
TOWERS["qwen3_5"] = dataclasses.replace(PRESETS["qwen3.5-27b"], **_SMALL, num_position_embeddings=16)
TOWERS["qwen3_omni_moe"] = dataclasses.replace(TOWERS["qwen3_vl"], family="qwen3_omni_moe")
# Token ids inside the tiny text models' vocabulary (128): text tokens are 1 .. 99, 0 pads.
QWEN_IDS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
GLM_IDS = dict(
    image_token_id=120,
    video_token_id=121,
    image_start_token_id=122,
    image_end_token_id=123,
    video_start_token_id=124,
    video_end_token_id=125,
)
OMNI_IDS = dict(
    image_token_index=120,
    video_token_index=121,
    vision_start_token_id=122,
    vision_end_token_id=123,
    audio_token_index=124,
    audio_start_token_id=125,
    audio_end_token_id=126,
)
QWEN3_OMNI_IDS = {k.replace("_index", "_id"): v for k, v in OMNI_IDS.items()}  # its thinker's spelling
# The text models: each family's tiny one (hf_reference), Qwen3.5's wider, so its partial rotary has 8
# frequencies in 3 interleaved sections (the default 0.25 of 16 would leave 2)
TEXT = {
    "qwen2_5_vl": TEXT_CONFIG,
    "qwen2_5_omni": TEXT_CONFIG,
    "qwen3_vl": TEXT_CONFIG_QWEN3,
    "glm4v": TEXT_CONFIG_GLM4V,
    "qwen3_5": dict(
        TEXT_CONFIG_QWEN3_5,
        head_dim=32,
        rope_parameters={
            "rope_type": "default",
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    ),
    "qwen3_omni_moe": text_config(TOWERS["qwen3_omni_moe"]),
}


def hf_config_dict(family: str) -> dict:
    """The config of a tiny whole model of `family` (what save_pretrained writes, as a dict)."""
    cfg = TOWERS[family]
    vision = hf_vision_config(cfg)
    text = dict(TEXT[family], hidden_size=WIDTH)
    if family in OMNI:
        thinker = dict(
            model_type=f"{family}_thinker", text_config=text, vision_config=vision, audio_config=AUDIO_CONFIG
        )
        ids = OMNI_IDS if family == "qwen2_5_omni" else QWEN3_OMNI_IDS
        return dict(model_type=family, thinker_config=dict(thinker, **ids), enable_audio_output=False)
    ids = GLM_IDS if family == "glm4v" else QWEN_IDS
    return dict(model_type=family, text_config=text, vision_config=vision, **ids)


# family -> (HF module, config class, whole-model class)
HF_CLASSES = {
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "glm4v": ("glm4v", "Glm4vConfig", "Glm4vForConditionalGeneration"),
    "qwen2_5_omni": ("qwen2_5_omni", "Qwen2_5OmniConfig", "Qwen2_5OmniForConditionalGeneration"),
    "qwen3_5": ("qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_omni_moe": ("qwen3_omni_moe", "Qwen3OmniMoeConfig", "Qwen3OmniMoeForConditionalGeneration"),
}


def tiny_hf(family: str, seed: int = 0):
    """A tiny HF *ForConditionalGeneration (Omni: the whole model, with its thinker), float32, eval,
    every weight re-initialised the docs/numerics.md way."""
    import importlib

    module, config_name, model_name = HF_CLASSES[family]
    full_cls = getattr(importlib.import_module(f"transformers.models.{module}.configuration_{module}"), config_name)
    model_cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), model_name)
    d = hf_config_dict(family)
    torch.manual_seed(seed)
    if family in OMNI:
        hf_cfg = full_cls(thinker_config=d["thinker_config"], enable_audio_output=False)
        # HF 5.x's thinker config classes drop the vision start / end ids their get_rope_index reads
        for k in ("vision_start_token_id", "vision_end_token_id"):
            setattr(hf_cfg.thinker_config, k, OMNI_IDS[k])
    else:
        hf_cfg = full_cls(**{k: v for k, v in d.items() if k != "model_type"})
    model = model_cls(hf_cfg).eval()
    # every weight re-initialised (docs/numerics.md): HF's flat std 0.02 leaves attention so uniform
    # that wrong positions would hardly move the logits
    reinit_(model, seed)
    return model


def inner(model):
    """The *Model whose forward splices (an Omni model's: its thinker's)."""
    return model.thinker.model if hasattr(model, "thinker") else model.model


def prompt_config_of(family: str):
    return config_from_dict(hf_config_dict(family), where=family)


# ---- random prompts ---------------------------------------------------------------------------------
def placeholder_prompts(family: str, rng, items: list[str], batch: int = 2) -> list[list[int]]:
    """`batch` rows of random text with the items ("image" / "video") spread over them in order, each
    as the chat template writes it (one placeholder token)."""
    cfg = prompt_config_of(family)
    rows = [list(rng.integers(1, 100, rng.integers(1, 6))) for _ in range(batch)]
    for i, kind in enumerate(items):
        row = rows[i % batch] if rng.random() < 0.7 else rows[int(rng.integers(batch))]
        if kind == "image":
            row += [cfg.vision_start_token_id or cfg.image_start_token_id, cfg.image_token_id]
            row += [cfg.vision_end_token_id or cfg.image_end_token_id]
        elif family == "glm4v":
            row += [cfg.video_start_token_id, cfg.video_token_id, cfg.video_end_token_id]
        else:
            row += [cfg.vision_start_token_id, cfg.video_token_id, cfg.vision_end_token_id]
        row += list(rng.integers(1, 100, rng.integers(0, 5)))
    return rows


def timestamp_ids(text: str) -> list[int]:
    """A fake tokenizer for the frame times: one text token per character."""
    return [1 + ord(c) % 90 for c in text]


def random_batch(family: str, seed: int, items: list[str], left: bool = True):
    """(input_ids [B, L] padded with 0, attention_mask [B, L], image grids, video grids) of a random
    expanded batch: items in order, random small grids."""
    rng = np.random.default_rng(seed)
    kinds = [k for k in items]
    prompts = placeholder_prompts(family, rng, kinds)
    grid = {"image": [], "video": []}
    for k in kinds:
        t = 1 if k == "image" else int(rng.integers(1, 4))
        grid[k].append([t, 2 * int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4))])
    thw = {k: np.array(v, np.int64).reshape(-1, 3) for k, v in grid.items()}
    ts = [np.arange(t) * 1.5 + 0.25 for t in thw["video"][:, 0]]
    rows = qvj.expand_placeholders(
        prompt_config_of(family),
        prompts,
        thw["image"] if len(thw["image"]) else None,
        thw["video"] if len(thw["video"]) else None,
        video_timestamps=ts,
        timestamp_ids=timestamp_ids,
    )
    length = max(len(r) for r in rows) + int(rng.integers(0, 3))
    ids = np.zeros((len(rows), length), np.int64)
    mask = np.zeros((len(rows), length), np.int64)
    for b, r in enumerate(rows):
        sl = slice(length - len(r), length) if left else slice(0, len(r))
        ids[b, sl], mask[b, sl] = r, 1
    return ids, mask, thw["image"], thw["video"]


def tokens(grid) -> int:
    return int((np.prod(grid, axis=1) // 4).sum()) if len(grid) else 0


# ---- splice vs HF's forward ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def hf_model(request):
    return request.param, tiny_hf(request.param, seed=3)


def hf_spliced(model, input_ids, image=None, video=None, image_ds=None, video_ds=None) -> dict:
    """What HF's forward hands its language model (inputs_embeds, visual_pos_masks,
    deepstack_visual_embeds), given these features (mm_encoder_outputs: the tower is not run)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    m = inner(model)
    seen = {}

    def capture(**kw):
        seen.update(kw)
        return BaseModelOutputWithPast(last_hidden_state=kw["inputs_embeds"])

    outputs = {}
    for name, x, ds in (("image", image, image_ds), ("video", video, video_ds)):
        if x is not None:
            deep = None if ds is None else [(torch.from_numpy(f),) for f in ds]
            outputs[name] = BaseModelOutputWithDeepstackFeatures(
                pooler_output=(torch.from_numpy(x),), deepstack_features=deep
            )
    ids = torch.from_numpy(input_ids)
    m.language_model.forward = capture
    try:
        with torch.no_grad():
            m(input_ids=ids, position_ids=torch.zeros((3, *ids.shape), dtype=torch.long), mm_encoder_outputs=outputs)
    finally:
        del m.language_model.forward
    return seen


def _features(rng, n: int) -> np.ndarray:
    return rng.standard_normal((n, WIDTH), dtype=np.float32)


@pytest.mark.parametrize("seed", range(4))
def test_splice_equals_hf_forward(hf_model, seed):
    """Random left / right padded batches of two rows with images and videos in random order: our
    inputs_embeds equal HF's bit for bit (Qwen3-VL: visual_pos_masks and the deepstack features too).
    GLM-4V's forward cannot take images and a video together, so its prompts hold one modality."""
    family, model = hf_model
    rng = np.random.default_rng(seed)
    items = list(rng.choice(["image", "video"], size=int(rng.integers(1, 5))))
    if family == "glm4v":
        items = [items[0]] * len(items)
    ids, _, img_thw, vid_thw = random_batch(family, seed, items, left=seed % 2 == 0)
    cfg = prompt_config_of(family)
    img = _features(rng, tokens(img_thw)) if len(img_thw) else None
    vid = _features(rng, tokens(vid_thw)) if len(vid_thw) else None
    text = inner(model).get_input_embeddings()(torch.from_numpy(ids)).detach().numpy()
    deep = family == "qwen3_vl"
    ds = {k: None if x is None else [_features(rng, len(x)) for _ in range(2)] for k, x in (("i", img), ("v", vid))}
    ref = hf_spliced(model, ids, img, vid, ds["i"], ds["v"])
    if deep:
        ours, masks, deepstack = qvj.splice(cfg, ids, text, img, vid, image_deepstack=ds["i"], video_deepstack=ds["v"])
        np.testing.assert_array_equal(masks, ref["visual_pos_masks"].numpy())
        assert len(deepstack) == len(ref["deepstack_visual_embeds"]) == 2
        for a, b in zip(deepstack, ref["deepstack_visual_embeds"]):
            np.testing.assert_array_equal(np.asarray(a), b.numpy())
    else:
        ours = qvj.splice(cfg, ids, text, img, vid)
    assert ours.dtype == jnp.float32 and ours.shape == (*ids.shape, WIDTH)
    np.testing.assert_array_equal(np.asarray(ours), ref["inputs_embeds"].numpy())


def test_splice_glm_images_and_a_video():
    """GLM-4V: HF's forward masks videos with the image id, so a prompt with both fails there; ours
    splices by the processor's types (image tokens inside <|begin_of_video|> .. <|end_of_video|>
    are video), the same rows a masked_scatter by those types puts there."""
    family = "glm4v"
    model = tiny_hf(family, seed=5)
    ids, _, img_thw, vid_thw = random_batch(family, 7, ["image", "video", "image"])
    cfg = prompt_config_of(family)
    rng = np.random.default_rng(0)
    img, vid = _features(rng, tokens(img_thw)), _features(rng, tokens(vid_thw))
    with pytest.raises(Exception, match="do not match"):
        hf_spliced(model, ids, img, vid)
    text = inner(model).get_input_embeddings()(torch.from_numpy(ids)).detach()
    types_ = torch.from_numpy(token_types(cfg, ids))
    ref = text.masked_scatter((types_ == IMAGE)[..., None], torch.from_numpy(img))
    ref = ref.masked_scatter((types_ == VIDEO)[..., None], torch.from_numpy(vid))
    np.testing.assert_array_equal(np.asarray(qvj.splice(cfg, ids, text.numpy(), img, vid)), ref.numpy())


def test_split_under_jit_and_dtypes():
    """plan_splice on the host, apply_splice inside a user's jit: equal to splice; bf16 features go
    into fp32 text embeddings cast as HF casts them; the same plan structure compiles once."""
    family = "qwen3_vl"
    cfg = prompt_config_of(family)
    ids, _, img_thw, vid_thw = random_batch(family, 11, ["image", "video", "image"])
    rng = np.random.default_rng(1)
    text = rng.standard_normal((*ids.shape, WIDTH), dtype=np.float32)
    img, vid = _features(rng, tokens(img_thw)), _features(rng, tokens(vid_thw))
    plan = plan_splice(cfg, ids, len(img), len(vid))
    traces = []

    @jax.jit
    def user_step(plan, text, img, vid):
        traces.append(1)
        return apply_splice(plan, text, img, vid) * 2.0

    got = user_step(plan, text, img, vid)
    np.testing.assert_array_equal(np.asarray(got), 2.0 * np.asarray(qvj.splice(cfg, ids, text, img, vid)))
    user_step(plan_splice(cfg, ids, len(img), len(vid)), text + 1, img, vid)
    assert len(traces) == 1
    bf = jnp.asarray(img, jnp.bfloat16)
    out = qvj.splice(cfg, ids, text, bf, vid)
    want = torch.from_numpy(text).masked_scatter(
        torch.from_numpy(ids == cfg.image_token_id)[..., None],
        torch.from_numpy(np.array(bf.astype(jnp.float32))),
    )
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out)[ids == cfg.image_token_id], want.numpy()[ids == cfg.image_token_id])
    given = plan_splice(cfg, ids, len(img), len(vid), mm_token_type_ids=token_types(cfg, ids))
    for a, b in zip(jax.tree.leaves(plan), jax.tree.leaves(given)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="image_rows must be an int >= 0 or None, got -1"):
        plan_splice(cfg, ids, -1, len(vid))
    ds = apply_deepstack(plan, [img, img], [vid, vid])
    assert [d.shape for d in ds] == [(len(img) + len(vid), WIDTH)] * 2
    # a family without deepstack: its plan has no visual positions or deepstack rows to gather by
    flat = plan_splice(prompt_config_of("qwen2_5_vl"), ids, len(img), len(vid))
    assert flat.visual_pos_masks is None and flat.deepstack_rows is None
    np.testing.assert_array_equal(flat.rows, plan.rows)
    with pytest.raises(ValueError, match="the plan has no deepstack rows"):
        apply_deepstack(flat, [img], [vid])


def test_splice_count_checks():
    """HF's get_placeholder_mask checks, with both counts in the message; shapes and deepstack
    features that do not fit are named."""
    cfg = prompt_config_of("qwen3_vl")
    ids, _, img_thw, vid_thw = random_batch("qwen3_vl", 2, ["image", "video"])
    n_img, n_vid = tokens(img_thw), tokens(vid_thw)
    rng = np.random.default_rng(0)
    text = rng.standard_normal((*ids.shape, WIDTH), dtype=np.float32)
    img, vid = _features(rng, n_img), _features(rng, n_vid)
    with pytest.raises(ValueError, match=f"hold {n_img} image tokens, the image embeddings have {n_img - 1} rows"):
        qvj.splice(cfg, ids, text, img[1:], vid)
    with pytest.raises(ValueError, match=f"hold {n_vid} video tokens, the video embeddings have {n_vid + 2} rows"):
        qvj.splice(cfg, ids, text, img, np.concatenate([vid, vid[:2]]))
    with pytest.raises(ValueError, match=r"shape \(\d+, 16\)"):
        qvj.splice(cfg, ids, text, img[:, :16], vid)
    with pytest.raises(ValueError, match="text_embeds has shape"):
        qvj.splice(cfg, ids, text[:, 1:], img, vid)
    with pytest.raises(ValueError, match="none for the .* video tokens"):
        qvj.splice(cfg, ids, text, img, vid, image_deepstack=[img])
    with pytest.raises(ValueError, match="image_deepstack was given without image embeddings"):
        qvj.splice(cfg, ids, text, None, vid, image_deepstack=[img], video_deepstack=[vid])
    with pytest.raises(ValueError, match="differ"):
        qvj.splice(cfg, ids, text, img, vid, image_deepstack=[img, img], video_deepstack=[vid])
    with pytest.raises(ValueError, match=r"row 0, column 0: mm_token_type_ids value 7"):
        qvj.splice(cfg, ids, text, img, vid, mm_token_type_ids=np.full(ids.shape, 7))
    with pytest.raises(ValueError, match="integer array"):
        qvj.splice(cfg, ids[0], text[0], img, vid)
    # HF's meaning: embeddings not given -> no check, those tokens keep their text embeddings
    out = np.asarray(qvj.splice(cfg, ids, text, img))
    np.testing.assert_array_equal(out[ids == cfg.video_token_id], text[ids == cfg.video_token_id])


def test_splice_reads_the_checkpoint(tmp_path):
    """`source` as a checkpoint directory written by save_pretrained (token ids from its config)."""
    model = tiny_hf("qwen2_5_vl")
    model.save_pretrained(tmp_path / "hf")
    ids, _, img_thw, _ = random_batch("qwen2_5_vl", 4, ["image", "image"])
    rng = np.random.default_rng(2)
    text = rng.standard_normal((*ids.shape, WIDTH), dtype=np.float32)
    img = _features(rng, tokens(img_thw))
    a = qvj.splice(tmp_path / "hf", ids, text, img)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(qvj.splice(prompt_config_of("qwen2_5_vl"), ids, text, img)))


# ---- expand_placeholders vs HF's processors -------------------------------------------------------------
SPECIAL = {
    "qwen2_5_vl": dict(image="<|image_pad|>", video="<|video_pad|>", vs="<|vision_start|>", ve="<|vision_end|>"),
    "qwen3_vl": dict(image="<|image_pad|>", video="<|video_pad|>", vs="<|vision_start|>", ve="<|vision_end|>"),
    "glm4v": dict(
        image="<|image|>",
        video="<|video|>",
        vs="<|begin_of_image|>",
        ve="<|end_of_image|>",
        vds="<|begin_of_video|>",
        vde="<|end_of_video|>",
    ),
    "qwen2_5_omni": dict(
        image="<|IMAGE|>", video="<|VIDEO|>", vs="<|vision_bos|>", ve="<|vision_eos|>", audio="<|AUDIO|>"
    ),
}
_PROCESSORS = {
    "qwen2_5_vl": "transformers.models.qwen2_5_vl.processing_qwen2_5_vl.Qwen2_5_VLProcessor",
    "qwen3_vl": "transformers.models.qwen3_vl.processing_qwen3_vl.Qwen3VLProcessor",
    "glm4v": "transformers.models.glm4v.processing_glm4v.Glm4vProcessor",
    "qwen2_5_omni": "transformers.models.qwen2_5_omni.processing_qwen2_5_omni.Qwen2_5OmniProcessor",
}


def hf_processor(family: str):
    """HF's processor of the family with only what its text expansion reads (no tokenizer: the
    expansion works on strings)."""
    import importlib

    module, _, name = _PROCESSORS[family].rpartition(".")
    proc = object.__new__(getattr(importlib.import_module(module), name))
    s = SPECIAL[family]
    proc.image_token, proc.video_token = s["image"], s["video"]
    proc.vision_start_token, proc.vision_end_token = s["vs"], s["ve"]
    if "audio" in s:
        proc.audio_token = s["audio"]
    proc.image_processor = types.SimpleNamespace(merge_size=2)
    proc.video_processor = types.SimpleNamespace(merge_size=2, temporal_patch_size=2)
    return proc


def vocabulary(family: str) -> dict[str, int]:
    cfg = prompt_config_of(family)
    s = SPECIAL[family]
    vocab = {s["image"]: cfg.image_token_id, s["video"]: cfg.video_token_id}
    if family == "glm4v":
        vocab.update({s["vs"]: cfg.image_start_token_id, s["ve"]: cfg.image_end_token_id})
        vocab.update({s["vds"]: cfg.video_start_token_id, s["vde"]: cfg.video_end_token_id})
    else:
        vocab.update({s["vs"]: cfg.vision_start_token_id, s["ve"]: cfg.vision_end_token_id})
    if family == "qwen2_5_omni":
        vocab[s["audio"]] = cfg.audio_token_id
    return vocab


def fake_tokenize(family: str, text: str) -> list[int]:
    """Special tokens -> their config ids; <wN> -> N; any other text (frame times) -> timestamp_ids."""
    vocab = vocabulary(family)
    pattern = "|".join([*(re.escape(k) for k in vocab), r"<w\d+>"])
    out, last = [], 0
    for m in re.finditer(pattern, text):
        if m.start() > last:
            out += timestamp_ids(text[last : m.start()])
        out.append(vocab[m.group()] if m.group() in vocab else int(m.group()[2:-1]))
        last = m.end()
    if last < len(text):
        out += timestamp_ids(text[last:])
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("family", FAMILIES)
def test_expand_equals_hf_processor(family, seed):
    """Random chat texts with images, videos (and, Omni, audio) in random order, expanded by HF's
    processor as strings and by ours on ids: equal once tokenized."""
    rng = np.random.default_rng(seed)
    proc = hf_processor(family)
    s = SPECIAL[family]
    texts, kinds = [], []
    for _ in range(2):
        parts = [f"<w{rng.integers(1, 100)}>" for _ in range(rng.integers(1, 4))]
        for _ in range(rng.integers(1, 4)):
            kind = str(rng.choice(["image", "video", "audio"] if "audio" in s else ["image", "video"]))
            kinds.append(kind)
            if kind == "video" and family == "glm4v":
                parts.append(s["vds"] + s["video"] + s["vde"])
            elif kind in ("image", "video"):
                parts.append(s["vs"] + s[kind] + s["ve"])
            else:
                parts.append(s["audio"])
            parts += [f"<w{rng.integers(1, 100)}>" for _ in range(rng.integers(0, 3))]
        texts.append("".join(parts))
    n = {k: kinds.count(k) for k in ("image", "video", "audio")}
    img_thw = np.array([[1, 2 * rng.integers(1, 4), 2 * rng.integers(1, 4)] for _ in range(n["image"])]).reshape(-1, 3)
    vid_thw = np.array([[rng.integers(1, 4), 2 * rng.integers(1, 3), 2] for _ in range(n["video"])]).reshape(-1, 3)
    audio_tokens = rng.integers(1, 9, n["audio"])
    # HF's replacement strings, as its _process_* build them
    imgs = [proc.replace_image_token({"image_grid_thw": torch.from_numpy(img_thw)}, i) for i in range(n["image"])]
    video_ts, metas = [], []
    for t in vid_thw[:, 0]:
        if family == "glm4v":  # GLM prints int(timestamps[::2][f])
            meta = types.SimpleNamespace(fps=2.0, timestamps=list(np.arange(2 * t) * 0.75))
            video_ts.append(meta.timestamps[::2])
        else:  # Qwen3-VL: the mean time of each temporal patch's frames (odd counts repeat the last)
            frames = sorted(rng.choice(200, 2 * t - int(rng.integers(0, 2)), replace=False))
            meta = types.SimpleNamespace(fps=24.0, frames_indices=np.array(frames))
            video_ts.append(proc._calculate_timestamps(meta.frames_indices, 24.0, 2) if family == "qwen3_vl" else None)
        metas.append(meta)
    vinputs = {"video_grid_thw": torch.from_numpy(vid_thw), "video_metadata": metas}
    extra = {"load_audio_from_video": False} if family == "qwen2_5_omni" else {}
    vids = [proc.replace_video_token(vinputs, i, **extra) for i in range(n["video"])]
    auds = [proc.replace_audio_token({"num_audio_tokens": audio_tokens}, i) for i in range(n["audio"])]
    expanded, _ = proc.get_text_with_replacements(list(texts), imgs, vids, auds)
    want = [fake_tokenize(family, t) for t in expanded]

    got = qvj.expand_placeholders(
        prompt_config_of(family),
        [fake_tokenize(family, t) for t in texts],
        img_thw if n["image"] else None,
        vid_thw if n["video"] else None,
        video_timestamps=video_ts,
        timestamp_ids=timestamp_ids,
        audio_tokens=audio_tokens if n["audio"] else None,
    )
    assert [g.tolist() for g in got] == want


def test_expand_errors_and_shapes():
    cfg = prompt_config_of("qwen3_vl")
    i, v, vs, ve = cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id
    one = qvj.expand_placeholders(cfg, np.array([5, vs, i, ve, 6]), [[1, 2, 4]])
    assert one.dtype == np.int64 and one.tolist() == [5, vs, i, i, ve, 6]
    with pytest.raises(ValueError, match="row 1: image placeholder at 1 is image 1, but image_grid_thw has only 1"):
        qvj.expand_placeholders(cfg, [[i], [5, i]], [[1, 2, 2]])
    with pytest.raises(ValueError, match="image_grid_thw has 2 entries but input_ids hold 1 image placeholders"):
        qvj.expand_placeholders(cfg, [[i]], [[1, 2, 2], [1, 2, 2]])
    with pytest.raises(ValueError, match="needs video_timestamps and timestamp_ids"):
        qvj.expand_placeholders(cfg, [vs, v, ve], None, [[2, 2, 2]])
    with pytest.raises(ValueError, match="video 0 has 2 temporal patches but video_timestamps gives 1 times"):
        qvj.expand_placeholders(cfg, [vs, v, ve], None, [[2, 2, 2]], video_timestamps=[[0.0]], timestamp_ids=list)
    with pytest.raises(ValueError, match=r"image_grid_thw: grid_thw must have shape \[k, 3\]"):
        qvj.expand_placeholders(cfg, [i], [[1, 2]])
