"""Attention on static shapes: window attention and per-frame (segment) attention.

Both take q, k, v for the packed batch in the original row order and the host plan's
tables (qwen_vit_jax.plan). Neither ever builds an [N, N] mask:

- window attention gathers each window into a slot of `window_patches` (64) rows, attends
  densely inside the slot and gathers the results back: cost ~ num_windows * 64 * 64.
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
    bfloat16: operands bfloat16, float32 accumulation; everything else stays float32."""

    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    @property
    def operand_dtype(self):
        return jnp.float32 if self.dtype == "float32" else jnp.bfloat16

    @property
    def precision(self):
        return lax.Precision.HIGHEST if self.dtype == "float32" else lax.Precision.DEFAULT

    def einsum(self, spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
        """einsum with operands cast to the operand dtype and a float32 result."""
        return jnp.einsum(
            spec,
            a.astype(self.operand_dtype),
            b.astype(self.operand_dtype),
            precision=self.precision,
            preferred_element_type=jnp.float32,
        )


def window_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    window_tokens: jax.Array,
    window_slot: jax.Array,
    num: Numerics,
) -> jax.Array:
    """Attention inside windows.

    Args:
      q, k, v: [N, H, Dh] rows in original order (q, k already rotated).
      window_tokens: [W, S] int32, the row held by each window slot, -1 for an empty slot.
      window_slot: [N] int32, the flat slot (w * S + j) holding each row.
    Returns:
      [N, H, Dh] float32. Rows in no window (padding) get an arbitrary finite value.
    """
    num_windows, slots = window_tokens.shape
    scale = q.shape[-1] ** -0.5
    valid = window_tokens >= 0  # [W, S]
    rows = jnp.maximum(window_tokens, 0)
    qw, kw, vw = q[rows], k[rows], v[rows]  # [W, S, H, Dh]
    s = num.einsum("wqhd,wkhd->whqk", qw, kw) * scale  # [W, H, S, S]
    s = jnp.where(valid[:, None, None, :], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    o = num.einsum("whqk,wkhd->wqhd", p, vw)  # [W, S, H, Dh]
    o = o.reshape(num_windows * slots, *o.shape[2:])  # [W*S, H, Dh]
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
    _, l, acc = lax.fori_loop(0, key_blocks, step, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [B, H, Q, Dh]
    return out.transpose(0, 2, 1, 3).reshape(n, h, dh)  # [B, Q, H, Dh] -> [N, H, Dh]
