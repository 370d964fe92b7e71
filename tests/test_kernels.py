"""The platforms' attention kernels (attention_gpu: Pallas Triton; attention_tpu: splash), run on
this CPU through Pallas' interpreter: each equals its plain-JAX reference, and the tower built on
it equals HF at the float32 and bfloat16 bars (the same bars as the XLA schedules)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_utils import assert_bf16_close, assert_fp32_close, hf_visual, random_pixels

import qwen_vit_jax as qvj
from qwen_vit_jax.model import attention_gpu, attention_tpu
from qwen_vit_jax.presets import QWEN2_5_VL_3B

KERNELS = {"triton": attention_gpu.tile_attention, "splash": attention_tpu.tile_attention}


def _problem(seed: int, dtype):
    """Three query tiles of 20 rows (not a block multiple) against 40-key windows starting at odd
    rows of 96 shared keys: segments 0..3 of uneven length, a tile row that attends to nothing."""
    rng = np.random.default_rng(seed)
    t, bq, h, dh, m, k_rows = 3, 20, 2, 24, 96, 40
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((t, bq, h, dh), (m, h, dh), (m, h, dh)))
    k_seg = np.repeat(np.arange(4), [30, 25, 31, 10]).astype(np.int32)
    k_start = np.array([0, 27, 56], np.int32)
    q_seg = np.stack([np.full(bq, s, np.int32) for s in (0, 1, 2)])
    q_seg[1, 5:] = 2  # a tile over two segments, both inside its window
    q_seg[2, -1] = attention_gpu.NO_KEY
    return [jnp.asarray(x).astype(dtype) for x in (q, k, v)] + [jnp.asarray(x) for x in (q_seg, k_seg, k_start)], k_rows


@pytest.mark.parametrize("kernel", KERNELS)
def test_tile_attention_equals_its_reference(kernel):
    args, k_rows = _problem(0, jnp.float32)
    ref = np.asarray(attention_gpu.reference(*args, k_rows))
    got = np.asarray(KERNELS[kernel](*args, k_rows, interpret=True))
    assert got.shape == ref.shape == (3, 20, 2, 24)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert (got[2, -1] == 0).all()  # no valid key: exactly zero


@pytest.fixture(scope="module")
def tower(towers):
    """The registry's tiny Qwen2.5-VL (window and full layers), converted; a mixed request."""
    tower = towers["q25"]
    grid = np.array([[1, 8, 8], [2, 10, 14], [1, 2, 40]])  # edge windows, a video, a thin image
    px = random_pixels(tower.cfg, grid, seed=12)
    return tower.ours, px, grid, hf_visual(tower.hf, px, grid)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_tower_on_the_kernel_equals_hf(tower, kernel, dtype):
    platform = jax.devices()[0].platform
    if platform != "cpu" and kernel != {"gpu": "triton", "tpu": "splash"}.get(platform):
        pytest.skip(f"{kernel} compiles for its own platform only (on {platform}: interpreted, in the test above)")
    path, px, grid, ref = tower
    enc = qvj.VisionEncoder.from_pretrained(path, dtype=dtype, attention=kernel, tight_after=None)
    assert enc.num.attention == kernel and enc.num.interpret == (enc.device.platform == "cpu")
    out = enc.encode(px, grid)
    (assert_fp32_close if dtype == "float32" else assert_bf16_close)(out, ref)


def test_kernel_choice_is_checked():
    with pytest.raises(ValueError, match="attention"):
        qvj.VisionEncoder(QWEN2_5_VL_3B, {}, attention="flash")
    with pytest.raises(ValueError, match="no attention kernel"):
        qvj.abstract_model(QWEN2_5_VL_3B, platform="cpu", attention="kernel")


def test_mlp_width_padding_changes_nothing(tower):
    """The TPU's numerics store the MLP's hidden width rounded up to 128 (96 -> 128 here) with zero
    rows / columns: the same tokens (within float32 summation order) and still HF's."""
    from flax import nnx

    from qwen_vit_jax.model.numerics import Numerics
    from qwen_vit_jax.model.vit import model_from_params
    from qwen_vit_jax.weights.convert import load_converted

    path, px, grid, ref = tower
    cfg, params, _ = load_converted(path)
    (plan,) = qvj.make_plans(grid, cfg)
    outs = []
    for multiple in (1, 128):
        model = model_from_params(cfg, params, Numerics(tile_loops=True, mlp_multiple=multiple))
        assert nnx.state(model)["blocks"]["mlp"]["down"]["kernel"].shape == (4, multiple * -(-96 // multiple), 64)
        outs.append(np.asarray(plan.unpad(model(plan.take(px), plan))))
    assert_fp32_close(outs[1], ref)
    assert np.linalg.norm(outs[1] - outs[0]) <= 1e-6 * np.linalg.norm(outs[0])
