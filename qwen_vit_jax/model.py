"""The Qwen2-VL / Qwen2.5-VL vision tower in Flax NNX, top to bottom.

  pixels [N, 1176] -> PatchEmbed -> depth x Block (window or full attention) -> PatchMerger
  -> [N / 4, out_dim]

Both variants live here and differ only by config: Qwen2-VL uses LayerNorm and an
fc1 -> act -> fc2 MLP with full attention everywhere; Qwen2.5-VL uses RMSNorm, a SwiGLU
MLP and window attention except in `fullatt_block_indexes`.

Rows stay in the original pixel_values order throughout: frames are contiguous and each
run of merge_unit (4) rows is one merge unit, so full attention, the merger and the output
need no permutation; window attention gathers its windows itself (attention.py). Every
index comes from the host plan (plan.py): nothing here depends on grid values, only on
the bucket's static shapes.

Numerics: the residual stream, norms, rotary, softmax and biases are float32; matmul
operands are float32 (HIGHEST precision) or bfloat16 with float32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen_vit_jax.attention import Numerics, segment_attention, window_attention
from qwen_vit_jax.config import QWEN2_5_VL, VisionConfig

MIN_DOT_ROWS = 64  # see PatchMerger

# ---- helpers -----------------------------------------------------------------------------


def activation(name: str):
    """HF ACT2FN equivalents. `gelu` is the exact erf form (jax.nn.gelu defaults to tanh)."""
    return {
        "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
        "silu": jax.nn.silu,
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    }[name]


def rotary_cos_sin(pos_ids: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """2-D rotary tables, float32.

    Args:
      pos_ids: [N, 2] int32 (h, w) patch coordinates.
    Returns:
      cos, sin: [N, head_dim]; angles of h then w (head_dim / 4 frequencies each),
      the pair duplicated to head_dim (HF's rotate_half layout).
    """
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (np.arange(0, half, 2, dtype=np.float64) / half))  # [Dh/4]
    angles = pos_ids.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq, jnp.float32)  # [N, 2, Dh/4]
    angles = angles.reshape(pos_ids.shape[0], half)  # [N, Dh/2]: h freqs then w freqs
    angles = jnp.concatenate([angles, angles], axis=-1)  # [N, Dh]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [N, H, Dh] float32; cos/sin: [N, Dh]. x * cos + rotate_half(x) * sin."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _normal(rngs: nnx.Rngs, shape, std: float):
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


# ---- layers ------------------------------------------------------------------------------


class Linear(nnx.Module):
    """y = x @ kernel + bias. kernel: [in, out]."""

    def __init__(self, din: int, dout: int, num: Numerics, *, bias: bool = True, rngs: nnx.Rngs):
        self.num = num
        self.kernel = nnx.Param(_normal(rngs, (din, dout), din**-0.5))
        self.bias = nnx.Param(jnp.zeros((dout,), jnp.float32)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.num.einsum("...i,io->...o", x, self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y


class Norm(nnx.Module):
    """RMSNorm (Qwen2.5-VL, scale only) or LayerNorm (Qwen2-VL, scale + bias), in float32."""

    def __init__(self, dim: int, cfg: VisionConfig):
        self.rms = cfg.variant == QWEN2_5_VL
        self.eps = cfg.norm_eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.bias = None if self.rms else nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        if self.rms:
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
            return x * self.scale[...].astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        x = (x - mean) * jax.lax.rsqrt(var + self.eps)
        return x * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)


class PatchEmbed(nnx.Module):
    """Conv3d with kernel = stride = (T, p, p) and no bias, on rows of (C, T, p, p): a matmul."""

    def __init__(self, cfg: VisionConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.num = num
        self.kernel = nnx.Param(_normal(rngs, (cfg.patch_dim, cfg.width), cfg.patch_dim**-0.5))

    def __call__(self, pixels: jax.Array) -> jax.Array:
        return self.num.einsum("np,pd->nd", pixels, self.kernel[...])  # [N, P] -> [N, D]


class Attention(nnx.Module):
    def __init__(self, cfg: VisionConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.num = num
        self.num_heads = cfg.num_heads
        self.qkv = Linear(cfg.width, 3 * cfg.width, num, rngs=rngs)
        self.proj = Linear(cfg.width, cfg.width, num, rngs=rngs)

    def __call__(self, x, cos, sin, plan, *, full, key_blocks: int, block: int, unroll: bool = False) -> jax.Array:
        """x: [N, D]; full: True for per-frame (full) attention, False for window attention."""
        n, d = x.shape
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, d // self.num_heads)  # [N, 3, H, Dh]
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        if full:
            o = segment_attention(q, k, v, plan["segment_ids"], plan["tiles"], block, key_blocks, self.num,
                                  unroll=unroll)  # [N, H, Dh]
        else:
            o = window_attention(q, k, v, plan["window_tokens"], plan["window_ids"], plan["window_slot"], self.num)
        return self.proj(o.reshape(n, d))  # [N, H, Dh] -> [N, D]


class MLP(nnx.Module):
    """Qwen2-VL: fc2(act(fc1(x)))."""

    def __init__(self, cfg: VisionConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.act = activation(cfg.hidden_act)
        self.fc1 = Linear(cfg.width, cfg.intermediate_size, num, rngs=rngs)
        self.fc2 = Linear(cfg.intermediate_size, cfg.width, num, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SwiGLU(nnx.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), all with biases."""

    def __init__(self, cfg: VisionConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.act = activation(cfg.hidden_act)
        self.gate = Linear(cfg.width, cfg.intermediate_size, num, rngs=rngs)
        self.up = Linear(cfg.width, cfg.intermediate_size, num, rngs=rngs)
        self.down = Linear(cfg.intermediate_size, cfg.width, num, rngs=rngs)

    def __call__(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: VisionConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.norm1 = Norm(cfg.width, cfg)
        self.attn = Attention(cfg, num, rngs=rngs)
        self.norm2 = Norm(cfg.width, cfg)
        self.mlp = (SwiGLU if cfg.variant == QWEN2_5_VL else MLP)(cfg, num, rngs=rngs)

    def __call__(self, x, cos, sin, plan, *, full, key_blocks: int, block: int, unroll: bool = False):
        x = x + self.attn(self.norm1(x), cos, sin, plan, full=full, key_blocks=key_blocks, block=block,
                          unroll=unroll)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """norm, then each merge unit's merge_unit rows concatenated -> fc1 -> GELU (erf) -> fc2."""

    def __init__(self, cfg: VisionConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.merge_unit = cfg.merge_unit
        self.norm = Norm(cfg.width, cfg)
        hidden = cfg.width * cfg.merge_unit
        self.fc1 = Linear(hidden, hidden, num, rngs=rngs)
        self.fc2 = Linear(hidden, cfg.out_dim, num, rngs=rngs)

    def __call__(self, x):
        n, d = x.shape
        x = self.norm(x).reshape(n // self.merge_unit, self.merge_unit * d)  # [N, D] -> [N/4, 4D]
        # XLA's CPU dot sums in another order below ~60 rows; padding small buckets to 64 merged
        # rows keeps every token's result independent of the bucket it landed in.
        rows = max(n // self.merge_unit, MIN_DOT_ROWS)
        x = jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))  # [rows, 4D]
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))[: n // self.merge_unit]  # [N/4, out_dim]


# ---- the tower ---------------------------------------------------------------------------


class VisionTransformer(nnx.Module):
    """The vision tower. Blocks are stacked (every parameter has a leading [depth] axis) and
    run under lax.scan (over the periods of the window / full layer pattern, and inside a
    period over each run of same-kind layers: `layer_schedule`), so the program size and
    compile time do not grow with depth."""

    def __init__(self, cfg: VisionConfig, num: Numerics = Numerics(), *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, num, rngs=rngs)

        @nnx.split_rngs(splits=cfg.depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(cfg, num, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.merger = PatchMerger(cfg, num, rngs=rngs)

    def __call__(
        self, pixels: jax.Array, plan: dict[str, jax.Array], *, key_blocks: int, block: int,
        unroll: bool = False,
    ) -> jax.Array:
        """Args:
          pixels: [N, patch_dim], N a bucket size (rows >= the real count are padding).
          plan: the device arrays of a qwen_vit_jax.plan.Plan (pos_ids [N, 2], segment_ids [N],
            tiles [5, T], window_tokens / window_ids [W, S], window_slot [N]).
          key_blocks, block: the bucket's static key blocks per attention tile and rows per block.
          unroll: unroll the layer scan and the attention loop (same arithmetic, much larger
            program): XLA's cost analysis counts a loop body once, so FLOP counts need this.
        Returns:
          [N / merge_unit, out_dim] float32, rows in the original order.
        """
        cfg = self.cfg
        x = self.patch_embed(pixels)  # [N, D] float32
        cos, sin = rotary_cos_sin(plan["pos_ids"], cfg.head_dim, cfg.rope_theta)  # [N, Dh] each

        layers = cfg.full_attention_layers
        graphdef, stacked = nnx.split(self.blocks)

        def layer_at(x, i, full: bool):  # layer i (int or traced) of the stack, its kind known statically
            state = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stacked)
            return nnx.merge(graphdef, state)(x, cos, sin, plan, full=full, key_blocks=key_blocks, block=block,
                                              unroll=unroll)

        if unroll:  # one copy of every layer: only for XLA's cost analysis (cost.py)
            for i, full in enumerate(layers):
                x = layer_at(x, i, full)
            return self.merger(x)

        runs, groups = layer_schedule(layers)
        period = len(layers) // groups

        def group(x, g):  # one period of the layer pattern: layers g * period ...
            start = g * period
            for full, length in runs:
                if length == 1:
                    x = layer_at(x, start, full)
                else:
                    x = jax.lax.scan(lambda x, i, full=full: (layer_at(x, i, full), None), x,
                                     start + jnp.arange(length))[0]
                start = start + length
            return x, None

        # Every loop indexes the stacked weights in place: one layer's slice at a time, never a
        # copy of a whole run (a sliced scan operand would be one).
        x, _ = jax.lax.scan(group, x, jnp.arange(groups))  # [N, D]
        return self.merger(x)


def layer_schedule(layers: tuple[bool, ...]) -> tuple[list[tuple[bool, int]], int]:
    """The layer pattern as (runs, groups): `layers` (True = full attention) is `groups` copies
    of the runs [(full, length), ...]. The forward scans over the groups and, inside a group, over
    each run with its kind fixed at trace time: no lax.cond on a device value (a conditional
    reads its predicate back to the host on GPU), and one compiled body per kind.

    Qwen2.5-VL (full at 7, 15, 23, 31): ([(False, 7), (True, 1)], 4); Qwen2-VL: ([(True, 32)], 1).
    """
    runs: list[tuple[bool, int]] = []
    for full in layers:
        if runs and runs[-1][0] == full:
            runs[-1] = (full, runs[-1][1] + 1)
        else:
            runs.append((full, 1))
    for period in range(1, len(runs) + 1):
        if len(runs) % period == 0 and runs == runs[:period] * (len(runs) // period):
            return runs[:period], len(runs) // period
    raise AssertionError("unreachable: the whole pattern is a period")


def abstract_model(cfg: VisionConfig, num: Numerics = Numerics()) -> VisionTransformer:
    """The model with shape-only parameters (no memory spent on random weights)."""
    return nnx.eval_shape(lambda: VisionTransformer(cfg, num, rngs=nnx.Rngs(0)))
