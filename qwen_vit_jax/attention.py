"""Attention on static shapes: window attention and per-frame (segment) attention.

Both take q, k, v for the packed batch in the original row order and the host plan's
tables (qwen_vit_jax.plan). Neither ever builds an [N, N] mask:

- window attention gathers windows into slots of `window_patches` (64) rows (small edge
  windows share a slot), attends densely inside each slot under a same-window mask and
  gathers the results back: cost ~ num_slots * 64 * 64 ~ sum(window_len * 64).
- segment attention walks, for every query block, the contiguous run of key blocks that
  holds its frames, with an online softmax: cost ~ sum(frame_len^2) (plus block rounding),
  memory linear in N.

Softmax statistics are always float32. `Numerics.dtype` is the dtype of the matmul
operands; products accumulate in float32 (preferred_element_type).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

# A finite "minus infinity": a fully masked row then gives exp(0) * 0 = 0, never NaN.
NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How matmuls run. float32: operands float32 at HIGHEST precision (exact on GPU/TPU too).
    bfloat16: operands rounded to bfloat16, float32 accumulation; everything else float32.

    `native_bf16=False` computes the bfloat16 mode's products as float32 dots of the
    bf16-rounded operands: the same numbers (a bf16 x bf16 product is exact in float32), for
    CPUs without bf16 dot instructions, where XLA's bf16 dot is slower than its float32 one.
    """

    dtype: str = "float32"
    native_bf16: bool = True

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    @property
    def operand_dtype(self):
        """Storage dtype of the weight matrices."""
        return jnp.float32 if self.dtype == "float32" else jnp.bfloat16

    def einsum(self, spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
        """einsum with operands rounded to the operand dtype and a float32 result."""
        if self.dtype == "float32" or not self.native_bf16:
            a, b = (x.astype(self.operand_dtype).astype(jnp.float32) for x in (a, b))
            return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def has_native_bf16(device: jax.Device) -> bool:
    """Whether `device` has fast bfloat16 dots: GPUs and TPUs do; a CPU needs avx512_bf16 or
    AMX (read from /proc/cpuinfo; without it XLA's bf16 dot is slower than float32)."""
    if device.platform != "cpu":
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def window_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    window_tokens: jax.Array,
    window_ids: jax.Array,
    window_slot: jax.Array,
    num: Numerics,
) -> jax.Array:
    """Attention inside windows, packed into slots of S rows (several small windows may share
    a slot; a row attends to the rows of its own window only).

    Args:
      q, k, v: [N, H, Dh] rows in original order (q, k already rotated).
      window_tokens: [W, S] int32, the row held by each slot entry, -1 for an empty entry.
      window_ids: [W, S] int32, the window each slot entry belongs to, -1 for an empty entry.
      window_slot: [N] int32, the flat slot entry (w * S + j) holding each row.
    Returns:
      [N, H, Dh] float32. Rows in no window (padding) get an arbitrary finite value.
    """
    num_slots, slots = window_tokens.shape
    scale = q.shape[-1] ** -0.5
    rows = jnp.maximum(window_tokens, 0)
    qw, kw, vw = q[rows] * scale, k[rows], v[rows]  # [W, S, H, Dh]
    s = num.einsum("wqhd,wkhd->whqk", qw, kw)  # [W, H, S, S]
    same = (window_ids[:, :, None] == window_ids[:, None, :]) & (window_ids[:, None, :] >= 0)  # [W, S, S]
    s = jnp.where(same[:, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    o = num.einsum("whqk,wkhd->wqhd", p, vw)  # [W, S, H, Dh]
    o = o.reshape(num_slots * slots, *o.shape[2:])  # [W*S, H, Dh]
    return o[window_slot]  # [N, H, Dh]


def segment_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    kv_block_start: jax.Array,
    kv_block_count: jax.Array,
    key_blocks: int,
    num: Numerics,
    *,
    unroll: bool = False,
) -> jax.Array:
    """Attention within segments (frames), blockwise with an online softmax.

    Row r attends to row s iff segment_ids[r] == segment_ids[s]. Query block i only visits
    key blocks kv_block_start[i] .. kv_block_start[i] + kv_block_count[i] - 1, which the
    host plan guarantees cover all of its segments.

    Args:
      q, k, v: [N, H, Dh] (q, k already rotated); N = num_blocks * block.
      segment_ids: [N] int32.
      kv_block_start, kv_block_count: [num_blocks] int32.
      key_blocks: static trip count, >= max(kv_block_count).
      unroll: unroll the key-block loop (for cost analysis only).
    Returns:
      [N, H, Dh] float32.
    """
    n, h, dh = q.shape
    nb = kv_block_start.shape[0]
    block = n // nb
    scale = dh**-0.5
    qb = (q * scale).reshape(nb, block, h, dh)  # [B, Q, H, Dh]
    kb = k.reshape(nb, block, h, dh)  # [B, K, H, Dh]
    vb = v.reshape(nb, block, h, dh)
    seg = segment_ids.reshape(nb, block)  # [B, Q]

    def step(j, carry):
        m, l, acc = carry  # [B, H, Q], [B, H, Q], [B, H, Q, Dh]
        active = j < kv_block_count  # [B]
        kbi = jnp.where(active, kv_block_start + j, kv_block_start)  # [B]
        s = num.einsum("bqhd,bkhd->bhqk", qb, kb[kbi])  # [B, H, Q, K]
        mask = (seg[:, None, :, None] == seg[kbi][:, None, None, :]) & active[:, None, None, None]
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + num.einsum("bhqk,bkhd->bhqd", p, vb[kbi])
        return m_new, l, acc

    init = (
        jnp.full((nb, h, block), NEG_INF, jnp.float32),
        jnp.zeros((nb, h, block), jnp.float32),
        jnp.zeros((nb, h, block, dh), jnp.float32),
    )
    _, l, acc = lax.fori_loop(0, key_blocks, step, init, unroll=unroll)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [B, H, Q, Dh]
    return out.transpose(0, 2, 1, 3).reshape(n, h, dh)  # [B, Q, H, Dh] -> [N, H, Dh]
