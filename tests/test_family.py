"""The rest of the family vs transformers: the towers we have under other HF model families
(Qwen3-VL-MoE, Qwen3.5-MoE, Qwen4-Exp, Qwen3-Omni, Qwen2.5-Omni; config.FAMILIES).

For each family: HF's full model built from a tiny config (random weights, every vision parameter
re-initialised) -> `save_pretrained` (the family's real layout: `model.visual.*`,
`thinker.visual.*`, nested `thinker_config`) -> `VisionConfig.from_hf` -> our converter ->
`VisionEncoder.encode`, compared with the contract: HF's `get_image_features(pixel_values,
grid_thw)` (what the language model receives), concatenated, at the float32 and bf16 bars of
docs/numerics.md, on an image, a video and a mixed batch; Qwen3-Omni's deepstack features too.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from hf_utils import (
    assert_bf16_close,
    assert_converted_equals_hf,
    assert_encode_images_equal_hf,
    assert_fp32_close,
    random_pixels,
)
from sample_images import make_image
from towers import FAMILY, Q3, case_fixture, hub_preprocessor

import qwen_vit_jax as qvj
from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.presets import PRESETS, QWEN3_VL_8B
from qwen_vit_jax.tools.hf_reference import hf_config, hf_image_features, hf_tower
from qwen_vit_jax.weights import hf_read, keys
from qwen_vit_jax.weights.safetensors_io import CheckpointError

TINY_Q3 = Q3  # tests/towers.py
CONFIGS = FAMILY
# Where each family's checkpoint keeps the tower (what save_pretrained writes).
PREFIX = {
    "qwen3_vl_moe": "model.visual.",
    "qwen3_5_moe": "model.visual.",
    "qwen4_exp": "model.visual.",
    "qwen3_omni_moe": "thinker.visual.",
    "qwen2_5_omni": "thinker.visual.",
}
GRIDS = {
    "image": [[1, 10, 14]],  # larger than the 6 x 6 table; partial windows on both sides
    "video": [[3, 8, 12]],
    "mixed": [[1, 4, 4], [2, 16, 12], [1, 2, 2], [1, 2, 18], [1, 8, 8]],
}


case = case_fixture(CONFIGS)  # (name, cfg, HF full model, root with hf/ and ours/)


@pytest.fixture(scope="module")
def encoder(case, towers):
    return towers[case[0]].encoder()


def test_checkpoint_layout_and_converter(case):
    """save_pretrained wrote the family's layout; the converter reads exactly its vision keys."""
    name, cfg, hf, root = case
    config = json.loads((root / "hf" / "config.json").read_text())
    assert config["model_type"] == name
    nested = config["thinker_config"] if name in ("qwen3_omni_moe", "qwen2_5_omni") else config
    assert nested["vision_config"]["model_type"].startswith(name)
    where, _ = hf_read.locate_tensors(root / "hf")
    assert hf_read.vision_prefix(where, root / "hf") == PREFIX[name]
    assert keys.key_layout(cfg) == (name if "omni" in name else keys.NATIVE)
    _, params = hf_read.read_hf_vision_params(root / "hf")
    assert {k: v.shape for k, v in params.items()} == keys.expected_param_shapes(cfg)
    state = {k: v.numpy() for k, v in hf_tower(hf).state_dict().items()}
    if name == "qwen2_5_omni":  # q, k, v fused into our qkv: columns q | k | v
        for i in range(cfg.depth):
            fused = np.concatenate([state[f"blocks.{i}.attn.{n}.weight"] for n in "qkv"]).T
            np.testing.assert_array_equal(params["blocks.attn.qkv.kernel"][i], fused)
            bias = np.concatenate([state[f"blocks.{i}.attn.{n}.bias"] for n in "qkv"])
            np.testing.assert_array_equal(params["blocks.attn.qkv.bias"][i], bias)
    if name == "qwen3_omni_moe":  # merger_list.k.ln_q / mlp.0 / mlp.2 -> deepstack row k
        for k in range(cfg.num_deepstack):
            np.testing.assert_array_equal(params["deepstack.norm.bias"][k], state[f"merger_list.{k}.ln_q.bias"])
            np.testing.assert_array_equal(params["deepstack.fc2.kernel"][k], state[f"merger_list.{k}.mlp.2.weight"].T)
        np.testing.assert_array_equal(params["merger.norm.scale"], state["merger.ln_q.weight"])


@pytest.mark.parametrize("grid", list(GRIDS))
def test_parity_fp32(case, encoder, grid):
    name, cfg, hf, _ = case
    grid_thw = np.array(GRIDS[grid])
    px = random_pixels(cfg, grid_thw, seed=3)
    ref = hf_image_features(hf, px, grid_thw)
    tokens, feats = encoder.encode(px, grid_thw, return_deepstack=True)
    assert tokens.dtype == np.float32
    rel, max_rel = assert_fp32_close(tokens, ref)
    print(f"\n{name} {grid} fp32: rel {rel:.3g}, max abs / max|ref| {max_rel:.3g}")
    if cfg.num_deepstack:  # what the language model adds at its first layers
        owner = hf.thinker if hasattr(hf, "thinker") else hf
        with torch.no_grad():
            out = owner.get_image_features(torch.from_numpy(px), torch.from_numpy(grid_thw.astype(np.int64)))
        assert len(feats) == len(out.deepstack_features) == cfg.num_deepstack
        for ours, want in zip(feats, out.deepstack_features, strict=True):
            # one [T, D] tensor per layer up to transformers 5.17; later, a tuple of per-image pieces
            assert_fp32_close(ours, (want if torch.is_tensor(want) else torch.cat(list(want))).numpy())


def test_parity_bf16(case):
    name, cfg, hf, root = case
    enc = qvj.VisionEncoder.from_pretrained(root / "ours", dtype="bfloat16")
    grid = np.array(GRIDS["mixed"])
    px = random_pixels(cfg, grid, seed=7)
    cos, rel = assert_bf16_close(enc.encode(px, grid), hf_image_features(hf, px, grid))
    print(f"\n{name} mixed bf16: min cos {cos:.5f}, rel {rel:.3g}")


def test_encode_images_with_hub_preprocessor(case, encoder):
    """encode_images reads the checkpoint's preprocessor_config.json and matches HF's processor
    (the same Qwen2-VL image processor for every family here), then get_image_features."""

    from transformers import Qwen2VLImageProcessorPil

    _, cfg, hf, _ = case
    images = [make_image(200, 300, seed=1), make_image(300, 260, seed=2)]
    pre = {k: v for k, v in hub_preprocessor(cfg).items() if k != "image_processor_type"}
    assert_encode_images_equal_hf(encoder, hf, lambda: Qwen2VLImageProcessorPil(**pre), images)


# ---- config ------------------------------------------------------------------------------------
def test_from_hf_nested_and_hub_layouts():
    """Each family's HF default config reads as HF would build it; the Omni towers nested under
    thinker_config, a thinker-only config, a vision-only one, and Qwen4-Exp's old vision
    model_type "qwen4_exp" (which HF rewrites) all read as the same tower."""
    from transformers import Qwen2_5OmniConfig, Qwen3OmniMoeConfig, Qwen4ExpConfig

    omni3 = Qwen3OmniMoeConfig().to_dict()
    want = dataclasses.replace(QWEN3_VL_8B, out_dim=3584, family="qwen3_omni_moe")  # HF's default width
    assert VisionConfig.from_hf(omni3) == want
    assert VisionConfig.from_hf(omni3["thinker_config"]) == want  # the thinker's own config.json
    assert VisionConfig.from_hf(omni3["thinker_config"]["vision_config"]) == want
    omni25 = Qwen2_5OmniConfig().to_dict()
    hf_default = VisionConfig.from_hf(omni25)  # HF's default width is 3584; the released tower's 1280
    assert hf_default == dataclasses.replace(PRESETS["qwen2.5-omni-7b"], width=3584)
    assert VisionConfig.from_hf(Qwen4ExpConfig().to_dict()) == dataclasses.replace(PRESETS["qwen4-exp"], out_dim=3584)
    old = {"model_type": "qwen4_exp", "vision_config": {"model_type": "qwen4_exp", "out_hidden_size": 2560}}
    assert VisionConfig.from_hf(old) == PRESETS["qwen4-exp"]
    assert VisionConfig.from_hf(old["vision_config"]) == PRESETS["qwen4-exp"]  # no longer ambiguous
    for name, cfg in PRESETS.items():  # every preset survives its own HF config layout
        assert VisionConfig.from_hf(hf_config(cfg)) == cfg, name


@pytest.mark.parametrize(
    "d, match",
    [
        ({"model_type": "qwen3_omni_moe", "thinker_config": {"vision_config": {"model_type": "qwen3_5"}}}, "disagrees"),
        ({"model_type": "qwen2_5_omni", "thinker_config": {"vision_config": {"model_type": "qwen3_vl"}}}, "disagrees"),
        ({"model_type": "qwen3_omni_moe", "thinker_config": []}, "thinker_config is not an object"),
        ({"model_type": "qwen4_exp", "vision_config": {"deepstack_visual_indexes": [3]}}, "no deepstack"),
    ],
)
def test_from_hf_errors(d, match):
    with pytest.raises(ValueError, match=match):
        VisionConfig.from_hf(d)


def test_family_field():
    assert dataclasses.replace(TINY_Q3, family="qwen3_vl") == TINY_Q3  # the variant's own: one spelling
    assert CONFIGS["qwen4_exp"].hf_family == "qwen4_exp" and TINY_Q3.hf_family == "qwen3_vl"
    with pytest.raises(ValueError, match="does not carry a qwen3_vl tower"):
        dataclasses.replace(TINY_Q3, family="qwen3_5_moe")
    with pytest.raises(ValueError, match="does not carry"):
        dataclasses.replace(TINY_Q3, family="glm4v")
    for name in ("qwen3-vl-30b-a3b", "qwen3.5-35b-a3b", "qwen4-exp", "qwen3-omni-30b-a3b", "qwen2.5-omni-7b"):
        cfg = PRESETS[name]
        assert VisionConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_converter_errors_name_the_key(tmp_path):
    """An Omni checkpoint with a stray key, or with one of q / k / v missing, names it."""
    from qwen_vit_jax.tools.demo import random_hf_tensors
    from qwen_vit_jax.weights.safetensors_io import write_safetensors

    cfg = CONFIGS["qwen2_5_omni"]
    tensors = random_hf_tensors(cfg, seed=0)
    assert "thinker.visual.blocks.0.attn.k.weight" in tensors and not any(".qkv." in k for k in tensors)
    for name, change in [
        (
            "stray",
            lambda t: t.update({"thinker.visual.blocks.0.attn.qkv.weight": t["thinker.visual.merger.mlp.0.weight"]}),
        ),
        ("missing", lambda t: t.pop("thinker.visual.blocks.2.attn.v.bias")),
    ]:
        d = tmp_path / name
        d.mkdir()
        t = dict(tensors)
        change(t)
        write_safetensors(d / "model.safetensors", t, {"format": "pt"})
        (d / "config.json").write_text(json.dumps(hf_config(cfg)))
        with pytest.raises(CheckpointError, match=r"blocks\.(0\.attn\.qkv\.weight|2\.attn\.v\.bias)"):
            hf_read.read_hf_vision_params(d)


@pytest.mark.parametrize("variant", ["qwen3-vl-moe", "qwen3.5-moe", "qwen4-exp", "qwen3-omni", "qwen2.5-omni"])
def test_demo_checkpoint_loads_in_transformers(variant, tmp_path):
    """`demo --variant` writes the family's layout: HF's own model class loads every vision key of
    it (no missing, no unexpected), and our encode of it matches HF's get_image_features."""
    from qwen_vit_jax.tools.demo import VARIANTS, write_random_hf_checkpoint
    from qwen_vit_jax.tools.hf_reference import _hf_classes

    cfg = VARIANTS[variant]["tiny"]
    hf_dir = write_random_hf_checkpoint(cfg, tmp_path / "hf", seed=1)
    assert qvj.VisionConfig.from_hf(hf_dir) == cfg
    config_cls, _, _, model_cls = _hf_classes(cfg.hf_family)
    if variant == "qwen2.5-omni":  # the full model also wants the talker's spk_dict.pt: load the thinker
        from transformers import Qwen2_5OmniThinkerForConditionalGeneration as model_cls

        kw = {"config": config_cls.from_pretrained(hf_dir).thinker_config}
    else:
        kw = {}
    model, info = model_cls.from_pretrained(hf_dir, output_loading_info=True, **kw)
    assert not [k for k in info["missing_keys"] if "visual" in k] and not info["unexpected_keys"]
    assert_converted_equals_hf(model, hf_dir, cfg, tmp_path)
