"""Segment attention as one Pallas Triton kernel (NVIDIA GPUs): `Numerics(attention="triton")`.

The same problem as attention.py's schedules, in one kernel launch per layer: T query tiles of Bq
rows, each against its own window of K key rows that starts at any row of a shared key array;
query row r of tile t attends to key row s of its window iff q_seg[t, r] == k_seg[s]. Both of the
tower's attentions are this problem:

- full attention: a tile is a query block restricted to a run of frames (rows outside it get
  q_seg -2 and so exactly zero), its window the plan's K key rows from tile_key_start;
- window attention: a tile is a window slot (S = 64 rows, several small windows may share it),
  its window the slot itself (q_seg / k_seg: the window ids).

So cost is T * Bq * K (about sum(frame_len^2), or sum(window_len * 64)), and no [N, N] mask is
built. The kernel is a flash-attention loop (online softmax, float32 statistics, products
accumulated in float32); a row with no valid key gets exactly 0. Grid: (tile, head, query
sub-block of BLOCK_Q rows); each program walks its tile's window in BLOCK_K-row steps.

Triton wants power-of-two blocks: head_dim is zero-padded to one (80 -> 128: the padded lanes add
nothing to q.k and are cut from the output), query tiles to a multiple of BLOCK_Q rows (padding
rows have q_seg -2), and the key array gets BLOCK_K rows of padding (k_seg -1) so that a window's
last step never reads past it. `reference` is the same function in plain JAX, for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK_Q = 64  # query rows per program
BLOCK_K = 64  # key rows per step of the window loop
NEG_INF = -1e30  # finite: a fully masked row stays NaN-free
NO_KEY = -2  # q_seg of a query row that attends to nothing (k_seg uses -1 for padding rows)


def _kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, start_ref, o_ref, *, key_rows: int, precision):
    """One (tile, head, query sub-block): q_ref [BLOCK_Q, D], k_ref / v_ref [M, D] (the head's
    whole key array), q_seg_ref [BLOCK_Q], k_seg_ref [M], start_ref [1] -> o_ref [BLOCK_Q, D]."""
    q = q_ref[...]
    q_seg = q_seg_ref[...]
    start = start_ref[0]

    def step(j, carry):
        m, l, acc = carry  # [BQ], [BQ], [BQ, D] float32
        rows = pl.ds(start + j * BLOCK_K, BLOCK_K)
        k, v = k_ref[rows, :], v_ref[rows, :]  # [BK, D] each
        s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32)  # [BQ, BK]
        in_window = j * BLOCK_K + jnp.arange(BLOCK_K) < key_rows  # the last step may pass the window
        mask = (q_seg[:, None] == k_seg_ref[rows][None, :]) & in_window[None, :]
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + jnp.dot(
            p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32
        )
        return m_new, l * alpha + p.sum(axis=-1), acc

    init = (
        jnp.full((BLOCK_Q,), NEG_INF, jnp.float32),
        jnp.zeros((BLOCK_Q,), jnp.float32),
        jnp.zeros((BLOCK_Q, q.shape[-1]), jnp.float32),
    )
    _, l, acc = lax.fori_loop(0, -(-key_rows // BLOCK_K), step, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)  # exactly 0 without keys


def tile_attention(q, k, v, q_seg, k_seg, k_start, key_rows: int, *, interpret: bool = False):
    """Attention of query tiles against key windows that start at any row.

    Args:
      q: [T, Bq, H, Dh] query tiles (scaled and rotated), the operand dtype.
      k, v: [M, H, Dh] the shared key / value rows (finite).
      q_seg: int32 [T, Bq] segment of each query row (NO_KEY: attends to nothing).
      k_seg: int32 [M] segment of each key row (-1: padding).
      k_start: int32 [T] first key row of each tile's window (0 .. M - key_rows).
      key_rows: K, the rows of every window (static).
    Returns:
      float32 [T, Bq, H, Dh]; rows with no valid key are exactly 0.
    """
    t, bq, h, dh = q.shape
    d = max(16, pl.next_power_of_2(dh))
    bq_pad = -(-bq // BLOCK_Q) * BLOCK_Q
    q = jnp.pad(q, ((0, 0), (0, bq_pad - bq), (0, 0), (0, d - dh)))  # [T, Bq', H, D]
    q_seg = jnp.pad(q_seg, ((0, 0), (0, bq_pad - bq)), constant_values=NO_KEY)  # [T, Bq']
    k, v = (jnp.pad(x, ((0, BLOCK_K), (0, 0), (0, d - dh))) for x in (k, v))  # [M + BK, H, D]
    k_seg = jnp.pad(k_seg, (0, BLOCK_K), constant_values=-1)  # [M + BK]
    m = k.shape[0]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    out = pl.pallas_call(
        functools.partial(_kernel, key_rows=key_rows, precision=precision),
        out_shape=jax.ShapeDtypeStruct((t, bq_pad, h, d), jnp.float32),
        grid=(t, h, bq_pad // BLOCK_Q),
        in_specs=[
            pl.BlockSpec((None, BLOCK_Q, None, d), lambda i, j, r: (i, r, j, 0)),  # q: [BQ, D]
            pl.BlockSpec((m, None, d), lambda i, j, r: (0, j, 0)),  # k: the head's [M, D]
            pl.BlockSpec((m, None, d), lambda i, j, r: (0, j, 0)),  # v
            pl.BlockSpec((None, BLOCK_Q), lambda i, j, r: (i, r)),  # q_seg: [BQ]
            pl.BlockSpec((m,), lambda i, j, r: (0,)),  # k_seg: [M]
            pl.BlockSpec((1,), lambda i, j, r: (i,)),  # k_start: [1]
        ],
        out_specs=pl.BlockSpec((None, BLOCK_Q, None, d), lambda i, j, r: (i, r, j, 0)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # the Triton backend, not Mosaic GPU
        name="qvj_tile_attention",
    )(q, k, v, q_seg, k_seg, k_start.astype(jnp.int32))
    return out[:, :bq, :, :dh]  # [T, Bq, H, Dh]


def reference(q, k, v, q_seg, k_seg, k_start, key_rows: int):
    """`tile_attention` in plain JAX (gathers every window): for tests."""
    rows = k_start[:, None] + jnp.arange(key_rows)  # [T, K]
    s = jnp.einsum("tqhd,tkhd->thqk", q, k[rows], precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    mask = (q_seg[:, :, None] == k_seg[rows][:, None, :])[:, None]  # [T, 1, Bq, K]
    s = jnp.where(mask, s, NEG_INF)
    p = jnp.where(mask, jnp.exp(s - s.max(axis=-1, keepdims=True)), 0.0)
    o = jnp.einsum("thqk,tkhd->tqhd", p, v[rows].astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return o / jnp.maximum(p.sum(axis=-1), 1e-30).transpose(0, 2, 1)[..., None]
