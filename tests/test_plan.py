"""plan.py: HF-exact index functions, plan invariants, bucket ladders, grid validation."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import vision_utils as hf

from qwen_vit_jax.config import QWEN2_5_VL_3B, QWEN2_VL_2B
from qwen_vit_jax.plan import (
    Bucket, BucketPolicy, coarse_ladder_value, frame_cu_seqlens, make_plan, patch_ladder,
    patch_ladder_value, rotary_ids, validate_grid, window_index,
)

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
    min_size=1, max_size=4,
)


def hf_reference(grid, cfg):
    g = torch.tensor(grid)
    wi, cu = hf.get_vision_window_index(g, cfg.spatial_merge_size, cfg.window_size, cfg.patch_size)
    return (hf.get_vision_position_ids(g, cfg.spatial_merge_size).numpy(),
            hf.get_vision_cu_seqlens(g).numpy(), wi.numpy(), cu.numpy())


def assert_hf_exact(grid, cfg):
    pos, cu, wi, wcu = hf_reference(grid, cfg)
    np.testing.assert_array_equal(rotary_ids(grid, cfg), pos)
    np.testing.assert_array_equal(frame_cu_seqlens(grid), cu)
    ours_wi, ours_wcu = window_index(grid, cfg)
    assert ours_wi.dtype == np.int64 and ours_wcu.dtype == np.int32
    np.testing.assert_array_equal(ours_wi, wi)
    np.testing.assert_array_equal(ours_wcu, wcu)


def check_plan(plan, grid, cfg, policy):
    """Every documented Plan invariant, derived independently of plan.py's kernels."""
    b, bk = policy.block, plan.bucket
    cu = hf.get_vision_cu_seqlens(torch.tensor(grid)).numpy().astype(np.int64)
    n, n_pad, nb = int(cu[-1]), bk.patches, bk.patches // b
    assert plan.n_patches == n and bk.block == b
    assert n_pad == patch_ladder_value(n, policy) and n_pad % b == 0 and n_pad >= n
    np.testing.assert_array_equal(plan.grid_thw, np.asarray(grid))
    arrays = plan.device_arrays()
    assert [a.shape for a in arrays] == [(n_pad, 2), (n_pad,), (nb,), (nb,), (bk.windows, cfg.window_patches), (n_pad,)]
    assert all(a.dtype == np.int32 and not a.flags.writeable for a in arrays)
    assert not plan.grid_thw.flags.writeable

    np.testing.assert_array_equal(plan.pos_ids[:n], rotary_ids(grid, cfg))
    assert not plan.pos_ids[n:].any()
    frames = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    np.testing.assert_array_equal(plan.segment_ids, np.concatenate([frames, np.full(n_pad - n, -1)]))

    # Minimal key-block range per query block: union of the block spans of every frame it touches,
    # padding confined to its own block.
    lo, hi = np.arange(nb), np.arange(nb)
    lo[: (n - 1) // b + 1], hi[: (n - 1) // b + 1] = nb, -1  # real-row blocks: filled from frames below
    if n % b:
        lo[n // b] = hi[n // b] = n // b  # mixed block holds padding rows
    for s, e in zip(cu[:-1], cu[1:]):
        b0, b1 = s // b, (e - 1) // b
        lo[b0:b1 + 1] = np.minimum(lo[b0:b1 + 1], b0)
        hi[b0:b1 + 1] = np.maximum(hi[b0:b1 + 1], b1)
    np.testing.assert_array_equal(plan.kv_block_start, lo)
    np.testing.assert_array_equal(plan.kv_block_count, hi - lo + 1)
    assert plan.kv_block_count.max() <= bk.key_blocks <= nb
    pad_only = np.arange(nb) * b >= n
    assert (plan.kv_block_count[pad_only] == 1).all()

    tok, slot = plan.window_tokens, plan.window_slot
    if not cfg.windowed:
        assert bk.windows == 0 and tok.shape[0] == 0 and not slot.any()
        return
    _, _, wi, wcu = hf_reference(grid, cfg)
    valid = tok >= 0
    lens = valid.sum(1)
    w = len(wcu) - 1
    assert bk.windows == coarse_ladder_value(w) >= w
    np.testing.assert_array_equal(lens[:w], np.diff(wcu))
    assert not lens[w:].any()
    assert (valid == (np.arange(tok.shape[1]) < lens[:, None])).all()  # filled rows first, then -1
    mu = cfg.merge_unit
    np.testing.assert_array_equal(tok[valid], (wi[:, None] * mu + np.arange(mu)).ravel())
    np.testing.assert_array_equal(np.sort(tok[valid]), np.arange(n))  # each real row in exactly one slot
    ww, jj = np.nonzero(valid)
    np.testing.assert_array_equal(slot[tok[valid]], ww * cfg.window_patches + jj)
    assert not slot[n:].any()


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


@settings(max_examples=50, deadline=None)
@given(grid=grids_st, cfg=st.sampled_from(WINDOWED + [QWEN2_VL_2B]), block=st.sampled_from([4, 8, 32, 128]))
def test_plan_invariants_random(grid, cfg, block):
    policy = BucketPolicy(block=block)
    check_plan(make_plan(grid, cfg, policy), grid, cfg, policy)


def test_padding_tail_does_not_inflate_key_blocks():
    plan = make_plan([[1, 34, 34]], QWEN2_5_VL_3B)  # N = 1156 -> N_pad = 1408: a pure-padding last block
    assert plan.bucket.patches == 1408
    assert plan.kv_block_start[-1] == 10 and plan.kv_block_count[-1] == 1
    assert plan.kv_block_count[:-1].tolist() == [10] * 10
    assert plan.bucket.key_blocks == 11  # coarse 12, capped at N_pad // block


def test_non_windowed_plan():
    grid = [[2, 12, 8], [1, 4, 4]]
    plan = make_plan(grid, QWEN2_VL_2B)
    assert plan.bucket.windows == 0 and plan.window_tokens.shape == (0, QWEN2_VL_2B.window_patches)
    check_plan(plan, grid, QWEN2_VL_2B, BucketPolicy())


def test_plan_cache_and_read_only():
    grid = [[1, 8, 8], [2, 4, 6]]
    plan = make_plan(grid, QWEN2_5_VL_3B)
    assert make_plan(np.array(grid, np.int32), QWEN2_5_VL_3B) is plan
    assert make_plan(tuple(map(tuple, grid)), QWEN2_5_VL_3B) is plan
    assert make_plan(grid, QWEN2_5_VL_3B, BucketPolicy(block=64)) is not plan
    assert make_plan(grid, WIN56) is not plan
    with pytest.raises(ValueError, match="read-only"):
        plan.pos_ids[0, 0] = 1


# ---- buckets -----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [BucketPolicy(), BucketPolicy(block=64, growth=1.25), BucketPolicy(block=4)])
def test_patch_ladder(policy):
    b, rungs = policy.block, patch_ladder(10**6, policy)
    assert rungs[0] == b and rungs[-1] >= 10**6 and len(rungs) < 400
    assert all(r % b == 0 for r in rungs) and all(np.diff(rungs) >= b)
    assert all(nxt <= max(r + b, r * policy.growth + b) for r, nxt in zip(rungs, rungs[1:]))
    ns = np.unique(np.geomspace(1, 10**6, 3000).astype(int))
    vals = [patch_ladder_value(int(n), policy) for n in ns]
    assert all(np.diff(vals) >= 0) and all(v in rungs for v in vals)
    assert all(n <= v < n * policy.growth + b for n, v in zip(ns, vals))
    if b == 128:
        assert rungs[:10] == [128, 256, 384, 512, 640, 768, 896, 1024, 1152, 1408]


def test_coarse_ladder():
    assert [coarse_ladder_value(n) for n in range(0, 14)] == [0, 1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    vals = [coarse_ladder_value(n) for n in range(1, 5000)]
    assert all(np.diff(vals) >= 0) and all(n <= v < 1.5 * n + 1 for n, v in enumerate(vals, 1))


def test_bucket():
    p = BucketPolicy()
    assert p.bucket(1000, 0, 3) == Bucket(patches=1024, windows=0, key_blocks=3, block=128)
    assert p.bucket(1000, 5, 7) == Bucket(patches=1024, windows=6, key_blocks=8, block=128)
    assert p.bucket(1100, 5, 7).key_blocks == 8 and p.bucket(1000, 5, 7).key_blocks == 8
    assert p.bucket(300, 1, 3).key_blocks == 3  # coarse 3 already at the cap
    assert p.bucket(260, 1, 3).key_blocks == 3 and p.bucket(260, 1, 3).patches == 384
    with pytest.raises(ValueError, match="key_blocks"):
        p.bucket(100, 1, 2)
    with pytest.raises(ValueError, match="multiple of 4"):
        BucketPolicy(block=30)
    with pytest.raises(ValueError, match="growth"):
        BucketPolicy(growth=1.0)


# ---- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("grid, match", [
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
])
def test_validate_errors(grid, match):
    with pytest.raises(ValueError, match=match):
        validate_grid(grid, QWEN2_5_VL_3B)


def test_validate_ok():
    g = validate_grid(np.array([[2, 4, 6]], np.uint8), QWEN2_5_VL_3B)
    assert g.dtype == np.int64 and g.tolist() == [[2, 4, 6]]
    assert validate_grid([[1, 3, 5]]).tolist() == [[1, 3, 5]]  # without cfg only positivity is checked
