"""The plan package: HF-exact index functions, plan invariants, window packing, bucket ladders, request
splitting, grid validation."""

import dataclasses
import itertools
import pathlib
import re

import jax
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import vision_utils as hf

from qwen_vit_jax.plan import (
    BucketPolicy,
    BufferPool,
    Plan,
    assembly,
    batch_key_rows,
    batch_rows,
    chunk_penalty,
    clear_caches,
    coarse_ladder_value,
    frame_class,
    frame_cu_seqlens,
    make_batch_plan,
    make_plan,
    make_plans,
    rotary_ids,
    segment_lengths,
    split_grid,
    typical_windows,
    validate_grid,
    window_index,
    worst_windows,
)
from qwen_vit_jax.presets import QWEN2_5_VL_3B, QWEN2_VL_2B

WIN56 = dataclasses.replace(QWEN2_5_VL_3B, window_size=56)
WINDOWED = [QWEN2_5_VL_3B, WIN56]

_rng = np.random.default_rng(0)
GRIDS = {
    "1x8x8": [[1, 8, 8]],
    "1x36x36": [[1, 36, 36]],
    "10x36x36": [[10, 36, 36]],
    "ten_videos": [[10, 36, 36]] * 10,
    "ten_jittered": [[10, 36 + 2 * int(a), 36 + 2 * int(b)] for a, b in _rng.integers(-1, 2, (10, 2))],
    "1x2x2": [[1, 2, 2]],
    "1x16x16_even": [[1, 16, 16]],  # sides divide evenly: HF's empty-window path
    "2x10x18": [[2, 10, 18]],
    "1x2x64": [[1, 2, 64]],
    "1x64x2": [[1, 64, 2]],
    "mixed": [[1, 2, 2], [3, 16, 24], [1, 34, 6]],
}

grids_st = st.lists(
    st.tuples(st.integers(1, 3), st.integers(1, 20).map(lambda v: 2 * v), st.integers(1, 20).map(lambda v: 2 * v)),
    min_size=1,
    max_size=4,
)


def tile_table(plan: Plan) -> np.ndarray:
    """int32 [4, T]: the plan's tile fields stacked (block, first frame, last frame, key window
    start)."""
    return np.stack([plan.tile_block, plan.tile_first_frame, plan.tile_last_frame, plan.tile_key_start])


def hf_reference(grid, cfg):
    g = torch.tensor(grid)
    wi, cu = hf.get_vision_window_index(g, cfg.spatial_merge_size, cfg.window_size, cfg.patch_size)
    return (
        hf.get_vision_position_ids(g, cfg.spatial_merge_size).numpy(),
        hf.get_vision_cu_seqlens(g).numpy(),
        wi.numpy(),
        cu.numpy(),
    )


def assert_hf_exact(grid, cfg):
    pos, cu, wi, wcu = hf_reference(grid, cfg)
    np.testing.assert_array_equal(rotary_ids(grid, cfg), pos)
    np.testing.assert_array_equal(frame_cu_seqlens(grid), cu)
    ours_wi, ours_wcu = window_index(grid, cfg)
    assert ours_wi.dtype == np.int64 and ours_wcu.dtype == np.int32
    np.testing.assert_array_equal(ours_wi, wi)
    np.testing.assert_array_equal(ours_wcu, wcu)


def check_plan(plan, grid, cfg, policy, batch=False):
    """Every documented Plan invariant, derived independently of the plan kernels (`batch`: of a
    make_batch_plan plan)."""
    bk = plan.bucket
    cu = hf.get_vision_cu_seqlens(torch.tensor(grid)).numpy().astype(np.int64)
    n, n_pad = int(cu[-1]), bk.patches
    b = bk.block
    nb = n_pad // b
    assert plan.n_patches == n
    one_frame = len(cu) == 2
    if batch:
        assert n_pad == batch_rows(n, policy) and n_pad >= n and b == policy.block_size(n_pad)
    else:
        assert n_pad == policy.rung(n) and n_pad >= n and n_pad in policy.rungs(n)
        assert b == policy.block_size(n_pad, one_frame)
    assert n_pad % b == 0 and b % 4 == 0
    assert nb == -(-n_pad // policy.block) or (one_frame and b <= policy.frame_block)
    np.testing.assert_array_equal(plan.grid_thw, np.asarray(grid))
    arrays = jax.tree.leaves(plan)
    assert [type(a) for a in arrays] == [np.ndarray] * len(Plan.ARRAYS)
    abstract = Plan.abstract(bk)
    assert jax.tree.structure(abstract) == jax.tree.structure(plan)
    assert [a.shape for a in arrays] == [a.shape for a in jax.tree.leaves(abstract)]
    assert bk.window_rows == cfg.window_patches and plan.window_tokens.shape == (bk.windows, cfg.window_patches)
    assert plan.tile_block.shape == (bk.tiles,)
    assert [a.dtype for a in arrays] == [a.dtype for a in jax.tree.leaves(abstract)]
    assert all(
        a.dtype == (np.float32 if k == "pos_embed_weight" else np.int32) and not a.flags.writeable
        for k, a in zip(Plan.ARRAYS, arrays)
    )
    assert not plan.grid_thw.flags.writeable

    np.testing.assert_array_equal(plan.pos_ids[:n], rotary_ids(grid, cfg))
    assert not plan.pos_ids[n:].any()
    frames = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    np.testing.assert_array_equal(plan.segment_ids, np.concatenate([frames, np.full(n_pad - n, -1)]))

    check_tiles(tile_table(plan), cu, n, b, nb, bk, batch=batch)

    tok, ids, slot = plan.window_tokens, plan.window_ids, plan.window_slot
    if not cfg.windowed:
        assert bk.windows == 0 and tok.shape[0] == 0 and ids.shape[0] == 0 and not slot.any()
        return
    check_packing(tok, ids, slot, grid, cfg, n, n_pad)


def check_tiles(tiles, cu, n, b, nb, bk, tight=False, batch=False):
    """Full-attention tiles: tile i is block i; every (block, frame with rows in it) pair is in
    exactly one tile of that block; a tile's key window (K rows from its start, inside the bucket)
    holds all rows of its frames and starts at its first frame (or as near as the bucket allows);
    never more work (T * K) than one tile per block over the union of its frames; a batch plan:
    one tile per block, K = batch_key_rows of its widest frame's class."""
    assert tiles.shape == (4, bk.tiles) and bk.tiles >= nb
    t_block, first, last, start = tiles.astype(np.int64)
    k_rows = bk.key_rows
    assert 1 <= k_rows <= bk.patches and ((0 <= start) & (start <= bk.patches - k_rows)).all()
    np.testing.assert_array_equal(t_block[:nb], np.arange(nb))
    fb0, fb1 = cu[:-1] // b, (cu[1:] - 1) // b  # blocks of each frame
    used = first <= last
    extra = int(used[nb:].sum())
    assert used[nb : nb + extra].all() and np.all(np.diff(t_block[nb : nb + extra]) >= 0)  # used extras first, in order
    assert bk.tiles == nb + (extra if tight else coarse_ladder_value(extra))
    assert (start[~used] == 0).all()
    for t in np.flatnonzero(used):
        frames = np.arange(first[t], last[t] + 1)
        assert ((fb0[frames] <= t_block[t]) & (t_block[t] <= fb1[frames])).all()  # all in the block
        assert start[t] == min(cu[first[t]], bk.patches - k_rows) and cu[last[t] + 1] <= start[t] + k_rows
    for blk in range(nb):
        frames = np.flatnonzero((fb0 <= blk) & (blk <= fb1))
        mine = np.flatnonzero(used & (t_block == blk))
        cover = [int(((first[mine] <= f) & (f <= last[mine])).sum()) for f in frames]
        assert cover == [1] * len(frames)
        assert (len(frames) > 0) == used[blk]  # a pure-padding block: an empty tile
    if batch:
        assert bk.tiles == nb and k_rows == batch_key_rows(bk.patches, b, frame_class(int(np.diff(cu).max())))
        return
    in_block = [(fb0 <= blk) & (blk <= fb1) for blk in range((n - 1) // b + 1)]  # frames with rows in each block
    union = max(int(cu[1:][f].max() - cu[:-1][f].min()) for f in in_block)  # rows of a block's frames
    one_per_block = -(-union // 16) * 16 if tight else b * coarse_ladder_value(-(-union // b))
    assert bk.tiles * k_rows <= nb * min(one_per_block, bk.patches)


def check_packing(tok, ids, slot, grid, cfg, n, n_pad):
    _, _, wi, wcu = hf_reference(grid, cfg)
    s, mu = cfg.window_patches, cfg.merge_unit
    wlen = np.diff(wcu)
    n_win = len(wlen)
    valid = tok >= 0
    np.testing.assert_array_equal(valid, ids >= 0)
    fill = valid.sum(1)
    assert (valid == (np.arange(s) < fill[:, None])).all()  # filled entries first, then -1
    used = int((fill > 0).sum())
    assert (fill[:used] > 0).all() and not fill[used:].any()  # used slots first
    # W_pad: typical(N_pad) whenever the packing fits it, else the proven worst-case bound.
    w_pad = tok.shape[0]
    assert used <= w_pad
    typical = typical_windows(n_pad, cfg)
    assert w_pad == (typical if used <= typical else worst_windows(n_pad, cfg))
    assert used <= worst_windows(n_pad, cfg)
    assert (fill[:used] <= s // 2).sum() <= 1  # best-fit decreasing: at most one slot half full or less

    # Each real row in exactly one slot entry; window_slot is the inverse of window_tokens.
    np.testing.assert_array_equal(np.sort(tok[valid]), np.arange(n))
    ww, jj = np.nonzero(valid)
    np.testing.assert_array_equal(slot[tok[valid]], ww * s + jj)
    assert not slot[n:].any()

    # Windows: all rows of window w in one slot, contiguous, HF order within the window; taken by
    # id they reproduce HF's window_index expanded to rows.
    flat_pos = np.flatnonzero(valid.ravel())
    wid = ids.ravel()[flat_pos]
    assert set(wid.tolist()) == set(range(n_win))
    order = np.argsort(wid, kind="stable")
    pos_by_window, wid_sorted = flat_pos[order], wid[order]
    np.testing.assert_array_equal(wid_sorted, np.repeat(np.arange(n_win), wlen))
    starts = np.concatenate([[0], np.cumsum(wlen)[:-1]])
    first = np.repeat(pos_by_window[starts], wlen)
    np.testing.assert_array_equal(pos_by_window - first, np.arange(n) - np.repeat(starts, wlen))  # contiguous
    assert ((pos_by_window // s) == (first // s)).all()  # one slot per window
    np.testing.assert_array_equal(tok.ravel()[pos_by_window], (wi[:, None] * mu + np.arange(mu)).ravel())
    # Inside a slot, windows follow HF order.
    for row_ids, f in zip(ids[:used], fill[:used]):
        assert (np.diff(row_ids[:f]) >= 0).all()
    # Best-fit decreasing, replayed from the window lengths (longest first, stable): each window sits
    # in a slot whose room was the least that fits it, and a new slot opens only when none fits.
    rooms = []
    for w in sorted(range(n_win), key=lambda w: -wlen[w]):
        got = int(pos_by_window[starts[w]] // s)
        fits = [r for r in rooms if r >= wlen[w]]
        if fits:
            assert got < len(rooms) and rooms[got] == min(fits)
        else:
            assert got == len(rooms)
            rooms.append(s)
        rooms[got] -= wlen[w]
    assert len(rooms) == used


# ---- HF exactness ----------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", WINDOWED, ids=["win112", "win56"])
@pytest.mark.parametrize("name", list(GRIDS))
def test_hf_exact_fixed(name, cfg):
    assert_hf_exact(GRIDS[name], cfg)


@settings(max_examples=50, deadline=None)
@given(grid=grids_st, cfg=st.sampled_from(WINDOWED))
def test_hf_exact_random(grid, cfg):
    assert_hf_exact(grid, cfg)


def test_rotary_and_cu_for_non_windowed():
    grid = [[2, 12, 8], [1, 4, 4]]
    pos, cu, _, _ = hf_reference(grid, QWEN2_5_VL_3B)
    np.testing.assert_array_equal(rotary_ids(grid, QWEN2_VL_2B), pos)
    np.testing.assert_array_equal(frame_cu_seqlens(grid), cu)
    with pytest.raises(ValueError, match="windowed"):
        window_index(grid, QWEN2_VL_2B)


# ---- plan invariants ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(GRIDS))
def test_plan_invariants_fixed(name):
    check_plan(make_plan(GRIDS[name], QWEN2_5_VL_3B), GRIDS[name], QWEN2_5_VL_3B, BucketPolicy())


@settings(max_examples=60, deadline=None)
@given(
    grid=grids_st,
    cfg=st.sampled_from(WINDOWED + [QWEN2_VL_2B]),
    block=st.sampled_from([4, 8, 32, 128]),
    per_octave=st.sampled_from([1, 2, 4]),
)
def test_plan_invariants_random(grid, cfg, block, per_octave):
    policy = BucketPolicy(block=block, per_octave=per_octave)
    check_plan(make_plan(grid, cfg, policy), grid, cfg, policy)


# Frames made of windows just over half a slot: the packing exceeds typical(N_pad) and takes the
# worst-case W_pad (best-fit decreasing leaves at most one slot half empty).
@pytest.mark.parametrize(
    "grid, cfg",
    [
        ([[40, 6, 6]], QWEN2_5_VL_3B),  # one 36-row window per frame
        ([[3, 6, 6], [1, 14, 14], [5, 6, 14]], QWEN2_5_VL_3B),  # 36- and 48-row windows
        ([[30, 2, 2], [2, 30, 30]], WIN56),
    ],
)
def test_window_packing_pathological(grid, cfg):
    plan = make_plan(grid, cfg)
    check_plan(plan, grid, cfg, BucketPolicy())
    if grid == [[40, 6, 6]]:
        n_pad = plan.bucket.patches
        assert plan.bucket.windows == worst_windows(n_pad, cfg) > typical_windows(n_pad, cfg)


@pytest.mark.parametrize("cfg", WINDOWED + [QWEN2_VL_2B], ids=["win112", "win56", "qwen2vl"])
def test_single_images_bucket_depends_on_patches_only(cfg):
    """Every single image h, w even in [2, 64]: W_pad == typical(N_pad) and K == N_pad, so
    the bucket is a function of N_pad and a stream of images compiles at most one program per rung."""
    policy = BucketPolicy()
    by_rung = {}
    for h in range(2, 65, 2):
        for w in range(2, 65, 2):
            bk = make_plan([[1, h, w]], cfg, policy).bucket
            assert bk.windows == typical_windows(bk.patches, cfg)
            assert bk.key_rows == bk.patches and bk.tiles == bk.patches // bk.block
            assert by_rung.setdefault(bk.patches, bk) == bk
    assert sorted(by_rung) == policy.rungs(64 * 64)  # 16 .. 4096: every rung is hit


def test_window_packing_examples():
    plan = make_plan([[1, 36, 36]], QWEN2_5_VL_3B)  # 16 full windows, 8 of 32 rows, 1 of 16
    fill = (plan.window_tokens >= 0).sum(1)
    assert fill.tolist() == [64] * 20 + [16] + [0] * 8
    assert plan.bucket.windows == typical_windows(1536, QWEN2_5_VL_3B) == 29
    # The 32-row edge windows pair up in HF order: windows 4 and 9 (right column) share slot 16.
    assert sorted(set(plan.window_ids[16].tolist()) - {-1}) == [4, 9]


def test_padding_tail_does_not_inflate_key_rows():
    plan = make_plan([[2, 24, 24]], QWEN2_5_VL_3B)  # N = 1152 -> N_pad = 1280: block 9 is pure padding
    assert plan.bucket.patches == 1280 and plan.bucket.block == 128 and plan.bucket.tiles == 10 + 1
    block, first, last, start = tile_table(plan)
    assert (first > last)[9] and start[9] == 0 and (first <= last)[:9].all()
    # K = 128 * coarse(ceil(576 / 128) = 5) = 768 from the frames, not the bucket; frame 1's window
    # (from row 576) moves left to end at the last row.
    assert plan.bucket.key_rows == 768 and set(start[first == 1].tolist()) == {1280 - 768}


def test_one_frame_blocks():
    """A chunk that is one frame gets blocks of up to frame_block rows; tight rows fit them exactly."""
    plan = make_plan([[1, 36, 36]], QWEN2_5_VL_3B)  # 1296 rows in the 1536 rung: 3 blocks of 512
    assert (plan.bucket.patches, plan.bucket.block, plan.bucket.tiles, plan.bucket.key_rows) == (1536, 512, 3, 1536)
    tight = make_plan([[1, 36, 36]], QWEN2_5_VL_3B, BucketPolicy(tight=True))  # 3 blocks of 432: no padding
    assert (tight.bucket.patches, tight.bucket.block, tight.bucket.tiles, tight.bucket.key_rows) == (1296, 432, 3, 1296)
    policy = BucketPolicy()
    for r in policy.rungs(16384):
        b = policy.block_size(r, one_frame=True)
        assert r % b == 0 and b % 4 == 0 and b <= policy.frame_block and r // b <= -(-r // policy.block)


def test_multi_frame_tiles():
    # Frames of 1296 rows need 11 blocks of keys (a block straddling two frames would need 21);
    # the 8 blocks straddling two frames (frame 8 starts at row 10368 = 81 * 128) get one tile per
    # frame: 8 extra tiles, every window K = 128 * coarse(11) = 1536 rows from its frame's first row.
    plan = make_plan([[10, 36, 36]], QWEN2_5_VL_3B)
    block, first, last, start = tile_table(plan)
    straddling = [i for i in range(102) if (i * 128) // 1296 != min(i * 128 + 127, 12959) // 1296]
    assert len(straddling) == 8
    assert plan.bucket.patches == 14336 and plan.bucket.key_rows == 1536 and plan.bucket.tiles == 112 + 8
    used = first <= last
    assert (first == last)[used].all() and (start[used] == first[used] * 1296).all()
    assert block[112:].tolist() == straddling
    # Recurring (tight): rows rounded to 102 blocks of 128, windows of exactly one frame's 1296 rows.
    tight = make_plan([[10, 36, 36]], QWEN2_5_VL_3B, BucketPolicy(tight=True))
    assert (tight.bucket.patches, tight.bucket.key_rows, tight.bucket.tiles) == (13056, 1296, 102 + 8)
    cu = np.arange(11) * 1296
    check_tiles(tile_table(tight), cu, 12960, 128, 102, tight.bucket, tight=True)
    # Small frames (36 rows) share tiles: runs of 3 frames (108 rows) in 128-row windows, 10 blocks
    # + 8 extra tiles (18 x 128 key rows) beat one tile per block over its frames (10 x 256).
    plan = make_plan([[30, 6, 6]], QWEN2_5_VL_3B)
    block, first, last, start = tile_table(plan)
    assert (plan.bucket.key_rows, plan.bucket.tiles) == (128, 10 + 8) and (last - first).max() == 2


def test_non_windowed_plan():
    grid = [[2, 12, 8], [1, 4, 4]]
    plan = make_plan(grid, QWEN2_VL_2B)
    assert plan.bucket.windows == 0 and plan.window_tokens.shape == (0, QWEN2_VL_2B.window_patches)
    check_plan(plan, grid, QWEN2_VL_2B, BucketPolicy())


def test_plan_without_window_layers():
    """A Qwen2.5-VL config whose blocks all use full attention: no window slots, slot width kept."""
    cfg = dataclasses.replace(QWEN2_5_VL_3B, fullatt_block_indexes=tuple(range(QWEN2_5_VL_3B.depth)))
    assert not cfg.windowed and cfg.window_patches == 64
    grid = [[2, 12, 8], [1, 4, 4]]
    plan = make_plan(grid, cfg)
    assert plan.bucket.windows == 0 and plan.window_tokens.shape == plan.window_ids.shape == (0, 64)
    check_plan(plan, grid, cfg, BucketPolicy())


def test_segment_lengths():
    grid = [[2, 12, 8], [1, 4, 4]]
    frames, windows = segment_lengths(grid, QWEN2_5_VL_3B)
    assert frames.tolist() == [96, 96, 16]
    _, wcu = window_index(grid, QWEN2_5_VL_3B)
    np.testing.assert_array_equal(windows, np.diff(wcu))
    assert frames.dtype == windows.dtype == np.int64
    frames2, none = segment_lengths(grid, QWEN2_VL_2B)
    assert frames2.tolist() == [96, 96, 16] and none.shape == (0,)


def test_plan_cache_and_read_only():
    grid = [[1, 8, 8], [2, 4, 6]]
    plan = make_plan(grid, QWEN2_5_VL_3B)
    assert make_plan(np.array(grid, np.int32), QWEN2_5_VL_3B) is plan
    assert make_plan(tuple(map(tuple, grid)), QWEN2_5_VL_3B) is plan
    assert make_plan(grid, QWEN2_5_VL_3B, BucketPolicy(block=64)) is not plan
    assert make_plan(grid, WIN56) is not plan
    assert make_plans(grid, QWEN2_5_VL_3B) == [plan]  # one chunk: the very same plan
    plans = make_plans([[10, 36, 36]], QWEN2_5_VL_3B)
    again = make_plans(np.array([[10, 36, 36]], np.int32), QWEN2_5_VL_3B)
    assert again == plans and again is not plans and all(a is b for a, b in zip(again, plans))
    # Chunks with the same frame sequence share one plan's arrays, each with its own grid.
    plans = make_plans([[10, 36, 36]] * 10, QWEN2_5_VL_3B)
    full = [p for p in plans if p.n_patches == 11 * 1296]
    assert len(full) == 9 and len({p.grid_thw.tobytes() for p in full}) > 1
    assert all(p.pos_ids is full[0].pos_ids and p.window_ids is full[0].window_ids for p in full)
    assert all(not p.grid_thw.flags.writeable for p in plans)
    with pytest.raises(ValueError, match="read-only"):
        plan.pos_ids[0, 0] = 1
    with pytest.raises(ValueError, match="read-only"):
        plan.window_ids[0, 0] = 1


def test_buffer_pool_hands_out_only_dead_buffers():
    pool = BufferPool(min_items=16, max_bytes=2 * 64 * 4)  # two blocks of 64 items
    assert pool.take(15).size == 0  # small: left to malloc
    a = pool.take(40)
    assert a.size == 64 and a.dtype == np.int32 and a.flags.writeable
    assert pool.blocks == 1 and pool.nbytes == 64 * 4
    view, addr = a[3:9].reshape(2, 3), a.ctypes.data
    del a
    b = pool.take(64)
    assert b.ctypes.data != addr  # `view` still holds the first block
    assert pool.take(33).size == 0  # full
    del view
    assert pool.take(64).ctypes.data == addr
    assert pool.take(65).size == 0  # another size class, no room


def test_plans_in_recycled_buffers(monkeypatch):
    """A recycled buffer holds an old plan's values: a plan built into one equals a plan built
    into fresh memory (every entry is written), and no buffer is recycled while any array of its
    plan is alive."""
    cfg, grids = QWEN2_5_VL_3B, [[[10, 36, 36]], [[10, 38, 34]], [[3, 40, 40], [1, 8, 8]]]

    def build(pool, grid=grids[0]):
        monkeypatch.setattr(assembly, "POOL", pool)
        clear_caches()
        return make_plan(grid, cfg)

    fresh = build(BufferPool(max_bytes=0))  # never pooled: np.empty
    pool = BufferPool()
    kept = build(pool).pos_ids
    before, items = kept.copy(), pool.nbytes // 4  # the one block, its int32 items
    assert pool.blocks == 1
    for grid in grids[1:]:  # new plans: the block behind `kept` is not reused
        build(pool, grid)
        np.testing.assert_array_equal(kept, before)
    assert pool.blocks > 1
    del kept
    blocks = pool.blocks
    junk = pool.take(items)  # the free block the next plan of this size gets: dirty it
    addr = junk.ctypes.data
    junk[:] = -7
    del junk
    again = build(pool)
    assert pool.blocks == blocks and again.pos_ids.ctypes.data == addr  # built into the dirty block
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(x, y)
    assert again.bucket == fresh.bucket
    clear_caches()


# ---- buckets -----------------------------------------------------------------------------------
def octave_density(policy: BucketPolicy, r: int) -> int:
    """Rungs per octave of the ladder in the octave holding r (the documented rule: per_octave from
    dense_from up, half as many per factor of 4 below, at least 1)."""
    base, p, below = 2 ** (int(r).bit_length() - 1), policy.per_octave, policy.dense_from
    while base < below and p > 1:
        p, below = p // 2, below // 4
    return p


@pytest.mark.parametrize(
    "policy",
    [
        BucketPolicy(),
        BucketPolicy(per_octave=1, dense_from=0),
        BucketPolicy(per_octave=2, dense_from=0),
        BucketPolicy(per_octave=8, dense_from=4096),
        BucketPolicy(block=64, per_octave=3, min_patches=20),
        BucketPolicy(block=4),
    ],
)
def test_ladder(policy):
    p, rungs = policy.per_octave, policy.rungs(10**6)
    assert rungs[0] == policy.min_patches and rungs[-1] >= 10**6 > rungs[-2]
    assert all(np.diff(rungs) > 0) and all(r % 4 == 0 for r in rungs)
    for r in rungs:
        blk, nb = policy.block_size(r), -(-r // policy.block)
        assert blk * nb == r and blk % 4 == 0 and blk <= policy.block
    # geometric: within one rounding / snapping step of (1 + 1/p) per rung, p rungs per octave
    # where p is the octave's density
    for r, nxt in zip(rungs, rungs[1:]):
        assert nxt <= r * (1 + 1 / octave_density(policy, r)) + 4 * -(-nxt // policy.block)
    assert len(rungs) <= p * (np.log2(10**6 / policy.min_patches) + 1) + 1
    ns = np.unique(np.geomspace(1, 10**6, 3000).astype(int))
    vals = [policy.rung(int(n)) for n in ns]
    assert all(np.diff(vals) >= 0) and all(v in rungs for v in vals)
    assert all(v >= n and (v == rungs[0] or rungs[rungs.index(v) - 1] < n) for n, v in zip(ns, vals))
    assert policy.rungs(rungs[5]) == rungs[:6] and policy.rungs(rungs[5] + 1) == rungs[:7]


def test_ladder_values():
    # The default: 1 rung per octave below 256, 2 up to 1024, 4 from there.
    assert BucketPolicy().rungs(20000) == [
        *(64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560),
        *(3072, 3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384, 20480),
    ]
    uniform = BucketPolicy(per_octave=2, dense_from=0, min_patches=16)
    assert uniform.rungs(64) == [16, 24, 32, 48, 64]
    blocks = [uniform.block_size(r) for r in (16, 96, 128, 192, 384, 1536)]
    assert blocks == [16, 96, 128, 96, 128, 128]
    assert BucketPolicy(per_octave=1, min_patches=16).rungs(3000) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    four = BucketPolicy(per_octave=4, dense_from=0, min_patches=16).rungs(700)
    assert four[:13] == [16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert four[13:] == [160, 192, 224, 256, 324, 384, 448, 512, 640, 768]  # 320 = 3 blocks of 106.7: snapped
    assert BucketPolicy().rung(2**30) >= 2**30  # every valid grid has a rung


def test_coarse_ladder():
    assert [coarse_ladder_value(n) for n in range(0, 14)] == [0, 1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    vals = [coarse_ladder_value(n) for n in range(1, 5000)]
    assert all(np.diff(vals) >= 0) and all(n <= v < 1.5 * n + 1 for n, v in enumerate(vals, 1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block=30), "block must be a positive multiple of 4"),
        (dict(block=0), "block must be a positive multiple of 4"),
        (dict(per_octave=0), "per_octave must be an int >= 1"),
        (dict(per_octave=1.5), "per_octave must be an int >= 1"),
        (dict(min_patches=18), "min_patches must be a positive multiple of 4"),
        (dict(min_patches=0), "min_patches must be a positive multiple of 4"),
        (dict(max_patches=8), "max_patches must be an int >= min_patches"),
    ],
)
def test_policy_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BucketPolicy(**kwargs)


STREAM = [(2 * int(a), 2 * int(b)) for a, b in np.random.default_rng(0).integers(1, 33, (30, 2))]


@pytest.mark.parametrize("cfg", [QWEN2_5_VL_3B, QWEN2_VL_2B], ids=["qwen2.5-vl-3b", "qwen2-vl-2b"])
def test_image_stream_compiles_few_programs(cfg):
    """30 random single-image sizes land in <= 12 buckets (issue 3)."""
    plans = [make_plan([[1, h, w]], cfg) for h, w in STREAM]
    buckets = {p.bucket for p in plans}
    pad = np.mean([p.bucket.patches / p.n_patches for p in plans])
    print(f"\n{cfg.variant}: {len(buckets)} buckets for 30 sizes, mean N_pad / N = {pad:.3f}")
    assert len(buckets) <= 12


# ---- batch plans ----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    grids_st.filter(lambda g: sum(t * h * w for t, h, w in g) <= BucketPolicy().max_patches),
    st.sampled_from(WINDOWED + [QWEN2_VL_2B]),
)
def test_batch_plan_invariants_random(grid, cfg):
    """Any grid (images and video rows) in a batch plan: every Plan invariant, one tile per block."""
    check_plan(make_batch_plan(grid, cfg), grid, cfg, BucketPolicy(), batch=True)


def test_batch_plan_values():
    policy = BucketPolicy()
    assert [batch_rows(n, policy) for n in (1, 64, 65, 97, 700, 1025, 1600, 16384)] == [
        64,
        64,
        96,
        128,
        768,
        1536,
        2048,
        16384,
    ]
    assert [frame_class(r) for r in (4, 64, 65, 129, 192, 193, 384, 385, 1000)] == [
        64,
        64,
        128,
        192,
        192,
        256,
        384,
        512,
        1024,
    ]
    assert batch_key_rows(4096, 128, 256) == 128 + 512 and batch_key_rows(256, 128, 256) == 256
    with pytest.raises(ValueError, match="at most max_patches"):
        make_batch_plan([[1, 128, 130]], QWEN2_5_VL_3B)


@pytest.mark.parametrize("cfg", [QWEN2_5_VL_3B, QWEN2_VL_2B], ids=["qwen2.5-vl-3b", "qwen2-vl-2b"])
def test_random_batches_compile_few_programs(cfg):
    """300 random batches of 2-32 images (the 30-size STREAM): a batch plan's bucket is a function
    of its rows, its widest frame's class and the window variant alone, so they land in a few
    buckets, where ladder plans of the same batches land in many (one per mix, nearly)."""
    rng = np.random.default_rng(1)
    buckets, ladder, keys = set(), set(), {}
    for _ in range(300):
        sizes = [STREAM[i] for i in rng.integers(0, len(STREAM), rng.integers(2, 33))]
        grid = [[1, h, w] for h, w in sizes]
        while sum(h * w for _, h, w in grid) > BucketPolicy().max_patches:
            grid.pop()
        plan = make_batch_plan(grid, cfg)
        key = (plan.bucket.patches, frame_class(max(h * w for _, h, w in grid)), plan.bucket.windows)
        assert keys.setdefault(key, plan.bucket) == plan.bucket
        buckets.add(plan.bucket)
        ladder |= {p.bucket for p in make_plans(grid, cfg)}
    print(f"\n{cfg.variant}: 300 batches, {len(buckets)} batch buckets, {len(ladder)} ladder buckets")
    assert len(buckets) <= 40 and len(ladder) >= 3 * len(buckets)


# ---- splitting -----------------------------------------------------------------------------------
def frames_of(grids):
    return [(int(h), int(w)) for g in grids for t, h, w in np.asarray(g).tolist() for _ in range(t)]


def padded_ratio(chunks, policy=BucketPolicy()):
    sizes = [int(np.prod(c, axis=1).sum()) for c in chunks]
    return sum(policy.rung(n) for n in sizes) / sum(sizes)


def check_split(grid, cfg, policy):
    chunks = split_grid(grid, cfg, policy)
    assert frames_of(chunks) == frames_of([grid])
    for c in chunks:
        assert c.dtype == np.int64 and c.ndim == 2 and c.shape[1] == 3 and (c > 0).all()
        assert int(np.prod(c, axis=1).sum()) <= policy.max_patches or c.tolist() == [[1, *c[0, 1:].tolist()]]
    return chunks


def brute_force_cost(frames, policy):
    """Least sum(rung + penalty) over every cut of `frames` into consecutive chunks."""
    best = None
    for mask in itertools.product([0, 1], repeat=len(frames) - 1):
        cuts = [0] + [i + 1 for i, m in enumerate(mask) if m] + [len(frames)]
        sizes = [sum(frames[a:b]) for a, b in zip(cuts, cuts[1:])]
        if any(s > policy.max_patches and b - a > 1 for s, a, b in zip(sizes, cuts, cuts[1:])):
            continue
        cost = sum(policy.rung(s) + chunk_penalty(policy) for s in sizes)
        best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=60, deadline=None)
@given(
    grid=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 16).map(lambda v: 2 * v), st.integers(1, 16).map(lambda v: 2 * v)),
        min_size=1,
        max_size=3,
    ),
    max_patches=st.sampled_from([64, 256, 1024, 16384]),
    per_octave=st.sampled_from([1, 2]),
)
def test_split_random(grid, max_patches, per_octave):
    policy = BucketPolicy(max_patches=max_patches, per_octave=per_octave)
    chunks = check_split(grid, QWEN2_5_VL_3B, policy)
    frames = [h * w for h, w in frames_of([grid])]
    if len(frames) <= 10:
        cost = sum(policy.rung(int(np.prod(c, axis=1).sum())) + chunk_penalty(policy) for c in chunks)
        assert cost == brute_force_cost(frames, policy)


_jitter = np.random.default_rng(1).integers(-1, 2, (10, 2))
SPLIT_CASES = {
    "10x36x36": ([[10, 36, 36]], 1.1),
    "ten_videos": ([[10, 36, 36]] * 10, 1.1),
    "ten_jittered": ([[10, 36 + 2 * int(a), 36 + 2 * int(b)] for a, b in _jitter], 1.1),
    "1x128x128": ([[1, 128, 128]], 1.0),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_padding(name):
    grid, bound = SPLIT_CASES[name]
    chunks = check_split(grid, QWEN2_5_VL_3B, BucketPolicy())
    ratio = padded_ratio(chunks)
    sizes = [int(np.prod(c, axis=1).sum()) for c in chunks]
    print(f"\n{name}: {len(chunks)} chunks {sizes} padded / real {ratio:.3f}")
    assert ratio <= bound
    if name == "1x128x128":
        assert len(chunks) == 1 and make_plans(grid, QWEN2_5_VL_3B)[0].bucket.patches == 16384
    if name == "10x36x36":
        assert [c.tolist() for c in chunks] == [[[9, 36, 36]], [[1, 36, 36]]]  # 12288 + 1536 vs 16384


@pytest.mark.parametrize(
    "grid",
    [
        [[1, 2, 2]],
        [[1, 36, 36]],
        [[1, 64, 64]],
        [[2, 10, 18]],
        [[3, 36, 36]],
        [[1, 8, 8], [2, 4, 6]],
        [[1, 2, 2], [3, 16, 24], [1, 34, 6]],
        [[1, 128, 200]],  # one frame over max_patches: its own chunk, its own rung
    ],
)
def test_split_small_requests_one_chunk(grid):
    chunks = split_grid(grid, QWEN2_5_VL_3B)
    assert len(chunks) == 1 and chunks[0].tolist() == grid


def test_split_oversized_frames():
    policy = BucketPolicy(max_patches=256)
    chunks = check_split([[3, 20, 20], [2, 8, 8]], QWEN2_5_VL_3B, policy)
    assert [c.tolist() for c in chunks] == [[[1, 20, 20]]] * 3 + [[[2, 8, 8]]]
    plans = make_plans([[3, 20, 20], [2, 8, 8]], QWEN2_5_VL_3B, policy)
    assert [p.bucket.patches for p in plans] == [policy.rung(400)] * 3 + [128]


def test_split_cuts_inside_video_rows():
    # 13 frames of 1296: 11 (14256 -> 14336) + 2 (2592 -> 3072); the cut falls inside the last video.
    chunks = check_split([[2, 36, 36], [7, 36, 36], [4, 36, 36]], QWEN2_5_VL_3B, BucketPolicy())
    assert [c.tolist() for c in chunks] == [[[2, 36, 36], [7, 36, 36], [2, 36, 36]], [[2, 36, 36]]]
    assert padded_ratio(chunks) <= 1.1
    chunks = check_split([[2, 36, 36], [7, 20, 20], [4, 36, 36], [3, 36, 36]], QWEN2_5_VL_3B, BucketPolicy())
    assert padded_ratio(chunks) <= 1.1 and any(len(c) > 1 for c in chunks)


@pytest.mark.parametrize("cfg", [QWEN2_5_VL_3B, QWEN2_VL_2B], ids=["win112", "qwen2vl"])
@pytest.mark.parametrize("name", ["10x36x36", "ten_videos", "ten_jittered", "1x128x128"])
def test_make_plans_matches_make_plan(name, cfg):
    grid = SPLIT_CASES[name][0]
    plans = make_plans(grid, cfg)
    chunks = split_grid(grid, cfg)
    assert len(plans) == len(chunks)
    for plan, chunk in zip(plans, chunks):
        ref = make_plan(chunk, cfg)
        np.testing.assert_array_equal(plan.grid_thw, chunk)
        assert plan.bucket == ref.bucket and plan.n_patches == ref.n_patches
        for key in (k for k in Plan.ARRAYS if k != "span"):  # span: the chunk's rows in the request
            np.testing.assert_array_equal(getattr(plan, key), getattr(ref, key))
    if name == "ten_jittered":
        for plan, chunk in zip(plans, chunks):
            check_plan(plan, chunk.tolist(), cfg, BucketPolicy())


# ---- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "grid, match",
    [
        ([[1, 3, 4]], r"row 0 .*multiples of spatial_merge_size 2 \(odd"),
        ([[1, 4, 4], [1, 4, 6], [2, 8, 5]], r"row 2 = \[2, 8, 5\]"),
        ([[0, 4, 4]], r"row 0 .*t must be positive, got 0"),
        ([[1, 4, 4], [1, -2, 4]], r"row 1 .*h must be positive, got -2"),
        ([1, 4, 4], r"shape \[k, 3\].*got shape \(3,\)"),
        ([[1, 4], [2, 4]], r"shape \[k, 3\].*\(2, 2\)"),
        (np.zeros((0, 3), np.int64), "empty"),
        ([[1.0, 4.0, 4.0]], "integers, got dtype float64"),
        ([[True, True, True]], "integers, got dtype bool"),
        ([[1, 4, 4], [1, 4]], "rectangular"),
    ],
)
def test_validate_errors(grid, match):
    with pytest.raises(ValueError, match=match):
        validate_grid(grid, QWEN2_5_VL_3B)


def test_validate_layouts_and_dtypes():
    """Any integer dtype and memory layout: an int64, C-ordered, writable copy, and the same plan."""
    base = np.array([[2, 4, 6], [1, 8, 8]])
    plan = make_plan(base, QWEN2_5_VL_3B)
    for arr in (
        base.astype(np.int32),
        base.astype(np.uint16),
        np.asfortranarray(base),
        np.repeat(base, 2, axis=0)[::2],
        np.ascontiguousarray(base[::-1])[::-1],
    ):
        g = validate_grid(arr, QWEN2_5_VL_3B)
        assert g.dtype == np.int64 and g.flags.c_contiguous and g.flags.writeable
        assert g.tolist() == base.tolist() and not np.shares_memory(g, arr)
        assert make_plan(arr, QWEN2_5_VL_3B) is plan


def test_validate_ok():
    g = validate_grid(np.array([[2, 4, 6]], np.uint8), QWEN2_5_VL_3B)
    assert g.dtype == np.int64 and g.tolist() == [[2, 4, 6]]
    assert validate_grid([[1, 3, 5]]).tolist() == [[1, 3, 5]]  # without cfg only positivity is checked


def test_readme_compile_bound_matches_the_ladder():
    """The README's compile bound for a stream of distinct images is the ladder's rung count."""
    text = " ".join((pathlib.Path(__file__).parent.parent / "README.md").read_text().split())
    m = re.search(r"distinct images of up to (\d+) patches compiles at most (\d+) programs", text)
    assert m, "the README no longer states the compile bound"
    assert len(BucketPolicy().rungs(int(m[1]))) == int(m[2])
