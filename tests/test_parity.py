"""End-to-end parity vs HF transformers: HF model -> save_pretrained -> our converter ->
VisionEncoder.encode, compared with HF's `visual(...).pooler_output`.

Every HF parameter is re-initialised (norm weights != 1, biases != 0), so a dropped bias or
norm fails. Tolerances are those of docs/numerics.md and are never loosened here.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_utils import assert_bf16_close, assert_fp32_close, hf_visual, random_pixels
from towers import check_real_size

import qwen_vit_jax as qvj

# The registry's towers (tests/towers.py): Qwen2.5-VL (window + full layers) and Qwen2-VL (LayerNorm
# + quick_gelu, full attention everywhere), head_dim 16 and 32; q25-hd32 is saved sharded.
TINY = {"q25-hd16": "q25", "q25-hd32": "q25-hd32", "q2-hd16": "q2", "q2-hd32": "q2-hd32"}  # id -> tower
GRIDS = {
    "edge-windows": [[1, 10, 14]],  # 5x7 merge units: partial windows on both sides
    "even-windows": [[1, 16, 16]],  # side divides by the window: HF's empty-window path
    "video": [[3, 12, 20]],
    "mixed": [[1, 8, 8], [2, 10, 14], [1, 36, 36], [1, 2, 2], [1, 2, 40]],
}


@pytest.fixture(scope="module", params=list(TINY))
def tower(request, towers):
    tower = towers[TINY[request.param]]
    if request.param == "q25-hd32":
        assert (tower.hf_dir / "model.safetensors.index.json").exists()
    return tower


@pytest.mark.parametrize("grid", list(GRIDS))
def test_parity_fp32(tower, grid):
    grid_thw = np.array(GRIDS[grid])
    px = random_pixels(tower.cfg, grid_thw, seed=3)
    ref = hf_visual(tower.hf, px, grid_thw)
    ours = tower.encoder().encode(px, grid_thw)
    assert ours.dtype == np.float32
    assert_fp32_close(ours, ref)


def test_parity_bf16(tower):
    grid_thw = np.array(GRIDS["mixed"])
    px = random_pixels(tower.cfg, grid_thw, seed=4)
    assert_bf16_close(tower.encoder("bfloat16").encode(px, grid_thw), hf_visual(tower.hf, px, grid_thw))


def test_padding_invariance(tower):
    """An image's embedding does not depend on its companions or on the bucket."""
    cfg, enc = tower.cfg, tower.encoder()
    img = np.array([[1, 10, 14]])
    px = random_pixels(cfg, img, seed=5)
    alone = enc.encode(px, img)
    companions = np.array([[2, 6, 8], [1, 10, 14], [1, 20, 4]])
    pxc = random_pixels(cfg, companions, seed=6)
    start = 2 * 6 * 8
    pxc[start : start + 140] = px
    together = enc.encode(pxc, companions)[start // 4 : start // 4 + 35]
    # a larger bucket (512 rows, not 256) cut into 128-row blocks, not one
    coarse = qvj.VisionEncoder.from_pretrained(tower.ours, policy=qvj.BucketPolicy(min_patches=512, frame_block=128))
    big = coarse.encode(px, img)
    assert coarse.warmup([img])[0].patches == 512 and enc.cost_report(img)["padded_patches"] < 512
    for other in (together, big):
        assert np.linalg.norm(other - alone) <= 1e-6 * np.linalg.norm(alone)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen2.5-vl-3b", "qwen2-vl-2b"])
def test_parity_real_size(preset, tmp_path):
    """The real tower width/depth/heads (head_dim 80), one small image with edge windows."""
    check_real_size(qvj.PRESETS[preset], preset, tmp_path, [[1, 20, 28]], hf_visual)
