"""Blockwise segment attention and window attention vs a naive dense masked reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.model.attention import apply_rotary, segment_attention, window_attention
from qwen_vit_jax.model.numerics import Numerics
from qwen_vit_jax.model.vit import rotary_cos_sin
from qwen_vit_jax.plan import kernels
from qwen_vit_jax.presets import QWEN2_5_VL_3B


def dense_reference(q, k, v, same):
    """float64 softmax(q k^T / sqrt(d)) v with an [N, N] boolean mask (test sizes only)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    s = np.where(same[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def attention_plan(n, block, key_rows, seg=None, tiles=None, tokens=None, ids=None, slot=None) -> planlib.Plan:
    """A Plan holding the given tables (the rest empty): what the attention functions read."""
    seg = np.full(n, -1, np.int32) if seg is None else seg
    tiles = np.zeros((4, n // block), np.int32) if tiles is None else tiles
    tokens = np.zeros((0, 0), np.int32) if tokens is None else tokens
    bucket = planlib.Bucket(n, tokens.shape[0], key_rows, block, tiles.shape[1], tokens.shape[1])
    return planlib.Plan(
        bucket,
        np.zeros((n, 2), np.int32),
        seg,
        tokens,
        tokens if ids is None else ids,
        np.zeros(n, np.int32) if slot is None else slot,
        *tiles,
        np.array([0, n, n], np.int32),
        np.zeros((0, 4), np.int32),
        np.zeros((0, 4), np.float32),
    )


def tile_table(lengths, n, block, key_rows, spare):
    """The plan's tiles (kernels.group_tiles) for frames of `lengths` rows in n rows, with key
    windows of `key_rows` rows and `spare` unused tiles at the end."""
    grid = np.array([[1, 1, int(x)] for x in lengths], np.int64)  # frames of any length
    starts = kernels.frame_starts(grid)
    first_block, last_block = kernels.frame_blocks(starts, block)
    nb = n // block
    extra = kernels.group_tiles(starts, first_block, last_block, nb, n, key_rows, np.empty((4, 0), np.int32))
    tiles = np.zeros((4, nb + extra + spare), np.int32)
    kernels.group_tiles(starts, first_block, last_block, nb, n, key_rows, tiles)
    return tiles, extra


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block", [16, 32])
def test_segment_attention_matches_dense(seed, block):
    """One tile per block over the union of its frames, one per (block, frame), anything between,
    spare empty tiles, key windows of any row count (a multiple of the block or not), wider
    windows (moved left at the end): all the same attention."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 70, size=rng.integers(1, 7))
    n_real = int(lengths.sum())
    n = -(-(n_real + int(rng.integers(0, 20))) // block) * block
    seg = np.full(n, -1, np.int32)  # padding rows
    seg[:n_real] = np.repeat(np.arange(len(lengths)), lengths)
    h, d = 3, 8
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(3))
    ref = dense_reference(q, k, v, seg[:, None] == seg[None, :])
    widest = int(lengths.max())  # K >= any frame's rows
    attend = jax.jit(segment_attention, static_argnums=4)
    for key_rows, spare in [(n, 0), (widest, 0), (widest, 3), (widest + 5, 1), (-(-widest // block) * block, 0)]:
        key_rows = min(key_rows, n)
        tiles, extra = tile_table(lengths, n, block, key_rows, spare)
        if key_rows == n:
            assert extra == 0
        for window in {key_rows, min(key_rows + block + 3, n)}:  # a wider window changes nothing
            wide = tiles.copy()
            wide[3] = np.minimum(wide[3], n - window)  # what devices.pad_plan does
            plan = attention_plan(n, block, window, seg, wide)
            out = np.asarray(attend(q, k, v, plan, Numerics("float32", tile_loops=True)))
            np.testing.assert_allclose(out[:n_real], ref[:n_real], rtol=2e-5, atol=2e-6)
            assert np.isfinite(out).all() and not out[n_real:].any()  # padding rows: zeros
            batched = attend(q, k, v, plan, Numerics("float32"))  # GPU / TPU
            np.testing.assert_allclose(np.asarray(batched), out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_window_attention_matches_dense(seed):
    """Random windows packed several to a slot (as the plan packs small edge windows)."""
    rng = np.random.default_rng(seed)
    slots, n_real = 16, int(rng.integers(20, 90))
    n = n_real + int(rng.integers(0, 8))
    order = rng.permutation(n_real)
    sizes = []
    while sum(sizes) < n_real:
        sizes.append(int(min(rng.integers(1, slots + 1), n_real - sum(sizes))))
    num_slots = len(sizes) + 2  # trailing empty slots, as a bucket pads them
    tokens = np.full((num_slots, slots), -1, np.int32)
    ids = np.full((num_slots, slots), -1, np.int32)
    slot = np.zeros(n, np.int32)
    window_of = np.full(n, -1)
    fill = np.zeros(num_slots, int)
    pos = 0
    for w, size in enumerate(sizes):
        s = next(i for i in range(num_slots) if fill[i] + size <= slots)  # first fit
        rows = order[pos : pos + size]
        entries = fill[s] + np.arange(size)
        tokens[s, entries], ids[s, entries] = rows, w
        slot[rows] = s * slots + entries
        window_of[rows] = w
        fill[s] += size
        pos += size
    h, d = 2, 16
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(3))
    same = (window_of[:, None] == window_of[None, :]) & (window_of[:, None] >= 0)
    np.fill_diagonal(same, True)
    ref = dense_reference(q, k, v, same)
    plan = attention_plan(n, 4, 1, tokens=tokens, ids=ids, slot=slot)
    attend = jax.jit(window_attention, static_argnums=4)
    out = np.asarray(attend(q, k, v, plan, Numerics("float32")))  # all heads at once (GPU / TPU)
    loops = np.asarray(attend(q, k, v, plan, Numerics("float32", tile_loops=True)))  # a head at a time (CPU)
    np.testing.assert_allclose(loops, out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[:n_real], ref[:n_real], rtol=2e-5, atol=2e-6)
    assert np.isfinite(out).all() and np.isfinite(loops).all()


def test_bf16_numerics_accumulate_in_float32():
    num = Numerics("bfloat16")
    a = jnp.ones((4, 4096), jnp.float32)
    out = num.einsum("ik,jk->ij", a, a)  # a bfloat16 accumulator would stall at 256
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), 4096.0)
    with pytest.raises(ValueError, match="dtype"):
        Numerics("float16")


@pytest.mark.parametrize("tile_loops", [True, False], ids=["cpu", "batched"])
@pytest.mark.parametrize("attend", [window_attention, segment_attention], ids=["window", "segment"])
def test_rotary_inside_attention_equals_rotating_first(attend, tile_loops):
    """`rotary=(cos, sin)` rotates q and k where each schedule reads them (the CPU schedules inside
    their per-head gathers): the same numbers as rotating [N, H, Dh] first, up to float32 rounding
    (XLA may fuse the rotation's multiply-adds differently)."""
    cfg = dataclasses.replace(QWEN2_5_VL_3B, num_heads=2, width=32)
    plan = jax.device_put(planlib.make_plans([[2, 10, 12], [1, 8, 8]], cfg)[0])
    n, h, dh = plan.bucket.patches, cfg.num_heads, cfg.head_dim
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((n, h, dh)), jnp.float32) for _ in range(3))
    cos, sin = rotary_cos_sin(jnp.asarray(plan.pos_ids), dh, cfg.rope_theta)
    num = Numerics("float32", tile_loops=tile_loops)
    rotated = [apply_rotary(x, cos[:, None], sin[:, None]) for x in (q, k)]
    ref = jax.jit(lambda *a: attend(*a, plan, num))(*rotated, v)
    out = jax.jit(lambda *a: attend(*a, plan, num, rotary=(cos, sin)))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grid", [[[1, 36, 30]], [[1, 10, 14]], [[1, 6, 6], [1, 4, 4]]], ids=["image", "small", "two"])
@pytest.mark.parametrize("tight", [True, False], ids=["tight", "ladder"])
def test_buckets_whose_tiles_cover_them_match_dense(grid, tight):
    """Real plans whose tiles each cover the whole bucket (K = N, one tile per block: one image in
    frame-sized blocks, tight or on its rung; small frames whose union K covers): both schedules,
    rotary inside, equal the dense masked reference; padding rows get zeros."""
    cfg = dataclasses.replace(QWEN2_5_VL_3B, num_heads=2, width=32)
    plan = jax.device_put(planlib.make_plans(grid, cfg, planlib.BucketPolicy(tight=tight))[0])
    b = plan.bucket
    assert b.key_rows == b.patches and b.tiles == b.patches // b.block
    n, h, dh, real = b.patches, cfg.num_heads, cfg.head_dim, plan.n_patches
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((n, h, dh)), jnp.float32) for _ in range(3))
    cos, sin = rotary_cos_sin(jnp.asarray(plan.pos_ids), dh, cfg.rope_theta)
    seg = np.asarray(plan.segment_ids)
    rotated = [np.asarray(apply_rotary(x, cos[:, None], sin[:, None])) for x in (q, k)]
    ref = dense_reference(*rotated, v, seg[:, None] == seg[None, :])  # compared on the real rows
    for tile_loops in (True, False):
        num = Numerics("float32", tile_loops=tile_loops)
        out = np.asarray(jax.jit(lambda *a, num=num: segment_attention(*a, plan, num, rotary=(cos, sin)))(q, k, v))
        np.testing.assert_allclose(out[:real], ref[:real], rtol=2e-5, atol=2e-6)
        assert not out[real:].any()
