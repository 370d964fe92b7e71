"""End-to-end parity vs HF transformers: HF model -> save_pretrained -> our converter ->
VisionEncoder.encode, compared with HF's `visual(...).pooler_output`.

Every HF parameter is re-initialised (norm weights != 1, biases != 0), so a dropped bias or
norm fails. Tolerances are those of docs/numerics.md and are never loosened here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hf_utils import (
    assert_bf16_close,
    assert_fp32_close,
    build_hf_model,
    hf_visual,
    random_pixels,
)

import qwen_vit_jax as qvj
from qwen_vit_jax.presets import QWEN2_5_VL_3B, QWEN2_VL_2B

TINY = {
    # Qwen2.5-VL: window layers + full layers, head_dim 16 and 32.
    "q25-hd16": dataclasses.replace(
        QWEN2_5_VL_3B, depth=4, width=64, num_heads=4, intermediate_size=96, out_dim=48, fullatt_block_indexes=(1, 3)
    ),
    "q25-hd32": dataclasses.replace(
        QWEN2_5_VL_3B, depth=4, width=128, num_heads=4, intermediate_size=176, out_dim=64, fullatt_block_indexes=(2,)
    ),
    # Qwen2-VL: LayerNorm + quick_gelu MLP, full attention everywhere.
    "q2-hd16": dataclasses.replace(QWEN2_VL_2B, depth=4, width=64, num_heads=4, intermediate_size=256, out_dim=48),
    "q2-hd32": dataclasses.replace(QWEN2_VL_2B, depth=4, width=128, num_heads=4, intermediate_size=512, out_dim=64),
}

GRIDS = {
    "edge-windows": [[1, 10, 14]],  # 5x7 merge units: partial windows on both sides
    "even-windows": [[1, 16, 16]],  # side divides by the window: HF's empty-window path
    "video": [[3, 12, 20]],
    "mixed": [[1, 8, 8], [2, 10, 14], [1, 36, 36], [1, 2, 2], [1, 2, 40]],
}


@pytest.fixture(scope="module", params=list(TINY))
def tiny_case(request, tmp_path_factory):
    """(cfg, HF model, converted dir). One case is saved sharded to exercise the index path."""
    name = request.param
    cfg = TINY[name]
    hf = build_hf_model(cfg, seed=len(name))
    root = tmp_path_factory.mktemp(name)
    hf.save_pretrained(root / "hf", max_shard_size="200KB" if name == "q25-hd32" else "10GB")
    if name == "q25-hd32":
        assert (root / "hf" / "model.safetensors.index.json").exists()
    qvj.convert_checkpoint(root / "hf", root / "ours")
    assert qvj.VisionConfig.from_hf(root / "hf") == cfg
    return cfg, hf, root / "ours"


@pytest.fixture(scope="module")
def tiny_encoder(tiny_case):
    return qvj.VisionEncoder.from_pretrained(tiny_case[2], dtype="float32")


@pytest.mark.parametrize("grid", list(GRIDS))
def test_parity_fp32(tiny_case, tiny_encoder, grid):
    cfg, hf, _ = tiny_case
    grid_thw = np.array(GRIDS[grid])
    px = random_pixels(cfg, grid_thw, seed=3)
    ref = hf_visual(hf, px, grid_thw)
    ours = tiny_encoder.encode(px, grid_thw)
    assert ours.dtype == np.float32
    assert_fp32_close(ours, ref)


def test_parity_bf16(tiny_case):
    cfg, hf, out = tiny_case
    enc = qvj.VisionEncoder.from_pretrained(out, dtype="bfloat16")
    grid_thw = np.array(GRIDS["mixed"])
    px = random_pixels(cfg, grid_thw, seed=4)
    assert_bf16_close(enc.encode(px, grid_thw), hf_visual(hf, px, grid_thw))


def test_padding_invariance(tiny_case, tiny_encoder):
    """An image's embedding does not depend on its companions or on the bucket."""
    cfg, _, out = tiny_case
    img = np.array([[1, 10, 14]])
    px = random_pixels(cfg, img, seed=5)
    alone = tiny_encoder.encode(px, img)
    companions = np.array([[2, 6, 8], [1, 10, 14], [1, 20, 4]])
    pxc = random_pixels(cfg, companions, seed=6)
    start = 2 * 6 * 8
    pxc[start : start + 140] = px
    together = tiny_encoder.encode(pxc, companions)[start // 4 : start // 4 + 35]
    # a larger bucket (512 rows, not 256) cut into 128-row blocks, not one
    coarse = qvj.VisionEncoder.from_pretrained(out, policy=qvj.BucketPolicy(min_patches=512, frame_block=128))
    big = coarse.encode(px, img)
    assert coarse.warmup([img])[0].patches == 512 and tiny_encoder.cost_report(img)["padded_patches"] < 512
    for other in (together, big):
        assert np.linalg.norm(other - alone) <= 1e-6 * np.linalg.norm(alone)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen2.5-vl-3b", "qwen2-vl-2b"])
def test_parity_real_size(preset, tmp_path):
    """The real tower width/depth/heads (head_dim 80), one small image with edge windows."""
    cfg = qvj.PRESETS[preset]
    hf = build_hf_model(cfg, seed=7)
    hf.save_pretrained(tmp_path / "hf")
    grid_thw = np.array([[1, 20, 28]])
    px = random_pixels(cfg, grid_thw, seed=8)
    ref = hf_visual(hf, px, grid_thw)
    del hf
    enc = qvj.VisionEncoder.from_pretrained(tmp_path / "hf", dtype="float32")
    rel, rel_max = assert_fp32_close(enc.encode(px, grid_thw), ref)
    print(f"\n{preset} fp32: rel Frobenius {rel:.3g}, max abs / max|ref| {rel_max:.3g}")
    del enc
    enc16 = qvj.VisionEncoder.from_pretrained(tmp_path / "hf", dtype="bfloat16")
    cos, rel16 = assert_bf16_close(enc16.encode(px, grid_thw), ref)
    print(f"{preset} bf16: min token cosine {cos:.5f}, rel {rel16:.3g}")
