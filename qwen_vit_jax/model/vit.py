"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 / PaddleOCR-VL vision tower in Flax NNX, top to bottom.

  pixels [N, patch_dim] -> PatchEmbed (+ norm) (+ position table) -> depth x Block (window or
  full attention; deepstack taps) -> (post norm) -> PatchMerger or GlmMerger -> [N / 4, out_dim]

All variants live here and differ only by config: Qwen2-VL uses LayerNorm and an
fc1 -> act -> fc2 MLP with full attention everywhere; Qwen2.5-VL uses RMSNorm, a SwiGLU
MLP and window attention except in `fullatt_block_indexes`. Qwen3-VL / Qwen3.5 are Qwen2-VL's
layout with a patch-embedding bias, a learned square position table resampled to each grid
(indices and weights from the plan, added once before block 0) and the tanh GELU; Qwen3-VL
also has deepstack mergers: after each block in `deepstack_layers`, a merger (shuffle first,
then LayerNorm over the 4 * width merged row) turns that block's output into tokens
(docs/qwen3.md). GLM-4.1V / 4.5V is Qwen2.5-VL's block layout (RMSNorm, SwiGLU) with full attention,
an RMSNorm after the patch embedding, a bicubic (16-tap) table, a post-norm and its own merger
(GlmMerger). PaddleOCR-VL is Qwen3.5's layout with 2-D patches (temporal patch 1), the table
resampled with align_corners=False, a LayerNorm after the last block and HF's projector as the
merger (docs/family.md); its pixel rows arrive in raster order and are put in merge units on the
host before they get here (`plan.raster_to_merge_order`).

Rows stay in the original pixel_values order throughout: frames are contiguous and each
run of merge_unit (4) rows is one merge unit, so full attention, the merger and the output
need no permutation; window attention gathers its windows itself (attention.py). Every
index comes from the host plan (plan/): nothing here depends on grid values, only on
the bucket's static shapes.

Numerics: the residual stream, norms, rotary, softmax and biases are float32; matmul
operands are float32 (HIGHEST precision) or bfloat16 with float32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.model.attention import segment_attention, window_attention
from qwen_vit_jax.model.numerics import Numerics, platform_numerics
from qwen_vit_jax.plan import Patches, Plan

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
    """RMSNorm (Qwen2.5-VL, GLM; scale only) or LayerNorm (the others, scale + bias), in float32.
    eps: cfg.norm_eps unless given (PaddleOCR-VL's merger norm has its own); rms: cfg.norm's kind
    unless given (GLM's merger has a LayerNorm in an RMSNorm tower)."""

    def __init__(self, dim: int, cfg: VisionConfig, eps: float | None = None, rms: bool | None = None):
        self.rms = cfg.norm == "rmsnorm" if rms is None else rms
        self.eps = cfg.norm_eps if eps is None else eps
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
    """Conv3d with kernel = stride = (T, p, p) on rows of (C, T, p, p): a matmul. A bias for
    Qwen3-VL / Qwen3.5 only."""

    def __init__(self, cfg: VisionConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.num = num
        self.kernel = nnx.Param(_normal(rngs, (cfg.patch_dim, cfg.width), cfg.patch_dim**-0.5))
        self.bias = nnx.Param(jnp.zeros((cfg.width,), jnp.float32)) if cfg.patch_embed_bias else None

    def __call__(self, pixels: jax.Array) -> jax.Array:
        x = self.num.einsum("np,pd->nd", pixels, self.kernel[...])  # [N, P] -> [N, D]
        if self.bias is not None:
            x = x + self.bias[...].astype(jnp.float32)
        return x


class PosEmbed(nnx.Module):
    """The learned square position table (Qwen3-VL / Qwen3.5), resampled to each grid by the
    plan's bilinear gather: pos[n] = sum_k weight[n, k] * table[index[n, k]], float32.

    HF sums the 4 weighted rows the same way, in float32 (its weights are float32, so a bf16
    table is promoted). Four gathers of [N, D] summed one by one: no [N, 4, D] intermediate is
    needed. Elementwise on purpose (not a dot): exact float32 products whatever the backend's
    matmul precision. Padding rows have weight 0: a zero position embedding.
    """

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
        self.table = nnx.Param(_normal(rngs, (cfg.num_position_embeddings, cfg.width), 0.02))

    def __call__(self, index: jax.Array, weight: jax.Array) -> jax.Array:
        """index: int32 [N, A]; weight: float32 [N, A] -> [N, D] float32. A = 4 taps (bilinear) or
        16 (GLM's bicubic), static: the plan's shape."""
        table = self.table[...].astype(jnp.float32)  # [side * side, D]
        pos = table[index[:, 0]] * weight[:, 0:1]  # [N, D]
        for k in range(1, index.shape[1]):
            pos = pos + table[index[:, k]] * weight[:, k : k + 1]
        return pos


class Attention(nnx.Module):
    def __init__(self, cfg: VisionConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.num = num
        self.num_heads = cfg.num_heads
        self.qkv = Linear(cfg.width, 3 * cfg.width, num, bias=cfg.qkv_bias, rngs=rngs)
        self.proj = Linear(cfg.width, cfg.width, num, bias=cfg.block_bias, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, plan: Plan, *, full: bool) -> jax.Array:
        """x: [N, D]; full: True for per-frame (full) attention, False for window attention."""
        n, d = x.shape
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, d // self.num_heads)  # [N, 3D] -> [N, 3, H, Dh]
        attend = segment_attention if full else window_attention
        o = attend(qkv[:, 0], qkv[:, 1], qkv[:, 2], plan, self.num, rotary=(cos, sin))  # [N, H, Dh]; rotates q, k
        return self.proj(o.reshape(n, d))  # [N, H, Dh] -> [N, D]


class MLP(nnx.Module):
    """Qwen2-VL / Qwen3-VL / Qwen3.5: fc2(act(fc1(x))) (HF's Qwen3 `linear_fc1` / `linear_fc2`)."""

    def __init__(self, cfg: VisionConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.act = activation(cfg.hidden_act)
        hidden = num.mlp_width(cfg.intermediate_size)  # zero-padded on TPU (Numerics.mlp_multiple)
        self.fc1 = Linear(cfg.width, hidden, num, rngs=rngs)
        self.fc2 = Linear(hidden, cfg.width, num, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SwiGLU(nnx.Module):
    """Qwen2.5-VL / GLM: down(act(gate(x)) * up(x)); with biases except GLM's.
    width / hidden: the input and inner widths (default cfg.width / cfg.intermediate_size)."""

    def __init__(
        self,
        cfg: VisionConfig,
        num: Numerics,
        *,
        width: int | None = None,
        hidden: int | None = None,
        bias: bool | None = None,
        rngs: nnx.Rngs,
    ):
        # The blocks' MLP (no explicit hidden): its width zero-padded on TPU (Numerics.mlp_multiple).
        width, hidden = width or cfg.width, hidden or num.mlp_width(cfg.intermediate_size)
        bias = cfg.block_bias if bias is None else bias
        self.act = activation(cfg.hidden_act)
        self.gate = Linear(width, hidden, num, bias=bias, rngs=rngs)
        self.up = Linear(width, hidden, num, bias=bias, rngs=rngs)
        self.down = Linear(hidden, width, num, bias=bias, rngs=rngs)

    def __call__(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: VisionConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.norm1 = Norm(cfg.width, cfg)
        self.attn = Attention(cfg, num, rngs=rngs)
        self.norm2 = Norm(cfg.width, cfg)
        self.mlp = (SwiGLU if cfg.mlp == "swiglu" else MLP)(cfg, num, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, plan: Plan, *, full: bool) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, plan, full=full)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """norm, then each merge unit's merge_unit rows concatenated -> fc1 -> GELU (erf) -> fc2.

    postshuffle (Qwen3-VL's deepstack mergers): concatenate first, then the norm over the
    merge_unit * width row (its parameters are [4D], not [D])."""

    def __init__(self, cfg: VisionConfig, num: Numerics, *, postshuffle: bool = False, rngs: nnx.Rngs):
        self.merge_unit = cfg.merge_unit
        self.postshuffle = postshuffle
        hidden = cfg.width * cfg.merge_unit
        self.norm = Norm(hidden if postshuffle else cfg.width, cfg, cfg.merger_norm_eps)
        self.fc1 = Linear(hidden, hidden, num, rngs=rngs)
        self.fc2 = Linear(hidden, cfg.out_dim, num, rngs=rngs)

    def __call__(self, x):
        n, d = x.shape
        if self.postshuffle:
            x = self.norm(x.reshape(n // self.merge_unit, self.merge_unit * d))  # [N, D] -> [N/4, 4D]
        else:
            x = self.norm(x).reshape(n // self.merge_unit, self.merge_unit * d)  # [N, D] -> [N/4, 4D]
        # XLA's CPU dot sums in another order below ~60 rows; padding small buckets to 64 merged
        # rows keeps every token's result independent of the bucket it landed in.
        rows = max(n // self.merge_unit, MIN_DOT_ROWS)
        x = jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))  # [rows, 4D]
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))[: n // self.merge_unit]  # [N/4, out_dim]


class GlmMerger(nnx.Module):
    """GLM-4.1V / 4.5V's merger: each merge unit's 4 rows through a 2 x 2 conv with stride 2 (a
    matmul of the concatenated [4D] row, kernel rows ordered (row in unit, width): HF's
    view(-1, 2, 2, D) -> Conv2d), then proj (no bias) -> LayerNorm (eps 1e-5, with bias) -> exact
    GELU -> SwiGLU of width cfg.merger_intermediate_size (no biases, cfg.hidden_act)."""

    def __init__(self, cfg: VisionConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.merge_unit = cfg.merge_unit
        self.downsample = Linear(cfg.merge_unit * cfg.width, cfg.out_dim, num, rngs=rngs)
        self.proj = Linear(cfg.out_dim, cfg.out_dim, num, bias=False, rngs=rngs)
        self.norm = Norm(cfg.out_dim, cfg, eps=1e-5, rms=False)
        self.mlp = SwiGLU(cfg, num, width=cfg.out_dim, hidden=cfg.merger_intermediate_size, bias=False, rngs=rngs)

    def __call__(self, x):
        n, d = x.shape
        x = x.reshape(n // self.merge_unit, self.merge_unit * d)  # [N, D] -> [N/4, 4D]
        rows = max(n // self.merge_unit, MIN_DOT_ROWS)  # as PatchMerger: bucket-independent dots
        x = jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))  # [rows, 4D]
        x = self.proj(self.downsample(x))  # [rows, out_dim]
        x = jax.nn.gelu(self.norm(x), approximate=False)
        return self.mlp(x)[: n // self.merge_unit]  # [N/4, out_dim]


# ---- the tower ---------------------------------------------------------------------------


class VisionTransformer(nnx.Module):
    """The vision tower. Blocks are stacked (every parameter has a leading [depth] axis) and
    run under lax.scan (over the periods of the window / full layer pattern, and inside a
    period over each run of same-kind layers: `layer_schedule`), so the program size and
    compile time do not grow with depth. Qwen3-VL's deepstack mergers are stacked the same way
    ([K] leading axis, row k for `cfg.deepstack_layers[k]`)."""

    def __init__(self, cfg: VisionConfig, num: Numerics = Numerics(), *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, num, rngs=rngs)
        self.patch_norm = Norm(cfg.width, cfg) if cfg.patch_norm else None  # GLM's post_conv_layernorm
        self.pos_embed = PosEmbed(cfg, rngs=rngs) if cfg.num_position_embeddings else None

        @nnx.split_rngs(splits=cfg.depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(cfg, num, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.post_norm = Norm(cfg.width, cfg) if cfg.post_norm else None  # PaddleOCR-VL's post_layernorm
        self.merger = (GlmMerger if cfg.merger == "glm" else PatchMerger)(cfg, num, rngs=rngs)

        @nnx.split_rngs(splits=cfg.num_deepstack)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_deepstack(rngs):
            return PatchMerger(cfg, num, postshuffle=True, rngs=rngs)

        self.deepstack = make_deepstack(rngs) if cfg.num_deepstack else None

    def __call__(
        self,
        pixels: jax.Array,
        plan: Plan,
        *,
        hidden_states: bool = False,
        deepstack: bool = False,
        remat: bool = False,
    ) -> jax.Array | tuple:
        """Args:
          pixels: [N, patch_dim] with N = plan.bucket.patches (rows >= the real count are padding:
            `plan.take(pixel_values)` builds this), or their uint8 `Patches` (`plan.take(patches)`),
            turned into the same float rows here.
          plan: the chunk's `Plan` (host arrays, device arrays or tracers: only its shapes and its
            bucket are static).
          hidden_states: also return the patch embeddings (plus the position embedding, for
            Qwen3) and the residual stream after every block, rows in the original order (HF's
            output_hidden_states; Qwen2.5-VL's HF states are window-permuted, these are not).
          deepstack: also return Qwen3-VL's deepstack features (HF's `deepstack_features`): one
            [N / merge_unit, out_dim] array per entry of cfg.deepstack_layers, in that order; an
            empty list for towers without deepstack mergers.
          remat: recompute each block's activations in the backward pass (jax.checkpoint per
            block): the same values and gradients with less memory for training.
        Returns:
          out: [N / merge_unit, out_dim] float32 (HF's pooler_output), rows in the original order;
          with extras, a tuple (out, hidden) / (out, features) / (out, hidden, features), where
          hidden is [depth + 1, N, width] float32 and features a list of [N / merge_unit, out_dim].
        """
        cfg = self.cfg
        plan = jax.tree.map(jnp.asarray, plan)  # a closed-over host plan becomes constants
        if isinstance(pixels, Patches):  # uint8 as decoded -> HF's float rows, on the device
            pixels = pixels.to_float()  # [N, S, p, p, C] uint8 -> [N, patch_dim] float32
        x = self.patch_embed(pixels)  # [N, D] float32
        if self.patch_norm is not None:  # GLM: before the position table is added
            x = self.patch_norm(x)
        if self.pos_embed is not None:  # added once, before the rotary and block 0 (as HF)
            x = x + self.pos_embed(plan.pos_embed_index, plan.pos_embed_weight)  # [N, D]
        cos, sin = rotary_cos_sin(plan.pos_ids, cfg.head_dim, cfg.rope_theta)  # [N, Dh] each
        graphdef, stacked = nnx.split(self.blocks)

        def layer_at(x, i, full: bool):  # layer i (traced) of the stack, its kind known statically
            state = jax.tree.map(lambda a: from_bits(jax.lax.dynamic_index_in_dim(a, i, keepdims=False)), stacked)
            return nnx.merge(graphdef, state)(x, cos, sin, plan, full=full)

        if remat:
            layer_at = jax.checkpoint(layer_at, static_argnums=(2,))

        runs, groups = layer_schedule(cfg.full_attention_layers)
        period = len(cfg.full_attention_layers) // groups

        def run(x, start, full: bool, length: int):  # layers start .. start + length - 1, one kind
            def step(x, i):
                x = layer_at(x, i, full)
                return x, (x if hidden_states else None)

            return jax.lax.scan(step, x, start + jnp.arange(length))  # ys: [length, N, D] or None

        def group(x, g):  # one period of the layer pattern: layers g * period ...
            start, states = g * period, []
            for full, length in runs:
                x, ys = run(x, start, full, length)
                states.append(ys)
                start = start + length
            return x, (jnp.concatenate(states) if hidden_states else None)  # [period, N, D]

        # Every loop indexes the stacked weights in place: one layer's slice at a time, never a
        # copy of a whole run (a sliced scan operand would be one).
        x0 = x
        features = []
        if deepstack and cfg.num_deepstack:
            # A tap needs the residual stream after its block: one scan per stretch of layers
            # between taps (static cuts; the taps' features are computed as soon as they exist,
            # so no per-layer stack is kept). Only with deepstack: plain calls keep one scan.
            ds_graphdef, ds_stacked = nnx.split(self.deepstack)
            chunks, start = [], 0
            for full, length in tap_schedule(cfg.full_attention_layers, cfg.deepstack_layers):
                x, ys = run(x, start, full, length)
                chunks.append(ys)
                start += length
                if start - 1 in cfg.deepstack_layers:
                    k = cfg.deepstack_layers.index(start - 1)
                    merger = nnx.merge(ds_graphdef, jax.tree.map(lambda a, k=k: a[k], ds_stacked))
                    features.append(merger(x))  # [N / merge_unit, out_dim]
            states = jnp.concatenate(chunks) if hidden_states else None  # [depth, N, D]
        else:
            x, states = jax.lax.scan(group, x, jnp.arange(groups))  # [N, D], [groups, period, N, D]
            if hidden_states:
                states = states.reshape(cfg.depth, *x.shape)  # [groups, period, N, D] -> [depth, N, D]
        if self.post_norm is not None:  # after the hidden states are recorded, as HF's encoder output
            x = self.post_norm(x)
        out = self.merger(x)  # [N / merge_unit, out_dim]
        extras = []
        if hidden_states:
            extras.append(jnp.concatenate([x0[None], states]))  # [depth + 1, N, D]
        if deepstack:
            extras.append(features)
        return (out, *extras) if extras else out


def tap_schedule(layers: tuple[bool, ...], taps: tuple[int, ...]) -> list[tuple[bool, int]]:
    """The layers as runs (full, length) of one attention kind each, also cut after every tap, so
    that each tap ends a run. (12 full layers, taps (3, 7)): [(True, 4), (True, 4), (True, 4)]."""
    runs: list[tuple[bool, int]] = []
    for i, full in enumerate(layers):
        if runs and runs[-1][0] == full and i - 1 not in taps:
            runs[-1] = (full, runs[-1][1] + 1)
        else:
            runs.append((full, 1))
    return runs


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


def abstract_model(
    cfg: VisionConfig,
    dtype: str = "float32",
    platform: str = "cpu",
    attention: str = "xla",
    *,
    numerics: Numerics | None = None,
) -> VisionTransformer:
    """The tower as an `nnx.Module` with shape-only parameters (`jax.ShapeDtypeStruct`s, no memory)
    and the attention schedule of `platform` ("cpu" | "gpu" | "tpu"): what `load_model` gives a user
    on that platform, for ahead-of-time compiles (`jax.jit(f).lower(...)` over it and
    `Plan.abstract(bucket)` or `make_plans`), and what the encoder fills with its weights.

    attention: "xla" (the default) or "kernel" (the platform's Pallas kernel: Triton on "gpu",
    splash on "tpu"). numerics: these exact Numerics instead of those of dtype / platform /
    attention (the encoder's, from its device).
    """
    num = numerics if numerics is not None else platform_numerics(dtype, platform, attention)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: VisionTransformer(cfg, num, rngs=nnx.Rngs(0))))
    # As fill_state stores them: matrices in the operand dtype, norms and biases float32.
    flat = [
        (path, var.replace(jax.ShapeDtypeStruct(var.shape, num.operand_dtype))) if path[-1] == "kernel" else (path, var)
        for path, var in nnx.to_flat_state(state)
    ]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---- parameters --------------------------------------------------------------------------


def model_from_params(
    cfg: VisionConfig, params: dict[str, np.ndarray], num: Numerics = Numerics(), device: jax.Device | None = None
) -> VisionTransformer:
    """A model holding `params` (flat keys as written by the converter, e.g. "blocks.attn.qkv.kernel"),
    every parameter filled exactly once, shapes checked. Matrices take the operand dtype; norm
    scales and biases stay float32."""
    graphdef, abstract = nnx.split(abstract_model(cfg, numerics=num))
    return nnx.merge(graphdef, fill_state(abstract, params, num, device or jax.devices()[0]))


def as_bits(state: nnx.State) -> nnx.State:
    """`state` with the stacked bfloat16 block weights held as their uint16 bits (`from_bits` turns
    each layer's slice back, exactly). For inference: XLA's CPU backend otherwise converts every
    stacked bf16 array to a float32 copy at the start of each forward (627M values for the 3B
    tower: bench_profile.py `stack`, `u16` (retired), runs in benchmarks/history.md); bits
    are only sliced. Not differentiable: train on the bf16 state itself."""

    def bits(path, a):
        return jax.lax.bitcast_convert_type(a, jnp.uint16) if path[0].key == "blocks" and a.dtype == jnp.bfloat16 else a

    return jax.tree_util.tree_map_with_path(bits, state)


def from_bits(a: jax.Array) -> jax.Array:
    """A weight slice back from `as_bits`' uint16 bits to bfloat16 (a reinterpretation, no rounding)."""
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16) if a.dtype == jnp.uint16 else a


def fill_state(abstract: nnx.State, params: dict[str, np.ndarray], num: Numerics, device: jax.Device) -> nnx.State:
    """`abstract` (the model's shape-only state) filled from `params`, on `device`."""
    flat = nnx.to_flat_state(abstract)
    expected = {".".join(map(str, path)): var for path, var in flat}
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise ValueError(f"parameters do not match the model: missing {missing}, unexpected {extra}")
    values = []
    for key, var in expected.items():
        value = np.asarray(params[key])
        if key.startswith("blocks.mlp.") and value.shape != var.shape and len(value.shape) == len(var.shape):
            # The MLP's hidden width rounded up (Numerics.mlp_multiple): zeros in the added rows /
            # columns leave every output as it is.
            value = np.pad(value, [(0, max(0, v - s)) for s, v in zip(value.shape, var.shape)])
        if value.shape != var.shape:
            raise ValueError(f"parameter {key}: shape {value.shape}, model expects {var.shape}")
        dtype = num.operand_dtype if key.endswith("kernel") else jnp.float32
        values.append(jax.device_put(value.astype(dtype, copy=False), device))  # device_put copies anyway
    return nnx.from_flat_state([(path, var.replace(v)) for (path, var), v in zip(flat, values)])
