"""GLM-4.1V / 4.5V vs transformers: the config, the 16-tap bicubic plan of the position table
against HF's index helper (exactly), the tower against HF's `get_image_features` (and
`get_video_features`, which feeds the tower per-frame grids) at the float32 and bf16 bars, the
image processor bit for bit, and the converter's key table (the downsample conv, the merger).

HF's GLM tower resamples its table with `F.grid_sample` (bicubic, align_corners=False, border);
our plan reproduces transformers' `get_vision_interpolation_indices_and_weights` (mode "bicubic")
exactly, and the end-to-end parity below holds that gather to the float32 bar against grid_sample.
"""

from __future__ import annotations

import dataclasses
import warnings

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
from towers import GLM_TINY, SPECS, assert_compiled_dots_are_ideal, case_fixture, check_real_size
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

import qwen_vit_jax as qvj
from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.plan.posembed import interpolation_indices_weights
from qwen_vit_jax.preprocess.config import GLM4V_PREPROCESS, PreprocessConfig
from qwen_vit_jax.preprocess.images import preprocess_glm4v_images
from qwen_vit_jax.presets import PRESETS
from qwen_vit_jax.tools.demo import HUB_PREPROCESSOR_GLM4V
from qwen_vit_jax.tools.hf_reference import hf_config, hf_image_features, hf_tower, hf_visual
from qwen_vit_jax.weights import hf_read, keys

GLM = PRESETS["glm-4.1v-9b"]
TINY = GLM_TINY  # tests/towers.py
CONFIGS = {name: SPECS[name].cfg for name in ("glm4v", "glm4v_moe")}
GRIDS = {
    "image": [[1, 10, 14]],  # larger than the table: upsampling
    "video": [[3, 8, 12]],  # HF: get_video_features (per-frame grids)
    "mixed": [[1, 4, 4], [1, 16, 12], [1, 2, 2], [1, 2, 18], [1, 6, 6]],
}


case = case_fixture(CONFIGS)  # (name, cfg, HF full model, root with hf/ and ours/)


@pytest.fixture(scope="module")
def encoder(case, towers):
    return towers[case[0]].encoder()


def hf_features(hf, px, grid, video: bool) -> np.ndarray:
    if not video:
        return hf_image_features(hf, px, grid)
    with torch.no_grad():
        out = hf.get_video_features(torch.from_numpy(px), torch.from_numpy(np.asarray(grid, np.int64)))
    return torch.cat(list(out.pooler_output)).numpy()


# ---- config ------------------------------------------------------------------------------------------
def test_config_from_hf():
    from transformers import Glm4vConfig, Glm4vMoeConfig

    assert VisionConfig.from_hf(Glm4vConfig().to_dict()) == GLM  # HF's defaults are the released tower
    assert VisionConfig.from_hf(Glm4vConfig().to_dict()["vision_config"]) == GLM
    assert VisionConfig.from_hf(Glm4vMoeConfig().to_dict()) == PRESETS["glm-4.5v"]
    for cfg in (GLM, PRESETS["glm-4.5v"], *CONFIGS.values()):
        assert VisionConfig.from_hf(hf_config(cfg)) == cfg
    assert (GLM.norm, GLM.mlp, GLM.merger, GLM.pos_embed_taps, GLM.pos_embed_side) == (
        "rmsnorm",
        "swiglu",
        "glm",
        16,
        24,
    )
    assert GLM.patch_norm and GLM.post_norm and not GLM.block_bias and not GLM.pos_embed_align_corners
    with pytest.raises(ValueError, match="output width"):
        dataclasses.replace(GLM, intermediate_size=1024)
    with pytest.raises(ValueError, match="merger_intermediate_size"):
        dataclasses.replace(GLM, merger_intermediate_size=0)
    with pytest.raises(ValueError, match="always has a qkv bias"):
        dataclasses.replace(PRESETS["qwen2.5-vl-3b"], qkv_bias=False)


# ---- the bicubic plan vs HF's helper ----------------------------------------------------------------------
@pytest.mark.parametrize("side", [1, 4, 6, 24])
@pytest.mark.parametrize(
    "grid", [[[1, 2, 2]], [[1, 4, 6]], [[1, 24, 24]], [[1, 50, 36]], [[3, 10, 8], [1, 52, 54], [2, 2, 34]]]
)
def test_bicubic_plan_matches_hf(grid, side):
    """16 taps (row taps outer), border clamping, Keys a = -0.75: indices equal, weights bit-identical."""
    cfg = dataclasses.replace(TINY, num_position_embeddings=side * side)
    idx, w = interpolation_indices_weights(grid, cfg, rows=int(np.prod(grid, axis=1).sum()) + 8)
    ref_idx, ref_w = get_vision_interpolation_indices_and_weights(
        torch.tensor(grid), side, mode="bicubic", align_corners=False, spatial_merge_size=2, padding="border"
    )
    n = len(ref_idx)
    assert idx.shape == w.shape == (n + 8, 16)
    np.testing.assert_array_equal(idx[:n], ref_idx.numpy())
    np.testing.assert_array_equal(w[:n], ref_w.numpy())
    assert not idx[n:].any() and not w[n:].any()  # padding rows: a zero position embedding


# ---- the tower vs get_image_features / get_video_features ------------------------------------------------
@pytest.mark.parametrize("grid", list(GRIDS))
def test_parity_fp32(case, encoder, grid):
    name, cfg, hf, _ = case
    g = np.array(GRIDS[grid])
    px = random_pixels(cfg, g, seed=3)
    ref = hf_features(hf, px, g, grid == "video")
    rel, max_rel = assert_fp32_close(encoder.encode(px, g), ref)
    np.testing.assert_array_equal(hf_visual(hf, px, g), ref)  # what `verify` runs: per-frame grids for GLM
    print(f"\n{name} {grid} fp32: rel {rel:.3g}, max abs / max|ref| {max_rel:.3g}")


def test_parity_bf16(case):
    name, cfg, hf, root = case
    g = np.array(GRIDS["mixed"])
    px = random_pixels(cfg, g, seed=7)
    enc = qvj.VisionEncoder.from_pretrained(root / "ours", dtype="bfloat16")
    cos, rel = assert_bf16_close(enc.encode(px, g), hf_image_features(hf, px, g))
    print(f"\n{name} mixed bf16: min cos {cos:.5f}, rel {rel:.3g}")


def test_converter_downsample_and_merger(case):
    name, cfg, hf, root = case
    _, params = hf_read.read_hf_vision_params(root / "hf")
    assert {k: v.shape for k, v in params.items()} == keys.expected_param_shapes(cfg)
    assert ("blocks.attn.qkv.bias" in params) == cfg.qkv_bias and "blocks.attn.proj.bias" not in params
    state = {k: v.numpy() for k, v in hf_tower(hf).state_dict().items()}
    w = state["downsample.weight"]  # [O, D, 2, 2]
    k = params["merger.downsample.kernel"]  # [4D, O]: row (i * 2 + j) * D + d
    for i in range(2):
        for j in range(2):
            np.testing.assert_array_equal(k[(2 * i + j) * cfg.width : (2 * i + j + 1) * cfg.width], w[:, :, i, j].T)
    np.testing.assert_array_equal(params["merger.mlp.gate.kernel"], state["merger.gate_proj.weight"].T)
    np.testing.assert_array_equal(params["patch_norm.scale"], state["post_conv_layernorm.weight"])


# ---- preprocessing ---------------------------------------------------------------------------------------
SIZES = [(300, 450), (20, 90), (90, 17), (3000, 4000), (112, 112), (56, 3000), (27, 27)]


@pytest.mark.parametrize("hw", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_preprocess_matches_hf_bit_for_bit(hw):
    from transformers import Glm4vImageProcessorPil

    img = make_image(*hw, seed=hw[1])
    pre = {k: v for k, v in HUB_PREPROCESSOR_GLM4V.items() if k != "image_processor_type"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = Glm4vImageProcessorPil(**pre)([img])
    px, grid = preprocess_glm4v_images([img], config=PreprocessConfig.from_hf(HUB_PREPROCESSOR_GLM4V))
    np.testing.assert_array_equal(grid, np.asarray(batch["image_grid_thw"]))
    np.testing.assert_array_equal(px, np.asarray(batch["pixel_values"]))
    assert PreprocessConfig.from_hf(HUB_PREPROCESSOR_GLM4V) == GLM4V_PREPROCESS


def test_encode_images_matches_processor_and_get_image_features(case, encoder):
    from transformers import Glm4vImageProcessorPil

    _, cfg, hf, _ = case
    images = [make_image(200, 300, seed=1), make_image(90, 40, seed=2)]
    assert encoder.preprocess == GLM4V_PREPROCESS  # read from the checkpoint's file
    pre = {k: v for k, v in HUB_PREPROCESSOR_GLM4V.items() if k != "image_processor_type"}
    assert_encode_images_equal_hf(encoder, hf, lambda: Glm4vImageProcessorPil(**pre), images)


@pytest.mark.parametrize("variant", ["glm-4v", "glm-4.5v"])
def test_demo_checkpoint_loads_in_transformers(variant, tmp_path):
    from qwen_vit_jax.tools.demo import VARIANTS, write_random_hf_checkpoint
    from qwen_vit_jax.tools.hf_reference import _hf_classes

    cfg = VARIANTS[variant]["tiny"]
    hf_dir = write_random_hf_checkpoint(cfg, tmp_path / "hf", seed=1)
    assert VisionConfig.from_hf(hf_dir) == cfg
    model, info = _hf_classes(cfg.hf_family)[3].from_pretrained(hf_dir, output_loading_info=True)
    assert not [k for k in info["missing_keys"] if "visual" in k] and not info["unexpected_keys"]
    assert_converted_equals_hf(model, hf_dir, cfg, tmp_path)


def test_ideal_flops_count_glms_merger(case, encoder):
    """256 patches of one frame fill their bucket and its attention tiles exactly: the compiled dots
    are the ideal ones, GLM's merger (downsample, proj, SwiGLU) included."""
    assert_compiled_dots_are_ideal(encoder)


@pytest.mark.slow
def test_parity_real_size(tmp_path):
    """The released GLM-4.1V tower (24 x 1536, a 24 x 24 table, out 4096, merger 13696) on one
    non-square image, fp32 and bf16, against get_image_features."""
    check_real_size(GLM, "glm-4.1v", tmp_path, [[1, 12, 20]], hf_image_features)
