"""The tower as a Flax module in the user's own jitted / differentiated code.

`load_model` + `make_plans` + `model(plan.take(pv), plan)` + `plan.unpad` vs `encode` and vs HF;
one compile per bucket; gradients (pixels and every parameter) vs torch autograd through HF's
tower, mapped through the converter's key table; hidden states vs HF's; `to_spatial`; segment
isolation of non-finite values. float32 tolerances are the project's (docs/numerics.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_utils import assert_fp32_close, flat_grads, hf_grads_through_converter, hf_visual, random_pixels, rel
from towers import Q2, Q25

import qwen_vit_jax as qvj
from qwen_vit_jax.families import QWEN2_5_VL
from qwen_vit_jax.model.numerics import Numerics
from qwen_vit_jax.model.vit import VisionTransformer, model_from_params
from qwen_vit_jax.preprocess.images import preprocess_images

CONFIGS = {"q25": Q25, "q2": Q2}  # the registry's towers (tests/towers.py)
VIDEO_AND_MIXED = np.array([[2, 10, 12], [1, 8, 8], [1, 2, 18]])  # a video, edge windows, a thin image


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, towers):
    """(cfg, HF model, converted dir)."""
    tower = towers[request.param]
    return tower.cfg, tower.hf, tower.ours


def run_plans(model, pv, grid, policy=None, **kw):
    """The user's loop: one jitted call per plan, unpadded on the host."""
    forward = jax.jit(lambda px, plan: model(px, plan, **kw))
    return np.concatenate(
        [plan.unpad(np.asarray(forward(plan.take(pv), plan))) for plan in qvj.make_plans(grid, model.cfg, policy)]
    )


def test_own_jit_matches_encode_and_hf(case):
    cfg, hf, ours = case
    model = qvj.load_model(ours)
    assert isinstance(model, VisionTransformer) and isinstance(model, nnx.Module) and model.cfg == cfg
    px = random_pixels(cfg, VIDEO_AND_MIXED, seed=1)
    mine = run_plans(model, px, VIDEO_AND_MIXED)
    enc = qvj.VisionEncoder.from_pretrained(ours)
    np.testing.assert_allclose(mine, enc.encode(px, VIDEO_AND_MIXED), rtol=0, atol=1e-6 * np.abs(mine).max())
    assert_fp32_close(mine, hf_visual(hf, px, VIDEO_AND_MIXED))
    # A request split into several plans (small budget): same rows, each plan its own span.
    policy = qvj.BucketPolicy(max_patches=128)
    plans = qvj.make_plans(VIDEO_AND_MIXED, cfg, policy)
    assert len(plans) > 1 and plans[0].offset == 0
    assert [p.offset for p in plans[1:]] == list(np.cumsum([p.n_patches for p in plans])[:-1])
    split = run_plans(model, px, VIDEO_AND_MIXED, policy)
    assert np.linalg.norm(split - mine) <= 1e-6 * np.linalg.norm(mine)


def test_one_compile_per_bucket():
    cfg = CONFIGS["q25"]
    model = VisionTransformer(cfg, rngs=nnx.Rngs(0))
    traces = []

    @jax.jit
    def f(px, plan):
        traces.append(plan.bucket)
        return model(px, plan)

    grids = [[[1, 8, 8]], [[1, 6, 10]], [[1, 4, 14]]]  # 64, 60, 56 patches: one bucket
    plans = [qvj.make_plans(g, cfg)[0] for g in grids]
    assert len({p.bucket for p in plans}) == 1
    outs = [f(plan.take(random_pixels(cfg, g)), plan) for g, plan in zip(grids, plans)]
    assert len(traces) == 1 and f._cache_size() == 1
    moved = f(plans[0].take(random_pixels(cfg, grids[0])), jax.device_put(plans[0]))  # device arrays
    assert len(traces) == 1
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(outs[0]))
    # The tree structure is the bucket alone; an abstract plan lowers the same program.
    assert jax.tree.structure(plans[1]) == jax.tree.structure(qvj.Plan.abstract(plans[1].bucket))
    moved = jax.device_put(plans[1])
    assert moved.n_patches == 60 and moved.offset == 0 and moved.grid_thw is None
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda px, plan: plan.unpad(px))(np.zeros((64, 4)), plans[1])


def test_unpad_and_take_check_their_inputs():
    cfg = CONFIGS["q2"]
    plan = qvj.make_plans([[1, 6, 10]], cfg)[0]
    with pytest.raises(ValueError, match="rows but the plan's request"):
        plan.take(np.zeros((59, cfg.patch_dim), np.float32))
    with pytest.raises(ValueError, match="unpad"):
        plan.unpad(np.zeros((7, 3)))
    assert plan.unpad(jnp.zeros((3, plan.bucket.patches, 5))).shape == (3, 60, 5)


@pytest.mark.parametrize("remat", [False, True])
def test_gradients_match_torch(case, tmp_path, remat):
    cfg, hf, ours = case
    grid = VIDEO_AND_MIXED
    px = random_pixels(cfg, grid, seed=2)
    weights = np.random.default_rng(3).standard_normal((len(px) // cfg.merge_unit, cfg.out_dim)).astype(np.float32)

    # torch autograd through HF's tower: loss = sum(pooler_output * weights)
    hf.zero_grad()
    pv = torch.from_numpy(px).requires_grad_(True)
    out = hf.model.visual(pv, grid_thw=torch.from_numpy(grid)).pooler_output
    (out * torch.from_numpy(weights)).sum().backward()
    ref_px, ref_params = pv.grad.numpy(), hf_grads_through_converter(hf, tmp_path)

    model = qvj.load_model(ours)
    graphdef, state = nnx.split(model)
    (plan,) = qvj.make_plans(grid, cfg)

    @jax.jit
    def grads(state, pixels):
        def loss(state, pixels):
            return jnp.sum(plan.unpad(nnx.merge(graphdef, state)(pixels, plan, remat=remat)) * weights)

        return jax.grad(loss, argnums=(0, 1))(state, pixels)

    g_state, g_px = grads(state, plan.take(px))
    g_px = np.asarray(g_px)
    assert not g_px[plan.n_patches :].any()  # padding rows: exactly zero
    assert rel(g_px[: plan.n_patches], ref_px) <= 1e-5
    mine = flat_grads(g_state)
    assert mine.keys() == ref_params.keys()
    errors = {k: rel(mine[k], ref_params[k]) for k in mine}
    worst = max(errors, key=errors.get)
    print(
        f"\n{cfg.variant} remat={remat}: d/dpixels rel {rel(g_px[: plan.n_patches], ref_px):.2e}, "
        f"worst param {worst} rel {errors[worst]:.2e}"
    )
    assert errors[worst] <= 1e-4, errors


def test_hidden_states_match_hf(case):
    cfg, hf, ours = case
    grid = VIDEO_AND_MIXED
    px = random_pixels(cfg, grid, seed=4)
    model = qvj.load_model(ours)
    (plan,) = qvj.make_plans(grid, cfg)
    out, hidden = jax.jit(lambda p, pl: model(p, pl, hidden_states=True))(plan.take(px), plan)
    hidden = plan.unpad(np.asarray(hidden))
    assert hidden.shape == (cfg.depth + 1, len(px), cfg.width)
    assert rel(plan.unpad(np.asarray(out)), plan.unpad(np.asarray(jax.jit(model)(plan.take(px), plan)))) <= 1e-6
    with torch.no_grad():
        ref = hf.model.visual(torch.from_numpy(px), grid_thw=torch.from_numpy(grid), output_hidden_states=True)
    states = [s.numpy() for s in ref.hidden_states]  # the input of block 0, then every block's output
    assert len(states) == cfg.depth + 1
    if cfg.variant == QWEN2_5_VL:  # HF's rows are merge units in window order: undo it
        index, _ = qvj.plan.window_index(grid, cfg)
        inverse = np.argsort(index)
        states = [s.reshape(-1, cfg.merge_unit, cfg.width)[inverse].reshape(-1, cfg.width) for s in states]
    for layer, (a, b) in enumerate(zip(hidden, states)):
        assert rel(a, b) <= 1e-5, (layer, rel(a, b))


def test_to_spatial_maps_rows_to_pixels():
    """Patch rows of a preprocessed image land on the pixels they were cut from."""
    cfg = CONFIGS["q25"]
    img = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)  # 4 x 6 patches, no resize
    pv, grid = preprocess_images([img, img[:, :56]])
    assert grid.tolist() == [[1, 4, 6], [1, 4, 4]]
    patches = qvj.to_spatial(pv, grid, cfg)
    assert [p.shape for p in patches] == [(1, 4, 6, cfg.patch_dim), (1, 4, 4, cfg.patch_dim)]
    p = cfg.patch_size
    mean, std = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])
    for y in range(4):
        for x in range(6):
            want = (img[y * p : (y + 1) * p, x * p : (x + 1) * p] / 255.0 - mean) / std  # [p, p, C]
            got = patches[0][0, y, x].reshape(cfg.in_channels, cfg.temporal_patch_size, p, p)[:, 0]  # [C, p, p]
            np.testing.assert_allclose(got, want.transpose(2, 0, 1), atol=1e-5)
    # Merged tokens: a token holds its 2 x 2 patches in merge-unit order, at the merged position.
    tokens = pv.reshape(-1, cfg.merge_unit * cfg.patch_dim)
    merged = qvj.to_spatial(jnp.asarray(tokens), grid, cfg)
    assert [t.shape for t in merged] == [(1, 2, 3, 4 * cfg.patch_dim), (1, 2, 2, 4 * cfg.patch_dim)]
    np.testing.assert_array_equal(np.asarray(merged[0])[0, 1, 2, : cfg.patch_dim], patches[0][0, 2, 4])
    np.testing.assert_array_equal(np.asarray(merged[0])[0, 1, 2, -cfg.patch_dim :], patches[0][0, 3, 5])
    with pytest.raises(ValueError, match="rows"):
        qvj.to_spatial(pv[:-1], grid, cfg)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tile_loops", [True, False])
def test_non_finite_input_never_reaches_other_images(name, tile_loops):
    """A NaN / Inf in one image: the other images' rows equal those of a clean run, bit for bit,
    in window and full attention, both attention schedules (straight through the module)."""
    cfg = CONFIGS[name]
    model = VisionTransformer(cfg, Numerics(tile_loops=tile_loops), rngs=nnx.Rngs(0))
    grid = np.array([[1, 8, 12], [1, 2, 4], [2, 8, 8]])
    px = random_pixels(cfg, grid, seed=5)
    (plan,) = qvj.make_plans(grid, cfg)
    forward = jax.jit(model.__call__)
    clean = plan.unpad(np.asarray(forward(plan.take(px), plan)))
    bad = px.copy()
    bad[3, 7], bad[50, 0] = np.nan, np.inf  # image 0
    out = plan.unpad(np.asarray(forward(plan.take(bad), plan)))
    first = 8 * 12 // cfg.merge_unit
    assert not np.isfinite(out[:first]).all()  # the bad image stays visibly bad
    np.testing.assert_array_equal(out[first:], clean[first:])


def test_encode_rejects_non_finite_pixels(case):
    cfg, _, ours = case
    enc = qvj.VisionEncoder.from_pretrained(ours, tight_after=None)  # every call in the same bucket
    grid = np.array([[1, 8, 8], [2, 4, 6]])
    px = random_pixels(cfg, grid, seed=6)
    clean = enc.encode(px, grid)
    px[64 + 30, 5] = np.inf
    with pytest.raises(ValueError, match=r"image 1 .*its row 30 \(pixel_values row 94\) has inf"):
        enc.encode(px, grid)
    out = enc.encode(px, grid, check_finite=False)  # isolation still holds
    np.testing.assert_array_equal(out[:16], clean[:16])
    px[64 + 30, 5], px[3, 1000] = 0.0, np.nan
    with pytest.raises(ValueError, match=r"image 0 .*its row 3 \(pixel_values row 3\) has nan; 1 bad row"):
        enc.encode(px, grid)


def test_model_from_params_checks_every_parameter():
    cfg = CONFIGS["q2"]
    _, params = nnx.split(VisionTransformer(cfg, rngs=nnx.Rngs(0)))
    flat = flat_grads(params)
    model = model_from_params(cfg, flat)
    assert model.cfg == cfg
    with pytest.raises(ValueError, match="missing"):
        model_from_params(cfg, {k: v for k, v in flat.items() if k != "merger.fc1.bias"})
