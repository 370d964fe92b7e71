"""Component parity vs HF's torch modules, float32, at the docs/numerics.md bar: rotary tables, both
norms, one window-attention block, one full-attention block, the merger. The end-to-end parity
tests (test_parity.py) say that the tower is off; these say which part.

Weights: HF's tower re-initialised (`hf_reference.build_hf_model`), copied into our modules through
the converter's key table (`convert.RULES`), exactly as a checkpoint is converted.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_utils import assert_fp32_close, build_hf_model
from transformers import vision_utils as hf_index

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.model.vit import model_from_params, rotary_cos_sin
from qwen_vit_jax.plan import make_plan, rotary_ids
from qwen_vit_jax.presets import QWEN2_5_VL_3B, QWEN2_VL_2B
from qwen_vit_jax.weights.keys import RULES

# Qwen2.5-VL: block 0 window attention, block 1 full; windows of 4 x 4 merge units (window_size 112).
CFGS = {
    "qwen2.5-vl": dataclasses.replace(
        QWEN2_5_VL_3B, depth=2, width=64, num_heads=4, intermediate_size=128, out_dim=48, fullatt_block_indexes=(1,)
    ),
    "qwen2-vl": dataclasses.replace(QWEN2_VL_2B, depth=1, width=64, num_heads=4, intermediate_size=256, out_dim=48),
}
GRID = [[1, 12, 20], [2, 10, 8]]  # edge windows, two frames of a video: segments matter


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pair:
    """HF's vision tower and ours with the same weights."""

    cfg: VisionConfig
    hf: torch.nn.Module  # HF's `visual`
    ours: nnx.Module  # our VisionTransformer


def converted(visual: torch.nn.Module, cfg: VisionConfig) -> dict[str, np.ndarray]:
    """HF's vision state dict as our flat params, through the converter's key table."""
    per_block: dict[str, dict[int, np.ndarray]] = {}
    params = {}
    for key, tensor in visual.state_dict().items():
        w = tensor.detach().float().numpy()
        rules = [(r, m) for r in RULES if r.applies(cfg) and (m := re.fullmatch(r.pattern, key))]
        assert len(rules) == 1, f"{key}: {len(rules)} rules"
        rule, match = rules[0]
        if rule.per_block:
            per_block.setdefault(rule.target, {})[int(match["layer"])] = rule.transform(w, cfg)
        else:
            params[rule.target] = rule.transform(w, cfg)
    for target, layers in per_block.items():
        params[target] = np.stack([layers[i] for i in range(cfg.depth)])  # [L, ...]
    return params


@pytest.fixture(scope="module", params=list(CFGS))
def pair(request) -> Pair:
    cfg = CFGS[request.param]
    visual = build_hf_model(cfg, seed=5).model.visual
    return Pair(cfg=cfg, hf=visual, ours=model_from_params(cfg, converted(visual, cfg)))


def block(pair: Pair, layer: int) -> nnx.Module:
    """Our Block `layer` out of the stacked blocks."""
    graphdef, stacked = nnx.split(pair.ours.blocks)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], stacked))


def rows(cfg: VisionConfig, seed: int) -> np.ndarray:
    """float32 [N, width] residual-stream rows for GRID: a mean and a spread unlike a norm's output."""
    n = int(np.prod(GRID, axis=1).sum())
    rng = np.random.default_rng(seed)
    return (0.5 + 2.0 * rng.standard_normal((n, cfg.width))).astype(np.float32)


def hf_tables(pair: Pair, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's rotary (cos, sin) [N, head_dim] for GRID, in the original row order."""
    pos = hf_index.get_vision_position_ids(torch.tensor(GRID), pair.cfg.spatial_merge_size)
    with torch.no_grad():
        return pair.hf.rotary_pos_emb(x, pos)


def test_rotary_tables(pair):
    cfg = pair.cfg
    x = torch.from_numpy(rows(cfg, 0))
    ref_cos, ref_sin = hf_tables(pair, x)
    cos, sin = rotary_cos_sin(jnp.asarray(rotary_ids(GRID, cfg)), cfg.head_dim, cfg.rope_theta)
    assert cos.shape == tuple(ref_cos.shape) == (x.shape[0], cfg.head_dim)
    assert_fp32_close(np.asarray(cos), ref_cos.numpy())
    assert_fp32_close(np.asarray(sin), ref_sin.numpy())


@pytest.mark.parametrize("which", ["norm1", "norm2"])
def test_norm(pair, which):
    """RMSNorm (Qwen2.5-VL) or LayerNorm with bias (Qwen2-VL), weights not 1, inputs off-centre."""
    x = rows(pair.cfg, 1)
    ours = getattr(block(pair, 0), which)(jnp.asarray(x))
    with torch.no_grad():
        ref = getattr(pair.hf.blocks[0], which)(torch.from_numpy(x)).numpy()
    assert_fp32_close(np.asarray(ours), ref)


def test_merger_norm(pair):
    x = rows(pair.cfg, 2)
    with torch.no_grad():
        ref = pair.hf.merger.ln_q(torch.from_numpy(x)).numpy()
    assert_fp32_close(np.asarray(pair.ours.merger.norm(jnp.asarray(x))), ref)


def run_block(pair: Pair, layer: int, x: np.ndarray, *, full: bool) -> np.ndarray:
    """Our block `layer` on the rows x [N, D] of GRID, padded to the plan's bucket: [N, D]."""
    plan = make_plan(GRID, pair.cfg)
    n = x.shape[0]
    padded = np.zeros((plan.bucket.patches, x.shape[1]), np.float32)  # [N_pad, D]
    padded[:n] = x
    cos, sin = rotary_cos_sin(jnp.asarray(plan.pos_ids), pair.cfg.head_dim, pair.cfg.rope_theta)
    out = block(pair, layer)(jnp.asarray(padded), cos, sin, jax.tree.map(jnp.asarray, plan), full=full)
    return np.asarray(out)[:n]


def hf_block(pair: Pair, layer: int, x: np.ndarray, cu_seqlens: torch.Tensor, order: torch.Tensor | None) -> np.ndarray:
    """HF's block `layer` on x [N, D] with segments `cu_seqlens`, run (as HF's tower runs it) on the
    rows permuted into window order `order` (merge units) and permuted back: [N, D]."""
    xt = torch.from_numpy(x)
    cos, sin = hf_tables(pair, xt)
    mu = pair.cfg.merge_unit
    if order is not None:  # [N, .] -> [N / mu, mu, .] in window order -> [N, .]
        xt, cos, sin = (t.reshape(-1, mu, t.shape[-1])[order].reshape(t.shape) for t in (xt, cos, sin))
    max_seqlen = int(torch.diff(cu_seqlens).max())
    with torch.no_grad():
        out = pair.hf.blocks[layer](xt, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, position_embeddings=(cos, sin))
    if order is not None:
        out = out.reshape(-1, mu, out.shape[-1])[torch.argsort(order)].reshape(out.shape)
    return out.numpy()


def test_full_attention_block(pair):
    """Full (per-frame) attention: the last block of either variant."""
    layer = pair.cfg.depth - 1
    assert pair.cfg.full_attention_layers[layer]
    x = rows(pair.cfg, 3)
    ref = hf_block(pair, layer, x, hf_index.get_vision_cu_seqlens(torch.tensor(GRID)), None)
    assert_fp32_close(run_block(pair, layer, x, full=True), ref)


def test_window_attention_block(pair):
    """Window attention (Qwen2.5-VL block 0): HF runs it on window-permuted rows, we do not."""
    cfg = pair.cfg
    if not cfg.windowed:
        pytest.skip("Qwen2-VL has no window attention")
    assert not cfg.full_attention_layers[0]
    order, cu_windows = hf_index.get_vision_window_index(
        torch.tensor(GRID), cfg.spatial_merge_size, cfg.window_size, cfg.patch_size
    )
    assert len(cu_windows) > 3  # several windows, edge windows among them
    x = rows(cfg, 4)
    ref = hf_block(pair, 0, x, cu_windows, order)
    assert_fp32_close(run_block(pair, 0, x, full=False), ref)


def test_merger(pair):
    x = rows(pair.cfg, 5)
    with torch.no_grad():
        ref = pair.hf.merger(torch.from_numpy(x)).numpy()
    out = np.asarray(pair.ours.merger(jnp.asarray(x)))
    assert out.shape == ref.shape == (x.shape[0] // pair.cfg.merge_unit, pair.cfg.out_dim)
    assert_fp32_close(out, ref)
