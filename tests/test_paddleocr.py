"""PaddleOCR-VL vs transformers: the config, the host plans (the table's align_corners=False
resampling, the raster -> merge-unit row order) against HF's own index code, exactly; the tower
plus projector against HF's `get_image_features` at the float32 and bf16 bars; the image processor
bit for bit; the converter's key table (q / k / v fused, the projector beside the tower).

Images only: PaddleOCR-VL's tower takes no video (a grid with t > 1 is refused).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from hf_utils import assert_bf16_close, assert_encode_images_equal_hf, assert_fp32_close, random_pixels
from PIL import Image
from sample_images import make_image
from towers import PADDLE_TINY, assert_compiled_dots_are_ideal, check_real_size
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

import qwen_vit_jax as qvj
from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.plan import raster_to_merge_order
from qwen_vit_jax.plan.posembed import interpolation_indices_weights
from qwen_vit_jax.preprocess.config import PADDLEOCR_PREPROCESS, PreprocessConfig
from qwen_vit_jax.preprocess.images import preprocess_paddleocr_images
from qwen_vit_jax.presets import PRESETS
from qwen_vit_jax.tools.demo import HUB_PREPROCESSOR_PADDLEOCR
from qwen_vit_jax.tools.hf_reference import hf_config, hf_image_features, hf_tower
from qwen_vit_jax.weights import hf_read, keys
from qwen_vit_jax.weights.safetensors_io import CheckpointError

PADDLE = PRESETS["paddleocr-vl"]
TINY = PADDLE_TINY  # tests/towers.py: head_dim 16, a 6 x 6 table (image_size 84 / patch 14), 3 blocks
GRIDS = {
    "image": [[1, 10, 14]],  # larger than the table: upsampling
    "mixed": [[1, 4, 4], [1, 16, 12], [1, 2, 2], [1, 2, 18], [1, 6, 6]],  # down, up and equal sides
}


@pytest.fixture(scope="module")
def case(towers):
    """(HF full model, root with hf/ (HF's preprocessor defaults) and ours/): the registry's tower."""
    tower = towers["paddleocr_vl"]
    return tower.hf, tower.ours.parent


@pytest.fixture(scope="module")
def encoder(towers):
    return towers["paddleocr_vl"].encoder()


# ---- config ------------------------------------------------------------------------------------------
def test_config_from_hf():
    from transformers import PaddleOCRVLConfig

    hf_default = PaddleOCRVLConfig().to_dict()  # HF's defaults: the released tower, its text width
    assert VisionConfig.from_hf(hf_default) == dataclasses.replace(
        PADDLE, out_dim=hf_default["text_config"]["hidden_size"]
    )
    hub = {"model_type": "paddleocr_vl", "hidden_size": 1024, "vision_config": hf_default["vision_config"]}
    assert VisionConfig.from_hf(hub) == PADDLE  # the hub's flat layout: text fields at the top
    assert VisionConfig.from_hf(hf_config(PADDLE)) == PADDLE
    c = PADDLE
    assert (c.patch_dim, c.pos_embed_side, c.head_dim, c.merger_norm_eps, c.norm_eps) == (588, 27, 72, 1e-5, 1e-6)
    assert c.post_norm and c.raster_rows and c.images_only and not c.pos_embed_align_corners
    with pytest.raises(ValueError, match="text model"):
        VisionConfig.from_hf({"model_type": "paddleocr_vl", "vision_config": {"hidden_size": 64}})
    with pytest.raises(ValueError, match="temporal_patch_size must be 1"):
        dataclasses.replace(PADDLE, temporal_patch_size=2)
    with pytest.raises(ValueError, match="no deepstack"):
        dataclasses.replace(PADDLE, deepstack_layers=(1,))


# ---- host plans vs HF's index code ----------------------------------------------------------------------
@pytest.mark.parametrize("side", [1, 5, 6, 27])
@pytest.mark.parametrize(
    "grid", [[[1, 2, 2]], [[1, 4, 6]], [[1, 28, 26]], [[1, 60, 40]], [[1, 10, 8], [1, 54, 54], [1, 2, 34]]]
)
def test_interpolation_matches_hf(grid, side):
    """align_corners=False (half-pixel centres; first taps that clamp from -1 to 0), in merge-unit
    order: indices equal, weights bit-identical to HF's helper."""
    cfg = dataclasses.replace(TINY, num_position_embeddings=side * side)
    idx, w = interpolation_indices_weights(grid, cfg)
    ref_idx, ref_w = get_vision_interpolation_indices_and_weights(
        torch.tensor(grid), side, mode="bilinear", align_corners=False, spatial_merge_size=2
    )
    np.testing.assert_array_equal(idx, ref_idx.numpy())
    np.testing.assert_array_equal(w, ref_w.numpy())
    # the same taps as HF's raster-order call, reordered by the row permutation the encoder applies
    raster_idx, raster_w = get_vision_interpolation_indices_and_weights(
        torch.tensor(grid), side, mode="bilinear", align_corners=False, spatial_merge_size=1
    )
    order = raster_to_merge_order(np.array(grid), 2)
    np.testing.assert_array_equal(idx, raster_idx.numpy()[order])
    np.testing.assert_array_equal(w, raster_w.numpy()[order])


def test_raster_to_merge_order_is_hfs_projector_order():
    """HF's projector reshapes each image's raster rows [t, h/2, 2, w/2, 2, D] -> [t * h/2 * w/2, 4 * D]:
    our order lists the same rows in the same order."""
    grid = np.array([[1, 4, 6], [1, 2, 2], [1, 8, 10]])
    order = raster_to_merge_order(grid, 2)
    want, start = [], 0
    for t, h, w in grid.tolist():
        rows = torch.arange(start, start + t * h * w).reshape(t, h // 2, 2, w // 2, 2).transpose(2, 3)
        want.append(rows.reshape(-1).numpy())
        start += t * h * w
    np.testing.assert_array_equal(order, np.concatenate(want))
    assert sorted(order.tolist()) == list(range(start))


def test_video_is_refused(encoder):
    with pytest.raises(ValueError, match="images only"):
        encoder.encode(random_pixels(TINY, [[2, 4, 4]]), [[2, 4, 4]])


# ---- the tower + projector vs get_image_features ----------------------------------------------------------
@pytest.mark.parametrize("grid", list(GRIDS))
def test_parity_fp32(case, encoder, grid):
    hf, _ = case
    g = np.array(GRIDS[grid])
    px = random_pixels(TINY, g, seed=3)
    rel, max_rel = assert_fp32_close(encoder.encode(px, g), hf_image_features(hf, px, g))
    print(f"\npaddleocr_vl {grid} fp32: rel {rel:.3g}, max abs / max|ref| {max_rel:.3g}")


def test_parity_bf16(case):
    hf, root = case
    g = np.array(GRIDS["mixed"])
    px = random_pixels(TINY, g, seed=7)
    enc = qvj.VisionEncoder.from_pretrained(root / "ours", dtype="bfloat16")
    cos, rel = assert_bf16_close(enc.encode(px, g), hf_image_features(hf, px, g))
    print(f"\npaddleocr_vl mixed bf16: min cos {cos:.5f}, rel {rel:.3g}")


def test_module_with_the_row_order(case):
    """The Flax module takes merge-unit rows: a user reorders with raster_to_merge_order."""
    import jax

    hf, root = case
    g = np.array(GRIDS["mixed"])
    px = random_pixels(TINY, g, seed=4)
    model = qvj.load_model(root / "ours")
    (plan,) = qvj.make_plans(g, TINY)
    out = jax.jit(model)(plan.take(px[raster_to_merge_order(g, 2)]), plan)
    assert_fp32_close(plan.unpad(np.asarray(out)), hf_image_features(hf, px, g))


# ---- preprocessing ---------------------------------------------------------------------------------------
def hf_processor(pre: dict):
    from transformers import PaddleOCRVLImageProcessorPil

    return PaddleOCRVLImageProcessorPil(**{k: v for k, v in pre.items() if k != "image_processor_type"})


SIZES = [(300, 450), (20, 90), (90, 17), (1000, 1700), (384, 384), (27, 27), (56, 3000)]


@pytest.mark.parametrize("hw", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_preprocess_matches_hf_bit_for_bit(hw):
    """Sizes below the factor on either side (HF stretches them first), above max_pixels, at
    min_pixels, a long strip; an RGBA image too."""
    img = make_image(*hw, seed=hw[0])
    if hw == (27, 27):
        img = img.convert("RGBA")
        img.putalpha(Image.fromarray(np.full(hw, 128, np.uint8)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = hf_processor(HUB_PREPROCESSOR_PADDLEOCR)([img])
    px, grid = preprocess_paddleocr_images([img], config=PreprocessConfig.from_hf(HUB_PREPROCESSOR_PADDLEOCR))
    ref = np.asarray(batch["pixel_values"])
    np.testing.assert_array_equal(grid, np.asarray(batch["image_grid_thw"]))
    assert ref.shape == (len(px), 3, 14, 14)
    np.testing.assert_array_equal(px, ref.reshape(len(ref), -1))
    assert PreprocessConfig.from_hf(HUB_PREPROCESSOR_PADDLEOCR) == PADDLEOCR_PREPROCESS


def test_encode_images_matches_processor_and_get_image_features(case, encoder):
    hf, _ = case
    images = [make_image(200, 300, seed=1), make_image(90, 40, seed=2)]
    assert encoder.preprocess == PADDLEOCR_PREPROCESS  # read from the checkpoint's file
    assert_encode_images_equal_hf(encoder, hf, lambda: hf_processor(HUB_PREPROCESSOR_PADDLEOCR), images)


# ---- converter --------------------------------------------------------------------------------------------
def test_converter_fuses_qkv_and_reads_the_projector(case, tmp_path):
    hf, root = case
    _, params = hf_read.read_hf_vision_params(root / "hf")
    assert {k: v.shape for k, v in params.items()} == keys.expected_param_shapes(TINY)
    state = {k: v.numpy() for k, v in hf_tower(hf).state_dict().items()}
    pre = "vision_model.encoder.layers"
    for i in range(TINY.depth):
        fused = np.concatenate([state[f"{pre}.{i}.self_attn.{n}_proj.weight"] for n in "qkv"]).T
        np.testing.assert_array_equal(params["blocks.attn.qkv.kernel"][i], fused)
    proj = {k: v.numpy() for k, v in hf.model.projector.state_dict().items()}
    np.testing.assert_array_equal(params["merger.norm.bias"], proj["pre_norm.bias"])
    np.testing.assert_array_equal(params["merger.fc2.kernel"], proj["linear_2.weight"].T)
    np.testing.assert_array_equal(params["post_norm.scale"], state["vision_model.post_layernorm.weight"])

    # transformers 5.x's in-memory name of the projector is accepted; both names at once are not
    from qwen_vit_jax.weights.safetensors_io import read_safetensors, write_safetensors

    tensors = dict(read_safetensors(root / "hf" / "model.safetensors"))
    renamed = {
        ("model.projector." + k[len("mlp_AR.") :] if k.startswith("mlp_AR.") else k): v for k, v in tensors.items()
    }
    for name, t in [("renamed", renamed), ("both", renamed | tensors)]:
        d = tmp_path / name
        d.mkdir()
        write_safetensors(d / "model.safetensors", t, {"format": "pt"})
        (d / "config.json").write_text((root / "hf" / "config.json").read_text())
        if name == "renamed":
            _, again = hf_read.read_hf_vision_params(d)
            assert all(np.array_equal(again[k], params[k]) for k in params)
        else:
            with pytest.raises(CheckpointError, match="which is the projector"):
                hf_read.read_hf_vision_params(d)


def test_demo_checkpoint_loads_in_transformers(tmp_path):
    from transformers import PaddleOCRVLForConditionalGeneration

    from qwen_vit_jax.tools.demo import VARIANTS, write_random_hf_checkpoint

    cfg = VARIANTS["paddleocr-vl"]["tiny"]
    hf_dir = write_random_hf_checkpoint(cfg, tmp_path / "hf", seed=1)
    assert VisionConfig.from_hf(hf_dir) == cfg
    model, info = PaddleOCRVLForConditionalGeneration.from_pretrained(hf_dir, output_loading_info=True)
    vision = ("visual", "projector")
    assert not [k for k in info["missing_keys"] if any(v in k for v in vision)] and not info["unexpected_keys"]
    qvj.convert_checkpoint(hf_dir, tmp_path / "ours")
    g = np.array([[1, 8, 12]])
    px = random_pixels(cfg, g, seed=2)
    tokens = qvj.VisionEncoder.from_pretrained(tmp_path / "ours").encode(px, g)
    assert_fp32_close(tokens, hf_image_features(model.eval(), px, g))


def test_ideal_flops(encoder):
    """The post-norm and the projector add no dots beyond the merger's: ideal == compiled."""
    assert_compiled_dots_are_ideal(encoder)


@pytest.mark.slow
def test_parity_real_size(tmp_path):
    """The released PaddleOCR-VL tower and projector (27 x 1152, a 27 x 27 table, out 1024) on one
    non-square image, fp32 and bf16, against get_image_features."""
    check_real_size(PADDLE, "paddleocr-vl", tmp_path, [[1, 12, 20]], hf_image_features)
