"""`splice` against HF's own forward code (get_placeholder_mask + masked_scatter, and Qwen3-VL's
visual_pos_masks / deepstack_visual_embeds), bit for bit, on random batched prompts; its count
checks; the host / device split under jit; and `expand_placeholders` against HF's processors' text
expansion (replace_*_token + get_text_with_replacements), compared through a fake vocabulary.

The tiny HF whole models (tests/lm_models.py) have a text model as wide as the tower's output and
token ids inside its vocabulary, so their whole forward runs."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from lm_models import FAMILIES, WIDTH, inner, prompt_config_of, random_batch, timestamp_ids, tiny_hf

import qwen_vit_jax as qvj
from qwen_vit_jax.prompt.config import IMAGE, VIDEO
from qwen_vit_jax.prompt.positions import token_types
from qwen_vit_jax.prompt.splice import apply_deepstack, apply_splice, plan_splice


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
