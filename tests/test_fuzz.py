"""Property tests of the host plan on random grid lists: HF-exact index functions, and the plan's
own invariants on requests of any size, split into chunks.

Two hypothesis profiles, chosen by the environment variable QVJ_FUZZ:
  ci        (default) a few dozen examples per property, derandomized: < 1 min, what CI runs;
  thorough  1000 examples per property (QVJ_FUZZ=thorough python -m pytest tests/test_fuzz.py
            --hypothesis-show-statistics); several minutes.
Grid lists: 1..12 items, t in 1..8, h and w multiples of the merge size up to 128 (even, 2..128,
for merge 2); both variants; merge sizes 1, 2, 4 and every window size up to 224 px that a
config allows (a multiple of patch_size * merge).

Invariants checked on every chunk's plan (independently of plan.py's kernels):
  * chunks cover the request's frames in order; each fits max_patches or is a single frame;
  * every real row is in exactly one full-attention tile (of its query block, listing its frame),
    whose key range holds all of its frame's rows; padding rows (segment -1) are in no tile's
    frame range and no window slot, so they attend to nothing real and nothing real to them;
  * every real row is in exactly one window slot entry, and the rows sharing a (slot, window id)
    are exactly the rows of one of HF's windows.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import vision_utils as hf

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.plan import (
    BucketPolicy,
    frame_cu_seqlens,
    make_plans,
    rotary_ids,
    split_grid,
    window_index,
)
from qwen_vit_jax.presets import QWEN2_5_VL_3B, QWEN2_VL_2B

_COMMON = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
)
settings.register_profile("ci", max_examples=25, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
PROFILE = os.environ.get("QVJ_FUZZ", "ci")
FUZZ = settings.get_profile(PROFILE)  # per test (loading it globally would change other files' tests)

PATCH = 14
MERGES = (1, 2, 4)


def tile_table(plan) -> tuple[np.ndarray, ...]:
    """(query block, first frame, last frame, key window start), int64 [T] each: the one place that
    knows how a Plan stores its full-attention tiles."""
    return tuple(
        np.asarray(a, np.int64)
        for a in (plan.tile_block, plan.tile_first_frame, plan.tile_last_frame, plan.tile_key_start)
    )


@st.composite
def configs(draw) -> VisionConfig:
    merge = draw(st.sampled_from(MERGES))
    if draw(st.booleans()):
        return VisionConfig(**{**QWEN2_VL_2B.to_dict(), "spatial_merge_size": merge})
    unit = PATCH * merge
    window = unit * draw(st.integers(1, 224 // unit))
    return VisionConfig(**{**QWEN2_5_VL_3B.to_dict(), "spatial_merge_size": merge, "window_size": window})


@st.composite
def grid_lists(draw, merge: int, max_items: int = 12, max_t: int = 8, max_side: int = 128) -> list[list[int]]:
    side = (
        st.integers(1, max_side // merge).map(lambda v: v * merge)
        if merge > 1
        else st.integers(1, max_side // 2).map(lambda v: 2 * v)
    )
    return draw(st.lists(st.tuples(st.integers(1, max_t), side, side).map(list), min_size=1, max_size=max_items))


@st.composite
def requests(draw):
    cfg = draw(configs())
    return cfg, draw(grid_lists(cfg.spatial_merge_size))


POLICIES = [
    BucketPolicy(max_patches=m, block=b, per_octave=p)
    for m, b, p in [(1024, 128, 2), (4096, 32, 1), (16384, 128, 2), (2048, 64, 2)]
]


# ---- index functions vs HF ---------------------------------------------------------------------
@FUZZ
@given(request=requests())
def test_index_functions_equal_hf(request):
    cfg, grid = request
    g = torch.tensor(grid)
    m = cfg.spatial_merge_size
    np.testing.assert_array_equal(rotary_ids(grid, cfg), hf.get_vision_position_ids(g, m).numpy())
    np.testing.assert_array_equal(frame_cu_seqlens(grid), hf.get_vision_cu_seqlens(g).numpy())
    if cfg.windowed:
        wi, cu = hf.get_vision_window_index(g, m, cfg.window_size, cfg.patch_size)
        ours_wi, ours_cu = window_index(grid, cfg)
        np.testing.assert_array_equal(ours_wi, wi.numpy())
        np.testing.assert_array_equal(ours_cu, cu.numpy())


# ---- plan invariants ---------------------------------------------------------------------------
def frames_of(grid) -> list[tuple[int, int]]:
    return [(h, w) for t, h, w in np.asarray(grid).tolist() for _ in range(t)]


def check_chunks(plans, grid, cfg, policy):
    """Chunks cover the request's frames in order, each within budget, equal to split_grid's."""
    chunks = split_grid(grid, cfg, policy)
    assert len(plans) == len(chunks)
    assert sum((frames_of(p.grid_thw) for p in plans), []) == frames_of(grid)
    for p, c in zip(plans, chunks):
        np.testing.assert_array_equal(p.grid_thw, c)
        n = int(np.prod(c, axis=1).sum())
        assert p.n_patches == n and p.bucket.patches == policy.rung(n)
        assert n <= policy.max_patches or frames_of(c) == frames_of(c)[:1]  # over budget: one frame


def check_plan(plan, cfg):
    g = plan.grid_thw
    n, n_pad, b = plan.n_patches, plan.bucket.patches, plan.bucket.block
    cu = frame_cu_seqlens(g).astype(np.int64)
    n_frames = len(cu) - 1
    assert n_pad >= n and n_pad % b == 0
    np.testing.assert_array_equal(plan.pos_ids[:n], rotary_ids(g, cfg))
    frame = np.repeat(np.arange(n_frames), np.diff(cu))  # [n] frame of each real row
    np.testing.assert_array_equal(plan.segment_ids[:n], frame)
    assert (plan.segment_ids[n:] == -1).all()  # padding: a segment of its own

    # Full attention: every real row in exactly one tile of its block that lists its frame.
    blk, first, last, start = tile_table(plan)
    used = first <= last
    k_rows = plan.bucket.key_rows
    assert 1 <= k_rows <= n_pad and ((0 <= start) & (start <= n_pad - k_rows)).all()
    assert (first[used] >= 0).all() and (first[used] <= last[used]).all() and (last[used] < n_frames).all()
    span = (last - first + 1)[used]
    tile_of = np.repeat(np.flatnonzero(used), span)  # one entry per (tile, frame it lists)
    tile_frame = np.repeat(first[used], span) + np.arange(span.sum()) - np.repeat(np.cumsum(span) - span, span)
    claimed = blk[tile_of] * n_frames + tile_frame  # (query block, frame) pairs the tiles claim
    real = np.unique((np.arange(n) // b) * n_frames + frame)  # pairs that real rows form
    keys, counts = np.unique(claimed, return_counts=True)
    np.testing.assert_array_equal(keys, real)  # no tile claims a (block, frame) without rows
    assert (counts == 1).all()  # ... and each pair is claimed once: each real row in one tile
    # The tile's key window holds every row of each frame it lists.
    assert (start[tile_of] <= cu[tile_frame]).all()
    assert (start[tile_of] + k_rows >= cu[tile_frame + 1]).all()

    if not cfg.windowed:
        assert plan.bucket.windows == 0
        return
    # Window attention: every real row in exactly one slot entry, no padding row in any.
    tok, ids, slot = plan.window_tokens, plan.window_ids, plan.window_slot
    s = cfg.window_patches
    valid = tok >= 0
    np.testing.assert_array_equal(valid, ids >= 0)  # an empty entry has no window: attends to nothing
    np.testing.assert_array_equal(np.sort(tok[valid]), np.arange(n))
    entry = np.flatnonzero(valid.ravel())
    np.testing.assert_array_equal(slot[tok.ravel()[entry]], entry)
    # Rows sharing (slot, window id) are exactly the rows of one HF window (window_index is
    # pinned to HF above).
    wi, wcu = window_index(g, cfg)
    mu = cfg.merge_unit
    rows = (wi[:, None] * mu + np.arange(mu)).ravel()  # rows in window order
    window_of = np.empty(n, np.int64)
    window_of[rows] = np.repeat(np.arange(len(wcu) - 1), np.diff(wcu))
    key = (slot[:n] // s) * (len(wcu) + 1) + ids.ravel()[slot[:n]]
    pairs = np.unique(window_of * (key.max() + 1) + key)
    assert len(pairs) == len(np.unique(key)) == len(wcu) - 1


@FUZZ
@given(request=requests(), policy=st.sampled_from(POLICIES))
def test_plan_invariants(request, policy):
    cfg, grid = request
    plans = make_plans(grid, cfg, policy)
    check_chunks(plans, grid, cfg, policy)
    for p in plans:
        check_plan(p, cfg)


@FUZZ
@given(cfg=configs(), data=st.data(), max_patches=st.sampled_from([256, 1024]))
def test_requests_split_into_several_chunks(cfg, data, max_patches):
    """Many frames against a small budget: several chunks, cuts inside videos."""
    m = cfg.spatial_merge_size
    # > 2 budgets of rows in >= 2 frames: one chunk would hold > max_patches rows and several
    # frames, which only a single frame may (a frame over budget is a chunk of its own)
    grid = data.draw(
        grid_lists(m, max_t=8, max_side=max(2 * m, 32)).filter(
            lambda gr: sum(t * h * w for t, h, w in gr) > 2 * max_patches and sum(t for t, _, _ in gr) >= 2
        )
    )
    policy = BucketPolicy(max_patches=max_patches)
    plans = make_plans(grid, cfg, policy)
    assert len(plans) >= 2
    check_chunks(plans, grid, cfg, policy)
    for p in plans:
        check_plan(p, cfg)
