"""Qwen3-VL / Qwen3.5 towers end to end vs transformers: HF model -> save_pretrained -> our
converter -> VisionEncoder.encode / the module, compared with HF's `visual(...)` outputs
(pooler_output and deepstack_features) at the float32 and bf16 bars of docs/numerics.md.

Grids cover an image smaller than the position table's side and one larger (down / up sampling),
a video and a mixed batch. Every HF parameter is re-initialised (norm weights != 1, biases != 0).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from hf_utils import assert_bf16_close, assert_encode_images_equal_hf, assert_fp32_close, random_pixels, rel
from sample_images import make_image
from towers import HUB_PREPROCESSOR_QWEN3_VL, assert_compiled_dots_are_ideal, check_real_size

import qwen_vit_jax as qvj
from qwen_vit_jax.families import QWEN3_5, QWEN3_VL
from qwen_vit_jax.plan.posembed import interpolation_indices_weights
from qwen_vit_jax.presets import QWEN2_5_VL_3B
from qwen_vit_jax.runtime import cost

CONFIGS = {"qwen3_vl": "q3", "qwen3_5": "q35"}  # -> the registry's towers (tests/towers.py)
GRIDS = {
    "small": [[1, 4, 4]],  # smaller than both table sides: downsampling
    "large": [[1, 10, 14]],  # larger than both: upsampling
    "video": [[3, 8, 6]],
    "mixed": [[1, 4, 4], [2, 8, 10], [1, 16, 12], [1, 2, 2], [1, 2, 18]],
}
HUB_PREPROCESSOR = HUB_PREPROCESSOR_QWEN3_VL  # the hub's file, in the towers' checkpoints


def hf_outputs(hf, px, grid, **kw):
    """HF's visual(...): (pooler_output, [deepstack features], output object), float32 numpy."""
    with torch.no_grad():
        out = hf.model.visual(
            torch.from_numpy(np.asarray(px, np.float32)), grid_thw=torch.from_numpy(np.asarray(grid, np.int64)), **kw
        )
    feats = [f.float().numpy() for f in (getattr(out, "deepstack_features", None) or [])]  # Qwen3.5: none
    return out.pooler_output.float().numpy(), feats, out


@pytest.fixture(scope="module", params=list(CONFIGS))
def tower(request, towers):
    return towers[CONFIGS[request.param]]


@pytest.fixture(scope="module")
def case(tower):
    """(cfg, HF model, converted dir holding the hub's preprocessor_config.json)."""
    return tower.cfg, tower.hf, tower.ours


@pytest.fixture(scope="module")
def encoder(tower):
    # The ladder only (the default): a repeated grid then runs the very same program (no tight bucket).
    return tower.encoder()


@pytest.mark.parametrize("grid", list(GRIDS))
def test_parity_fp32(case, encoder, grid):
    cfg, hf, _ = case
    grid_thw = np.array(GRIDS[grid])
    px = random_pixels(cfg, grid_thw, seed=3)
    ref, ref_feats, _ = hf_outputs(hf, px, grid_thw)
    tokens, feats = encoder.encode(px, grid_thw, return_deepstack=True)
    assert tokens.dtype == np.float32
    assert_fp32_close(tokens, ref)
    assert len(feats) == len(ref_feats) == cfg.num_deepstack
    for ours, want in zip(feats, ref_feats):
        assert ours.dtype == np.float32
        assert_fp32_close(ours, want)
    plain = encoder.encode(px, grid_thw)  # the same program: the same tokens
    np.testing.assert_array_equal(plain, tokens)


def test_module_hidden_states_and_deepstack(case):
    """model(px, plan, hidden_states=, deepstack=) composes; every state and feature vs HF."""
    cfg, hf, ours = case
    grid = np.array(GRIDS["mixed"])
    px = random_pixels(cfg, grid, seed=4)
    model = qvj.load_model(ours)
    (plan,) = qvj.make_plans(grid, cfg)
    assert plan.bucket.pos_embed_rows == plan.bucket.patches
    out, hidden, feats = jax.jit(lambda p, pl: model(p, pl, hidden_states=True, deepstack=True))(plan.take(px), plan)
    out_only = jax.jit(model)(plan.take(px), plan)
    out_ds, feats_ds = jax.jit(lambda p, pl: model(p, pl, deepstack=True))(plan.take(px), plan)
    assert isinstance(feats, list) and len(feats) == cfg.num_deepstack
    ref, ref_feats, hf_out = hf_outputs(hf, px, grid, output_hidden_states=True)
    assert_fp32_close(plan.unpad(np.asarray(out)), ref)
    for a in (out_only, out_ds):  # one scan or one per stretch between taps: the same values
        assert rel(plan.unpad(np.asarray(a)), plan.unpad(np.asarray(out))) <= 1e-6
    for f, g, want in zip(feats, feats_ds, ref_feats):
        assert_fp32_close(plan.unpad(np.asarray(f)), want)
        np.testing.assert_array_equal(np.asarray(f), np.asarray(g))
    hidden = plan.unpad(np.asarray(hidden))
    assert hidden.shape == (cfg.depth + 1, len(px), cfg.width)
    states = [s.numpy() for s in hf_out.hidden_states]
    if len(states) == cfg.depth:  # HF records block outputs only: compare those
        hidden = hidden[1:]
    assert len(states) == len(hidden)
    for layer, (a, b) in enumerate(zip(hidden, states)):
        assert rel(a, b) <= 1e-5, (layer, rel(a, b))


def test_padding_invariance(case, encoder):
    """An image's tokens and deepstack features do not depend on its companions or its bucket."""
    cfg, _, out = case
    img = np.array([[1, 10, 14]])
    px = random_pixels(cfg, img, seed=5)
    alone = encoder.encode(px, img, return_deepstack=True)
    companions = np.array([[2, 6, 8], [1, 10, 14], [1, 20, 4]])
    pxc = random_pixels(cfg, companions, seed=6)
    start = 2 * 6 * 8
    pxc[start : start + 140] = px
    rows = slice(start // 4, start // 4 + 35)
    tokens, feats = encoder.encode(pxc, companions, return_deepstack=True)
    together = tokens[rows], [f[rows] for f in feats]
    # a larger bucket (512 rows, not 256) cut into 128-row blocks, not one
    coarse = qvj.VisionEncoder.from_pretrained(out, policy=qvj.BucketPolicy(min_patches=512, frame_block=128))
    assert coarse.warmup([img])[0].patches == 512 and encoder.cost_report(img)["padded_patches"] < 512
    big = coarse.encode(px, img, return_deepstack=True)
    for other in (together, big):
        for a, b in zip([other[0], *other[1]], [alone[0], *alone[1]]):
            assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)


def test_parity_bf16(case):
    cfg, hf, out = case
    enc = qvj.VisionEncoder.from_pretrained(out, dtype="bfloat16")
    grid = np.array(GRIDS["mixed"])
    px = random_pixels(cfg, grid, seed=7)
    ref, ref_feats, _ = hf_outputs(hf, px, grid)
    tokens, feats = enc.encode(px, grid, return_deepstack=True)
    for ours, want in zip([tokens, *feats], [ref, *ref_feats], strict=True):  # tokens, then each tap's features
        assert_bf16_close(ours, want)


def test_encode_images_with_hub_preprocessor(case, encoder):
    """encode_images reads the checkpoint's preprocessor_config.json (the hub's Qwen3-VL file)
    and matches HF's processor configured from the same file, then HF's tower."""

    from transformers import Qwen2VLImageProcessorPil

    cfg, hf, _ = case
    assert (encoder.preprocess.patch_size, encoder.preprocess.min_pixels) == (16, 65536)
    images = [make_image(200, 300, seed=1), make_image(300, 260, seed=2)]  # one below min_pixels
    pre = {k: v for k, v in HUB_PREPROCESSOR.items() if k not in ("processor_class", "image_processor_type")}
    tower = lambda *a: hf_outputs(*a)[0]  # noqa: E731 (HF's visual: the pooled tokens)
    assert_encode_images_equal_hf(encoder, hf, lambda: Qwen2VLImageProcessorPil(**pre), images, tower)


def test_plan_carries_the_position_table_plan(case):
    cfg = case[0]
    grid = np.array(GRIDS["mixed"])
    (plan,) = qvj.make_plans(grid, cfg)
    n_pad = plan.bucket.patches
    idx, w = interpolation_indices_weights(grid, cfg, rows=n_pad)
    assert plan.pos_embed_index is idx and plan.pos_embed_weight is w  # one cache, no copy
    assert plan.pos_embed_index.shape == (n_pad, 4) and plan.pos_embed_weight.dtype == np.float32
    abstract = qvj.Plan.abstract(plan.bucket)
    assert jax.tree.structure(abstract) == jax.tree.structure(plan)
    for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(plan)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert qvj.make_plans(grid, cfg)[0] is plan  # cached by grid
    # Without a table: zero rows, the same tree structure.
    (old,) = qvj.make_plans([[1, 8, 8]], QWEN2_5_VL_3B)
    assert old.bucket.pos_embed_rows == 0 and old.pos_embed_index.shape == old.pos_embed_weight.shape == (0, 4)
    assert jax.tree.structure(qvj.Plan.abstract(old.bucket)) == jax.tree.structure(old)


def test_ideal_flops_counts_the_deepstack_mergers(case, encoder):
    """256 patches of one frame fill their bucket and its attention tiles exactly: the compiled
    dots are the ideal ones (the position gather is elementwise on both sides)."""
    cfg = case[0]
    assert_compiled_dots_are_ideal(encoder)
    plain = dataclasses.replace(cfg, variant=QWEN3_5, deepstack_layers=())
    merge = 2 * (4 * cfg.width) ** 2 + 2 * 4 * cfg.width * cfg.out_dim
    assert cost.ideal_flops(cfg, [256], []) - cost.ideal_flops(plain, [256], []) == pytest.approx(
        cfg.num_deepstack * 64 * merge, rel=1e-12
    )


@pytest.mark.slow
def test_parity_real_size_qwen3_vl(tmp_path):
    """The real Qwen3-VL tower (27 x 1152, head_dim 72, a 48 x 48 table, taps 8 / 16 / 24) on
    one image, fp32 and bf16, tokens and deepstack features."""
    grid = [[1, 12, 20]]  # non-square (a swapped h / w would show), 240 patches: CI time
    check_real_size(
        qvj.PRESETS["qwen3-vl-8b"], "qwen3-vl-8b", tmp_path, grid, lambda *a: hf_outputs(*a)[:2], deepstack=True
    )


@pytest.mark.parametrize("variant", [QWEN3_VL, QWEN3_5])
def test_demo_random_checkpoint_loads_in_transformers(variant, tmp_path):
    """demo.write_random_hf_checkpoint writes a Qwen3 tower HF itself loads: every vision key
    (deepstack mergers included) with HF's shapes, the config HF reads back as the same tower."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from qwen_vit_jax.tools.demo import TINY_QWEN3_VL, write_random_hf_checkpoint

    cfg = (
        TINY_QWEN3_VL
        if variant == QWEN3_VL
        else dataclasses.replace(TINY_QWEN3_VL, variant=QWEN3_5, deepstack_layers=())
    )
    hf_dir = write_random_hf_checkpoint(cfg, tmp_path / "hf", seed=1)
    assert qvj.VisionConfig.from_hf(hf_dir) == cfg
    assert AutoConfig.from_pretrained(hf_dir).model_type == {QWEN3_VL: "qwen3_vl", QWEN3_5: "qwen3_5"}[variant]
    model, info = AutoModelForImageTextToText.from_pretrained(hf_dir, output_loading_info=True)
    assert not [k for k in info["missing_keys"] if "visual" in k] and not info["unexpected_keys"]
    visual = model.model.visual
    assert len(getattr(visual, "deepstack_merger_list", [])) == cfg.num_deepstack
    qvj.convert_checkpoint(hf_dir, tmp_path / "ours")
    enc = qvj.VisionEncoder.from_pretrained(tmp_path / "ours")
    assert enc.preprocess.patch_size == 16 and enc.preprocess.image_mean == (0.5, 0.5, 0.5)
    grid = np.array([[1, 8, 12]])
    px = random_pixels(cfg, grid, seed=2)
    ref, ref_feats, _ = hf_outputs(model, px, grid)
    tokens, feats = enc.encode(px, grid, return_deepstack=True)
    for ours, want in zip([tokens, *feats], [ref, *ref_feats], strict=True):  # tokens, then each tap's features
        assert_fp32_close(ours, want)
