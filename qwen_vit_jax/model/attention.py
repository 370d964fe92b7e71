"""Attention on static shapes: window attention and per-frame (segment) attention.

Both take q, k, v for the packed batch in the original row order and the host plan's
tables (qwen_vit_jax.plan). Neither ever builds an [N, N] mask:

- window attention gathers windows into slots of `window_patches` (64) rows (small edge
  windows share a slot), attends densely inside each slot under a same-window mask and
  gathers the results back: cost ~ num_slots * 64 * 64 ~ sum(window_len * 64).
- segment attention runs tiles from the plan: a query block of `bucket.block` rows restricted
  to a run of its frames, against a window of `bucket.key_rows` key rows holding those frames
  (starting at any row), as plain 2-D dots per (head, tile): cost ~ sum(frame_len^2) (plus block
  rounding), memory linear in N.

Segments are isolated even from non-finite values: a NaN or Inf in one image never reaches
another image's output (`_finite`).

Both apply the 2-D rotary embedding to q and k themselves (`rotary`), where their schedule reads
them: window attention on CPU inside each head's slot gathers (no pass of its own over
[N, H, Dh]); segment attention in one pass before its loops, which then read each head as one
contiguous [N, Dh] slab.

On GPUs and TPUs the attention core can run in the platform's Pallas kernel instead
(`Numerics.attention`: attention_gpu.py, attention_tpu.py), with the same inputs and outputs.

Softmax statistics are always float32. `Numerics.dtype` is the dtype of the matmul
operands; products accumulate in float32 (preferred_element_type).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from qwen_vit_jax.model.numerics import Numerics
from qwen_vit_jax.plan import Plan

# A finite "minus infinity": a fully masked row then gives exp(0) * 0 = 0, never NaN.
NEG_INF = -1e30
Rotary = tuple[jax.Array, jax.Array]  # (cos, sin) tables, each [N, Dh] float32 (model.rotary_cos_sin)


def _finite(v: jax.Array) -> jax.Array:
    """v with non-finite entries zeroed, for the probability-times-value products.

    A masked probability is exactly 0, but 0 * NaN = NaN: without this, a NaN or Inf row of one
    image (or window) would reach every query whose dot product spans its key row, i.e. other
    images of the same slot or key window. A row's own segment still sees its non-finite keys
    through the scores (q.k is NaN there), so a bad image stays visibly bad; finite values pass
    unchanged, so results are bitwise the same for clean inputs.
    """
    return jnp.where(jnp.isfinite(v), v, 0.0)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin (HF's rotate_half layout), float32.

    x: [..., Dh]; cos, sin: broadcast against x (e.g. [N, Dh] tables for x [N, Dh], or [N, 1, Dh]
    for x [N, H, Dh])."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def window_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, plan: Plan, num: Numerics, rotary: Rotary | None = None
) -> jax.Array:
    """Attention inside windows, packed into slots of S rows (several small windows may share
    a slot; a row attends to the rows of its own window only).

    With `num.tile_loops` (CPU) the heads run one after another, each as dots batched over the
    slots ([W, S, Dh] x [W, Dh, S]) whose rows are gathered straight from [N, H, Dh] (no head-major
    copies of q, k, v): XLA's CPU backend runs those faster than one dot batched over slots and
    heads (bench_profile.py `attn`, retired: benchmarks/history.md); otherwise (GPU / TPU) all heads at once. The same
    arithmetic either way.

    Args:
      q, k, v: [N, H, Dh] rows in original order.
      rotary: (cos, sin), each [N, Dh]: rotate q and k here (None: they are rotated already).
      plan: window_tokens [W, S] (the row held by each slot entry, -1 for an empty entry),
        window_ids [W, S] (the window each slot entry belongs to, -1 for an empty entry),
        window_slot [N] (the flat slot entry w * S + j holding each row).
    Returns:
      [N, H, Dh] float32. Rows in no window (padding) get an arbitrary finite value.
    """
    if num.attention != "xla":
        return _windows_by_kernel(q, k, v, plan, num, rotary)
    window_tokens, window_ids = plan.window_tokens, plan.window_ids
    num_slots, slots = window_tokens.shape
    scale = q.shape[-1] ** -0.5
    rows = jnp.maximum(window_tokens, 0)
    same = (window_ids[:, :, None] == window_ids[:, None, :]) & (window_ids[:, None, :] >= 0)  # [W, S, S]
    v = _finite(v)

    if num.tile_loops:
        tables = None if rotary is None else (rotary[0][rows], rotary[1][rows])  # [W, S, Dh] each

        def gather(x, h):  # head h's slot rows of x, rotated: [W, S, Dh]
            return x[rows, h] if tables is None else apply_rotary(x[rows, h], *tables)

        def head(h):  # one head, gathered straight from [N, H, Dh] -> [N, Dh]
            s = num.einsum("wqd,wkd->wqk", gather(q, h) * scale, gather(k, h))  # [W, S, S]
            p = jax.nn.softmax(jnp.where(same, s, NEG_INF), axis=-1)
            o = num.einsum("wqk,wkd->wqd", p, v[rows, h])  # [W, S, Dh]
            return o.reshape(num_slots * slots, -1)[plan.window_slot]  # [W*S, Dh] -> [N, Dh]

        out = lax.map(head, jnp.arange(q.shape[1]))  # [H, N, Dh]
        return out.transpose(1, 0, 2)  # [N, H, Dh]

    if rotary is not None:
        q, k = (apply_rotary(x, rotary[0][:, None], rotary[1][:, None]) for x in (q, k))
    qw, kw, vw = q[rows] * scale, k[rows], v[rows]  # [W, S, H, Dh]
    s = num.einsum("wqhd,wkhd->whqk", qw, kw)  # [W, H, S, S]
    s = jnp.where(same[:, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    o = num.einsum("whqk,wkhd->wqhd", p, vw)  # [W, S, H, Dh]
    o = o.reshape(num_slots * slots, *o.shape[2:])  # [W*S, H, Dh]
    return o[plan.window_slot]  # [N, H, Dh]


def segment_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, plan: Plan, num: Numerics, rotary: Rotary | None = None
) -> jax.Array:
    """Attention within segments (frames) over the plan's tiles of query blocks.

    Row r attends to row s iff segment_ids[r] == segment_ids[s]. The rows are cut into NB query
    blocks of B = plan.bucket.block rows; a tile is one query block restricted to a run of
    consecutive frames (rows of other frames get exactly zero from it) and needs only the keys of
    those frames: the K = plan.bucket.key_rows rows of its window, from row tile_key_start (any
    row, so a frame that starts mid-block costs no more keys than its own rows, rounded to K).
    Tiles 0..NB-1 are the blocks themselves (tile i: block i); extra tiles NB..T-1 are further
    frame runs of blocks that straddle frames, added to their block's rows. So a block straddling
    two long frames costs two tiles of about one frame's keys each, not one tile over both frames.

    Two schedules of the same attention:
    - `num.tile_loops` (CPU): loops over heads, then tiles; each tile attends to its window with a
      plain softmax. Every matmul is a 2-D dot ([B, Dh] x [Dh, K], [B, K] x [K, Dh]), which XLA's
      CPU backend runs faster than batched dots (3-4x: benchmarks/history.md, "One-frame full
      attention" and "Experiments (bench_profile.py ...)"); the live scores are one tile's.
    - otherwise (GPU / TPU): all tiles and heads at once as batched dots, the window in steps of B
      key rows with an online softmax: the live scores are [T, H, B, B], linear in N.

    Args:
      q, k, v: [N, H, Dh]; N = NB * B.
      rotary: (cos, sin), each [N, Dh]: rotate q and k here (None: they are rotated already).
      plan: segment_ids [N] (-1 for padding rows) and the tile table (tile_block, tile_first_frame,
        tile_last_frame, tile_key_start, each [T]); see `Plan`.
    Returns:
      [N, H, Dh] float32. Padding rows get zeros.
    """
    n, h, dh = q.shape
    nb = n // plan.bucket.block
    v = _finite(v)
    if num.attention != "xla":
        out = _tiles_by_kernel(q, k, v, plan, num, rotary)  # [H, T, B, Dh]
    else:
        if rotary is not None:
            q, k = (apply_rotary(x, rotary[0][:, None], rotary[1][:, None]) for x in (q, k))
        qkv = (x.transpose(1, 0, 2) for x in (q * dh**-0.5, k, v))  # [H, N, Dh] each
        out = (_tile_loops if num.tile_loops else _tiles_batched)(*qkv, plan, num)  # [H, T, B, Dh]
    if plan.bucket.tiles > nb:  # each row is in exactly one tile: adding the others' zeros is exact
        out = out[:, :nb].at[:, plan.tile_block[nb:]].add(out[:, nb:])  # [H, NB, B, Dh]
    return out.reshape(h, n, dh).transpose(1, 0, 2)  # [H, N, Dh] -> [N, H, Dh]


def _tile_loops(qh, kh, vh, plan: Plan, num: Numerics):
    """segment_attention's CPU schedule. qh / kh / vh: [H, N, Dh] float32 (q rotated and scaled, k
    rotated: one contiguous slab per head, rounded to the operand dtype per tile by the dots, so
    the gradients that several tiles send to one key row add up in float32) -> [H, T, B, Dh]."""
    block, window = plan.bucket.block, plan.bucket.key_rows
    nb = qh.shape[1] // block
    segment_ids = plan.segment_ids
    seg = segment_ids.reshape(nb, block)  # [NB, B]

    def tile(qx, kx, vx, t_blk, first, last, r0):  # one head: [N, Dh] each -> [B, Dh]
        sq = seg[t_blk]  # [B]
        sk = lax.dynamic_slice_in_dim(segment_ids, r0, window)  # [K]
        mask = (sq[:, None] == sk[None, :]) & ((sq >= first) & (sq <= last))[:, None]  # [B, K]
        qt = lax.dynamic_slice_in_dim(qx, t_blk * block, block)  # [B, Dh]
        s = num.einsum("qd,kd->qk", qt, lax.dynamic_slice_in_dim(kx, r0, window))  # [B, K]
        s = jnp.where(mask, s, NEG_INF)
        p = jnp.where(mask, jnp.exp(s - s.max(axis=-1, keepdims=True)), 0.0)
        o = num.einsum("qk,kd->qd", p, lax.dynamic_slice_in_dim(vx, r0, window))  # [B, Dh]
        return o / jnp.maximum(p.sum(axis=-1, keepdims=True), 1e-30)  # exactly 0 outside the tile

    tiles = (plan.tile_block, plan.tile_first_frame, plan.tile_last_frame, plan.tile_key_start)  # [T] each
    return lax.map(lambda x: lax.map(lambda a: tile(*x, *a), tiles), (qh, kh, vh))  # [H, T, B, Dh]


def _tiles_batched(qh, kh, vh, plan: Plan, num: Numerics):
    """segment_attention's batched schedule. qh / kh / vh: [H, N, Dh] -> [H, T, B, Dh]."""
    block, window = plan.bucket.block, plan.bucket.key_rows
    h, n, dh = qh.shape
    nb = n // block
    t_block = plan.tile_block  # [T]
    qt = qh.reshape(h, nb, block, dh)[:, t_block]  # [H, T, B, Dh]
    seg = plan.segment_ids.reshape(nb, block)  # [NB, B]
    seg_q = seg[t_block]  # [T, B]
    in_tile = (seg_q >= plan.tile_first_frame[:, None]) & (seg_q <= plan.tile_last_frame[:, None])  # [T, B]

    def step(j, carry):  # key rows j * B .. j * B + B - 1 of every tile's window
        m, l, acc = carry  # [H, T, B], [H, T, B], [H, T, B, Dh]
        offset = j * block + jnp.arange(block)  # [B] rows into the window
        rows = jnp.minimum(plan.tile_key_start[:, None] + offset, n - 1)  # [T, B]; clamped rows are masked
        s = num.einsum("htqd,htkd->htqk", qt, kh[:, rows])  # [H, T, B, B]
        same = seg_q[:, :, None] == plan.segment_ids[rows][:, None, :]  # [T, B, B]
        mask = same & in_tile[:, :, None] & (offset < window)[None, None, :]  # [T, B, B]
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + num.einsum("htqk,htkd->htqd", p, vh[:, rows])
        return m_new, l, acc

    # The carries derive from qt (not jnp.zeros): under shard_map (several devices) they must vary
    # over the mesh axis like the values the loop adds to them.
    zeros = jnp.zeros_like(qt, dtype=jnp.float32)  # [H, T, B, Dh]
    init = (jnp.full_like(zeros[..., 0], NEG_INF), zeros[..., 0], zeros)
    _, l, acc = lax.fori_loop(0, -(-window // block), step, init)  # ceil(K / B) steps
    return acc / jnp.maximum(l, 1e-30)[..., None]  # exactly 0 on rows outside their tile


# ---- the platforms' kernels (Numerics.attention): the same problem as one kernel call ----------


def _kernel_inputs(q, k, v, num: Numerics, rotary: Rotary | None):
    """q (rotated, scaled), k (rotated), v as the kernels take them: [N, H, Dh] in the operand dtype
    (float32 stays float32; bf16 mode rounds the operands as `Numerics.einsum` does)."""
    if rotary is not None:
        q, k = (apply_rotary(x, rotary[0][:, None], rotary[1][:, None]) for x in (q, k))
    dtype = jnp.float32 if num.dtype == "float32" else jnp.bfloat16
    return (x.astype(dtype) for x in (q * q.shape[-1] ** -0.5, k, v))


def _tile_kernel(num: Numerics):
    """The platform kernel's `tile_attention` (attention_gpu / attention_tpu: one contract)."""
    if num.attention == "triton":
        from qwen_vit_jax.model.attention_gpu import tile_attention
    else:
        from qwen_vit_jax.model.attention_tpu import tile_attention
    return functools.partial(tile_attention, interpret=num.interpret)


def _windows_by_kernel(q, k, v, plan: Plan, num: Numerics, rotary: Rotary | None) -> jax.Array:
    """window_attention by the platform kernel: each slot is a tile whose key window is itself;
    the window ids are the segments (an empty entry attends to nothing). -> [N, H, Dh] float32."""
    from qwen_vit_jax.model.attention_gpu import NO_KEY

    q, k, v = _kernel_inputs(q, k, _finite(v), num, rotary)
    rows, ids = jnp.maximum(plan.window_tokens, 0), plan.window_ids  # [W, S] each
    num_slots, slots = rows.shape
    n, h, dh = q.shape
    keys, values = (x[rows].reshape(num_slots * slots, h, dh) for x in (k, v))  # [W*S, H, Dh]
    out = _tile_kernel(num)(
        q[rows], keys, values, jnp.where(ids >= 0, ids, NO_KEY), ids.reshape(-1), jnp.arange(num_slots) * slots, slots
    )  # [W, S, H, Dh]
    return out.reshape(num_slots * slots, h, dh)[plan.window_slot]  # [N, H, Dh]


def _tiles_by_kernel(q, k, v, plan: Plan, num: Numerics, rotary: Rotary | None) -> jax.Array:
    """segment_attention's tiles by the platform kernel: a tile's query rows outside its run of
    frames attend to nothing (exactly 0, as the XLA schedules give). -> [H, T, B, Dh] float32."""
    from qwen_vit_jax.model.attention_gpu import NO_KEY

    q, k, v = _kernel_inputs(q, k, v, num, rotary)
    n, h, dh = q.shape
    block = plan.bucket.block
    nb = n // block
    qt = q.reshape(nb, block, h, dh)[plan.tile_block]  # [T, B, H, Dh]
    seg = plan.segment_ids.reshape(nb, block)[plan.tile_block]  # [T, B]
    in_tile = (seg >= plan.tile_first_frame[:, None]) & (seg <= plan.tile_last_frame[:, None])  # [T, B]
    out = _tile_kernel(num)(
        qt, k, v, jnp.where(in_tile, seg, NO_KEY), plan.segment_ids, plan.tile_key_start, plan.bucket.key_rows
    )  # [T, B, H, Dh]
    return out.transpose(2, 0, 1, 3)  # [H, T, B, Dh]
