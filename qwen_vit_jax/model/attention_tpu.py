"""Segment attention through Pallas splash attention (TPUs): `Numerics(attention="splash")`.

The problem is attention_gpu.tile_attention's (query tiles, each against a window of K key rows
from any start row, q_seg == k_seg decides), with the same inputs and outputs. Splash attention
runs one sequence per call, so each tile's key window is gathered ([T, K', H, D], linear in the
rows) and the kernel is vmapped over tiles; segment ids (splash's SegmentIds, separate for queries
and keys) carry the frames and windows, so the mask is data from the plan: the bucket alone fixes
the kernel (its static mask is full; the plan's segments do the masking).

Splash works on 128-lane blocks: query tiles are padded to a multiple of 128 rows (q_seg NO_KEY),
windows to a multiple of 128 keys (k_seg -1 past K), head_dim to 128 (zero lanes add nothing to
q.k and are cut from the output). A query row with no valid key gets splash's uniform average;
it is set to exactly 0 here. Window slots (64 rows) are padded to 128 both ways: 4x a slot's work,
which a packing of two slots per sequence would halve (not done: the XLA schedule stays the TPU
default until a device measures both).

Numerics: splash computes the scores and softmax in float32 from the operands it is given; use it
with bfloat16 operands (the tower's bf16 mode). For float32 the XLA schedule (HIGHEST precision) is
the exact path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

LANES = 128
NO_KEY = -2  # q_seg of a query row that attends to nothing (k_seg uses -1)


def _round(n: int) -> int:
    return -(-n // LANES) * LANES


def _kernel(heads: int, q_rows: int, k_rows: int, interpret: bool):
    """The splash kernel for one tile shape (static per bucket): [H, Bq', D] x [H, K', D]. Made at
    every trace, not cached: its mask tables become constants of the program being traced."""
    full = masks.MultiHeadMask([masks.FullMask((q_rows, k_rows)) for _ in range(heads)])
    blocks = splash.BlockSizes(block_q=LANES, block_kv=LANES)
    return splash.make_splash_mha(full, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret)


def tile_attention(q, k, v, q_seg, k_seg, k_start, key_rows: int, *, interpret: bool = False):
    """attention_gpu.tile_attention's contract, through splash attention.

    Args:
      q: [T, Bq, H, Dh] query tiles (scaled and rotated), the operand dtype.
      k, v: [M, H, Dh] the shared key / value rows (finite).
      q_seg: int32 [T, Bq] (NO_KEY: attends to nothing); k_seg: int32 [M] (-1: padding).
      k_start: int32 [T] first key row of each tile's window; key_rows: K (static).
    Returns:
      float32 [T, Bq, H, Dh]; rows with no valid key are exactly 0.
    """
    t, bq, h, dh = q.shape
    m = k.shape[0]
    bq_pad, k_pad, d = _round(bq), _round(key_rows), _round(dh)
    offset = jnp.arange(k_pad)  # [K']
    rows = jnp.minimum(k_start[:, None] + offset, m - 1)  # [T, K'] (clamped rows are masked below)
    seg_w = jnp.where(offset < key_rows, k_seg[rows], -1)  # [T, K']
    kw, vw = (jnp.pad(x[rows], ((0, 0), (0, 0), (0, 0), (0, d - dh))) for x in (k, v))  # [T, K', H, D]
    q = jnp.pad(q, ((0, 0), (0, bq_pad - bq), (0, 0), (0, d - dh)))  # [T, Bq', H, D]
    q_seg = jnp.pad(q_seg, ((0, 0), (0, bq_pad - bq)), constant_values=NO_KEY)  # [T, Bq']
    kernel = _kernel(h, bq_pad, k_pad, interpret)

    def one(qt, kt, vt, sq, sk):  # [Bq', H, D], [K', H, D] x 2, [Bq'], [K'] -> [H, Bq', D]
        heads_first = (x.transpose(1, 0, 2) for x in (qt, kt, vt))  # [H, rows, D]
        return kernel(*heads_first, segment_ids=splash.SegmentIds(q=sq, kv=sk))

    out = jax.vmap(one)(q, kw, vw, q_seg, seg_w).astype(jnp.float32)  # [T, H, Bq', D]
    out = out.transpose(0, 2, 1, 3)[:, :bq, :, :dh]  # [T, Bq, H, Dh]
    return jnp.where((q_seg[:, :bq] != NO_KEY)[:, :, None, None], out, 0.0)
