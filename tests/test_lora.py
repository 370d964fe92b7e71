"""LoRA (lora.py): stacked nnx.LoRA adapters on chosen projections of chosen blocks.

A fresh adapter changes nothing; a trained one equals its merge; with adapters attached, the base
tower's gradients still match torch autograd through HF's tower (loaded from our export, i.e. the
merged weights), and the adapters' own gradients are the chain rule of torch's kernel gradient
(dA = s G B^T, dB = s A^T G), zero in the blocks left out; an optimizer over nnx.LoRAParam moves
only the chosen adapters; export_hf merges before writing.
"""

from __future__ import annotations

import filecmp
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from hf_utils import flat_grads, hf_grads_through_converter, random_pixels, rel
from towers import Q2, Q25

import qwen_vit_jax as qvj
from qwen_vit_jax.model.lora import LoRA, merged_params
from qwen_vit_jax.model.vit import Linear

CONFIGS = {"q25": Q25, "q2": Q2}  # the registry's towers (tests/towers.py)
TARGETS = {"q25": ("qkv", "proj", "down"), "q2": ("qkv", "fc1")}
GRID = np.array([[2, 8, 12], [1, 6, 10]])  # a video and an image with edge windows


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, towers):
    """(name, cfg, HF model, HF checkpoint dir)."""
    tower = towers[request.param]
    return request.param, tower.cfg, tower.hf, tower.hf_dir


@functools.partial(jax.jit, static_argnums=(0, 4))
def _forward(graphdef, state, px, plan, remat):
    return nnx.merge(graphdef, state)(px, plan, remat=remat)


def run(model, px, grid, remat=False):
    """The tower on a request; one compile per model structure (graphdef), not per call."""
    graphdef, state = nnx.split(model)
    return np.concatenate(
        [
            plan.unpad(np.asarray(_forward(graphdef, state, plan.take(px), plan, remat)))
            for plan in qvj.make_plans(grid, model.cfg)
        ]
    )


def randomize_b(model, seed=0):
    """Give every adapter a non-zero lora_b (fresh ones are zero), as after training."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        if path[-1] == "lora_b":
            v = np.asarray(var.get_value())
            var.set_value(jnp.asarray(rng.standard_normal(v.shape).astype(np.float32) * 0.05))


def test_fresh_is_identity_and_merge_is_exact(case, tmp_path):
    name, cfg, _, hf_dir = case
    px = random_pixels(cfg, GRID, seed=1)
    model = qvj.load_model(hf_dir)
    base = run(model, px, GRID)
    qvj.add_lora(model, 4, targets=TARGETS[name], layers=[0, 2], alpha=8.0, rngs=nnx.Rngs(0))
    lora = model.blocks.attn.qkv
    assert isinstance(lora, nnx.LoRA) and isinstance(lora.base_module, Linear)
    assert lora.lora_a[...].shape == (cfg.depth, cfg.width, 4) and lora.lora_b[...].shape == (
        cfg.depth,
        4,
        3 * cfg.width,
    )
    np.testing.assert_array_equal(lora.scale[...], [2.0, 0, 2.0] + [0] * (cfg.depth - 3))
    np.testing.assert_array_equal(run(model, px, GRID), base)  # lora_b = 0: exactly the base tower

    randomize_b(model)
    with_lora = run(model, px, GRID)
    assert rel(with_lora, base) > 1e-3  # the adapters act
    assert rel(run(model, px, GRID, remat=True), with_lora) <= 1e-6
    merged = merged_params(model)  # export's view: the model is not changed
    assert isinstance(model.blocks.attn.qkv, LoRA)
    qvj.export_hf(model, tmp_path / "lora", like=hf_dir)

    qvj.merge_lora(model)
    assert type(model.blocks.attn.qkv) is Linear and not nnx.state(model, nnx.LoRAParam)
    assert rel(run(model, px, GRID), with_lora) <= 1e-5
    flat = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert flat.keys() == merged.keys()
    for k in flat:
        np.testing.assert_array_equal(flat[k], merged[k])
    qvj.export_hf(model, tmp_path / "merged", like=hf_dir)  # the same files as exporting with adapters
    names = [p.name for p in (tmp_path / "merged").iterdir()]
    assert filecmp.cmpfiles(tmp_path / "lora", tmp_path / "merged", names, shallow=False)[0] == names


def test_bf16_tower_takes_adapters(case):
    name, cfg, _, hf_dir = case
    if name != "q25":
        pytest.skip("one variant is enough: the adapter path does not depend on it")
    model = qvj.load_model(hf_dir, dtype="bfloat16")
    px = random_pixels(cfg, GRID, seed=1)
    base = run(model, px, GRID)
    qvj.add_lora(model, 2, targets=TARGETS[name], rngs=nnx.Rngs(1))
    np.testing.assert_array_equal(run(model, px, GRID), base)
    randomize_b(model)
    with_lora = run(model, px, GRID)
    qvj.merge_lora(model)
    assert model.blocks.attn.qkv.kernel[...].dtype == jnp.bfloat16
    assert rel(run(model, px, GRID), with_lora) <= 2e-2  # the merged kernel is rounded to bf16


@pytest.mark.parametrize("remat", [False, True])
def test_gradients_with_lora_match_torch(case, tmp_path, remat):
    from transformers import AutoModelForImageTextToText

    name, cfg, _, hf_dir = case
    if remat and name != "q25":
        pytest.skip("remat: one variant is enough")
    model = qvj.load_model(hf_dir)
    qvj.add_lora(model, 3, targets=TARGETS[name], layers=np.arange(cfg.depth) % 2 == 1, alpha=6.0, rngs=nnx.Rngs(2))
    randomize_b(model, seed=3)
    px = random_pixels(cfg, GRID, seed=2)
    weights = np.random.default_rng(3).standard_normal((len(px) // cfg.merge_unit, cfg.out_dim)).astype(np.float32)

    # torch autograd through HF's tower holding the merged weights (read back from our export)
    hf = AutoModelForImageTextToText.from_pretrained(qvj.export_hf(model, tmp_path / "hf", like=hf_dir)).float()
    hf.zero_grad()
    pv = torch.from_numpy(px).requires_grad_(True)
    out = hf.model.visual(pv, grid_thw=torch.from_numpy(GRID)).pooler_output
    (out * torch.from_numpy(weights)).sum().backward()
    ref_px, ref = pv.grad.numpy(), hf_grads_through_converter(hf, tmp_path)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    (plan,) = qvj.make_plans(GRID, cfg)

    @jax.jit
    def grads(params, pixels):
        def loss(params, pixels):
            y = nnx.merge(graphdef, params, rest)(pixels, plan, remat=remat)
            return jnp.sum(plan.unpad(y) * weights)

        return jax.grad(loss, argnums=(0, 1))(params, pixels)

    g_params, g_px = grads(params, plan.take(px))
    assert rel(np.asarray(g_px)[: plan.n_patches], ref_px) <= 1e-5
    mine = flat_grads(g_params)
    base = {k.replace(".base_module", ""): v for k, v in mine.items() if not k.endswith(("lora_a", "lora_b"))}
    assert base.keys() == ref.keys()
    errors = {k: rel(base[k], ref[k]) for k in base}
    assert max(errors.values()) <= 1e-4, errors

    # the adapters: dL/dA = s G B^T, dL/dB = s A^T G with G = dL/dkernel (torch's, our layout)
    for t in TARGETS[name]:
        sub = "attn" if t in ("qkv", "proj") else "mlp"
        lora = getattr(getattr(model.blocks, sub), t)
        a, b, s = (np.asarray(v[...], np.float64) for v in (lora.lora_a, lora.lora_b, lora.scale))
        g = ref[f"blocks.{sub}.{t}.kernel"].astype(np.float64)  # [L, in, out]
        want_a = s[:, None, None] * g @ b.transpose(0, 2, 1)
        want_b = s[:, None, None] * a.transpose(0, 2, 1) @ g
        got_a, got_b = mine[f"blocks.{sub}.{t}.lora_a"], mine[f"blocks.{sub}.{t}.lora_b"]
        assert not got_a[s == 0].any() and not got_b[s == 0].any()  # blocks left out: exactly zero
        assert rel(got_a, want_a) <= 1e-4 and rel(got_b, want_b) <= 1e-4, (t, rel(got_a, want_a), rel(got_b, want_b))


def test_optimizer_over_lora_params_moves_only_chosen_adapters(case):
    name, cfg, _, hf_dir = case
    model = qvj.load_model(hf_dir)
    qvj.add_lora(model, 2, targets=TARGETS[name][:1], layers=[1], rngs=nnx.Rngs(0))
    before = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    (plan,) = qvj.make_plans(GRID, cfg)
    px = plan.take(random_pixels(cfg, GRID, seed=5))

    @nnx.jit
    def step(model, opt):
        grads = nnx.grad(lambda m: jnp.mean(m(px, plan) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, grads)

    step(model, opt)
    after = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}
    changed = {".".join(map(str, k)) for k in before if not np.array_equal(before[k], after[k])}
    assert changed == {"blocks.attn.qkv.lora_b"}  # lora_b from zero; lora_a's grad is zero while b == 0
    b = after[("blocks", "attn", "qkv", "lora_b")]
    assert b[1].any() and not np.delete(b, 1, axis=0).any()


def test_bad_arguments_are_named(case):
    name, cfg, _, hf_dir = case
    model = qvj.load_model(hf_dir)
    other = "fc1" if name == "q25" else "gate"
    with pytest.raises(ValueError, match=rf"targets: \['{other}'\].*this tower has"):
        qvj.add_lora(model, 2, targets=[other], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rank"):
        qvj.add_lora(model, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=rf"in 0 \.\. {cfg.depth - 1}"):
        qvj.add_lora(model, 2, layers=[cfg.depth], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=f"needs {cfg.depth} entries"):
        qvj.add_lora(model, 2, layers=[True, False], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=f"needs {cfg.depth} entries"):
        qvj.add_lora(model, 2, layers=[0.5, 1.0], rngs=nnx.Rngs(0))
    qvj.add_lora(model, 2, targets=["proj"], layers=np.linspace(0, 1, cfg.depth), alpha=4.0, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(model.blocks.attn.proj.scale[...], 2.0 * np.linspace(0, 1, cfg.depth))
    qvj.add_lora(model, 2, targets=["qkv"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        qvj.add_lora(model, 2, targets=["qkv"], rngs=nnx.Rngs(0))
