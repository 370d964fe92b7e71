"""Plan assembly: `make_plan` / `make_plans`, their caches, and the buffer pool behind them.

An uncached plan is on the request path whenever a grid is new, so it is cheap: the grid is
validated once, the split is one numba call (skipped for a single frame), a chunk's plan one more
(`kernels.build_plan`); what Python adds is scalar work and wrapping (for a large request about one
pass over its rows, on one core; benchmarks/RESULTS.md, "Host plans vs HF"). Plans are cached by
grid (a tuple of (t, h, w) rows) and shared, so their arrays are read-only.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref

import numpy as np

from ..config import VisionConfig
from . import kernels, posembed
from .buckets import (
    Bucket,
    BucketPolicy,
    batch_key_rows,
    batch_rows,
    frame_class,
    split,
    typical_windows,
    worst_windows,
)
from .contract import Plan
from .grid import as_grid

PLAN_CACHE_SIZE = 64  # a plan for ~130k patches holds ~3 MB
_EMPTY = np.empty(0, np.int32)
_NO_POS_INDEX = np.zeros((0, 4), np.int32)  # towers without a position table
_NO_POS_WEIGHT = np.zeros((0, 4), np.float32)
_NO_POS_INDEX.setflags(write=False)
_NO_POS_WEIGHT.setflags(write=False)


class BufferPool:
    """Recycled memory for the buffers of large plans.

    A fresh multi-100-KB buffer is fresh pages: the first write to each costs a page fault, most of an
    uncached plan's time for a jittered 130k-patch request on a small VM (`python -m benchmarks plan`;
    benchmarks/history.md, "Host index work"). The pool keeps up to `max_bytes` of power-of-two blocks and
    hands a block out again once nothing references the array made from it, so a long-running
    process builds new plans (cache misses and evictions) into pages it has touched before.

    A block is a bytearray; what is handed out is `np.frombuffer(block)`, and the pool keeps a weak
    reference to it. Every view of it (the plan's arrays, numba's slices, a JAX array aliasing host
    memory on CPU) keeps that array alive, because numpy stops collapsing a view's base at an array
    whose own base is not an array; so a dead weak reference means no view is left. Buffers below
    `min_items` int32 come from malloc's heap without faults: not pooled.
    """

    def __init__(self, min_items: int = 1 << 15, max_bytes: int = 32 << 20):
        self.min_items, self.max_bytes = min_items, max_bytes
        self._blocks: list[tuple[bytearray, list]] = []  # (memory, [weakref to the array handed out])
        self._lock = threading.Lock()

    @property
    def blocks(self) -> int:
        """Blocks the pool holds (in use or free)."""
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds."""
        return sum(len(block) for block, _ in self._blocks)

    def take(self, n: int) -> np.ndarray:
        """A writable int32 array of at least `n` items that no live array shares, or an empty
        array (small `n`, or the pool is full: the caller allocates)."""
        if n < self.min_items:
            return _EMPTY
        items = 1 << (n - 1).bit_length()
        with self._lock:
            for block, ref in self._blocks:
                if len(block) == 4 * items and ref[0]() is None:
                    return self._hand_out(block, ref)
            if self.nbytes + 4 * items > self.max_bytes:
                return _EMPTY
            self._blocks.append((bytearray(4 * items), [None]))
            return self._hand_out(*self._blocks[-1])

    @staticmethod
    def _hand_out(block: bytearray, ref: list) -> np.ndarray:
        out = np.frombuffer(block, np.int32)
        ref[0] = weakref.ref(out)
        return out


POOL = BufferPool()


def make_plan(grid_thw, cfg: VisionConfig, policy: BucketPolicy | None = None) -> Plan:
    """Validate `grid_thw` (unless it is a `Grid` already) and return its (cached) `Plan`: ONE plan
    for the whole grid, never split (N_pad = policy.padded_rows(N) even above max_patches)."""
    return _cached_plan(as_grid(grid_thw, cfg).key, cfg, policy or BucketPolicy())


def make_plans(grid_thw, cfg: VisionConfig, policy: BucketPolicy | None = None) -> list[Plan]:
    """Validate `grid_thw` (unless it is a `Grid` already) and return one (cached) `Plan` per chunk
    of `split_grid`, in order.

    One plan for any request that fits the policy's largest bucket (max_patches); a larger one is
    cut at frame boundaries. Each plan's grid_thw is its chunk's grid and its span says which rows
    of the request's pixel_values it takes (`Plan.take`).
    """
    policy = policy or BucketPolicy()
    key = as_grid(grid_thw, cfg).key
    if len(key) == 1 and key[0][0] == 1:  # one frame (an image): one chunk, nothing to split
        return [_cached_plan(key, cfg, policy)]
    return list(_cached_plans(key, cfg, policy))


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _cached_plans(grid: tuple, cfg: VisionConfig, policy: BucketPolicy) -> tuple[Plan, ...]:
    """One plan per chunk. Chunks with the same frames share one plan's arrays: the plan is cached
    under the chunk's merged rows, so the chunks of a long video ([[10, h, w], [2, h, w]],
    [[8, h, w], [4, h, w]], ...) build one plan and differ only in grid_thw and span."""
    chunks = split(np.array(grid, np.int64), policy)
    total = sum(t * h * w for t, h, w in grid)
    plans, offset = [], 0
    for c in range(len(chunks)):
        key = chunks.key(c)
        plan = _cached_plan(tuple(map(tuple, key.tolist())), cfg, policy)
        n = plan.n_patches
        if len(key) != chunks.starts[c + 1] - chunks.starts[c]:  # rows were merged: the chunk's own grid
            plan = dataclasses.replace(plan, grid_thw=_read_only(chunks.chunk(c).copy()))
        if n != total:  # one chunk of several: its own rows of the request
            plan = dataclasses.replace(plan, span=_span(offset, n, total))
        plans.append(plan)
        offset += n
    return tuple(plans)


def make_batch_plan(grid_thw, cfg: VisionConfig, policy: BucketPolicy | None = None) -> Plan:
    """The plan of a batch of independent items (a service's batch) in a bounded set of shapes.

    A ladder plan's K and T follow the mix of frame sizes, so batches of random mixes compile
    program after program. Here the bucket is a function of the padded rows (`batch_rows`: two
    rungs per octave; blocks of `policy.block` rows), the frame class of the widest frame (`frame_class`)
    and the window variant (W_pad typical or worst) alone: K = `batch_key_rows`, wide enough that
    each block's frames fit one key window, so T = N_pad / B. Results agree with any other
    bucket's within padding invariance. Not cached (a batch's grid rarely recurs); never split:
    N <= max_patches.
    """
    policy = policy or BucketPolicy()
    key = as_grid(grid_thw, cfg).key
    n_pad = batch_rows(sum(t * h * w for t, h, w in key), policy)
    block = policy.block_size(n_pad)
    widest = max(h * w for _, h, w in key)
    return build_plan(key, cfg, policy, n_pad, block, batch_key_rows(n_pad, block, frame_class(widest)))


def build_plan(
    grid: tuple, cfg: VisionConfig, policy: BucketPolicy, n_pad: int = 0, block: int = 0, key_rows: int = 0
) -> Plan:
    """The plan of a grid (a tuple of (t, h, w) rows) in a bucket of n_pad rows cut into blocks of
    `block` (0: the policy's, `padded_rows` and `block_size`): everything else in one numba call
    (kernels.build_plan), K and T chosen there unless key_rows > 0 fixes K."""
    g = np.array(grid, np.int64)  # writable: numba compiles its kernels for writable arrays
    n, n_frames = sum(t * h * w for t, h, w in grid), sum(t for t, _, _ in grid)
    if not n_pad:
        n_pad = policy.padded_rows(n, n_frames == 1)
        block = policy.block_size(n_pad, n_frames == 1)
    w_typical, w_worst = typical_windows(n_pad, cfg), worst_windows(n_pad, cfg)
    s = cfg.window_patches
    window = cfg.window_merge if cfg.windowed else 0  # Qwen2-VL, or Qwen2.5-VL without window layers
    # buffer size bound: W_pad <= w_worst; T <= NB + coarse(extras) <= NB + 4 F (a block's extra
    # tiles are fewer than its frames, a frame of r rows is in at most r / B + 2 blocks)
    out = POOL.take(4 * n_pad + 2 * w_worst * s + 4 * (n_pad // block + 4 * n_frames))
    buf, w_pad, key_rows, n_tiles = kernels.build_plan(
        g, cfg.spatial_merge_size, window, s, n_pad, block, policy.tight_for(n), w_typical, w_worst, key_rows, out
    )
    buf.setflags(write=False)  # before slicing: the views inherit it
    pos_end, seg_end, slot_end, tiles_end, tokens_end, size = kernels.buffer_layout.py_func(n_pad, n_tiles, w_pad, s)
    tiles = buf[slot_end:tiles_end].reshape(4, n_tiles)
    tokens, ids = buf[tiles_end:tokens_end].reshape(w_pad, s), buf[tokens_end:size].reshape(w_pad, s)
    if cfg.num_position_embeddings:  # Qwen3: the table's resampling (posembed caches it by grid too)
        pe_rows = n_pad
        pe_index, pe_weight = posembed.interpolation_indices_weights(g, cfg, rows=n_pad)
    else:
        pe_rows, pe_index, pe_weight = 0, _NO_POS_INDEX, _NO_POS_WEIGHT
    return Plan(
        bucket=Bucket(
            patches=n_pad,
            windows=w_pad,
            key_rows=key_rows,
            block=block,
            tiles=n_tiles,
            window_rows=s,
            pos_embed_rows=pe_rows,
            pos_embed_taps=pe_index.shape[1],
        ),
        pos_ids=buf[:pos_end].reshape(n_pad, 2),
        segment_ids=buf[pos_end:seg_end],
        window_tokens=tokens,
        window_ids=ids,
        window_slot=buf[seg_end:slot_end],
        tile_block=tiles[0],
        tile_first_frame=tiles[1],
        tile_last_frame=tiles[2],
        tile_key_start=tiles[3],
        span=_span(0, n, n),
        pos_embed_index=pe_index,
        pos_embed_weight=pe_weight,
        grid_thw=_read_only(g),
    )


# One plan in the policy's bucket, cached by grid: build_plan itself, no wrapper on the request path.
_cached_plan = functools.lru_cache(maxsize=PLAN_CACHE_SIZE)(build_plan)


def raster_to_merge_order(grid: np.ndarray, m: int) -> np.ndarray:
    """For rows that arrive in raster order per frame (PaddleOCR-VL): the raster row each row of the
    merge-unit order takes. int64 [sum t*h*w]; frame by frame, merge units of m x m patches in raster
    order, patches inside a unit in raster order (the order of every plan, and of HF's projector,
    which reshapes [t, h/m, m, w/m, m, D] -> [t, h/m, w/m, m, m, D])."""
    out, start = [], 0
    for t, h, w in np.asarray(grid, np.int64).tolist():
        raster = np.arange(h * w).reshape(h // m, m, w // m, m)  # [h/m, m, w/m, m]
        frame = raster.transpose(0, 2, 1, 3).reshape(-1)  # [h/m, w/m, m, m] -> [h * w]
        out.extend(start + f * h * w + frame for f in range(t))
        start += t * h * w
    return np.concatenate(out)


def _span(offset: int, n: int, total: int) -> np.ndarray:
    return _read_only(np.array([offset, n, total], np.int32))


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def clear_caches() -> None:
    """Forget every cached plan (their buffers return to the pool once nothing else holds them)."""
    _cached_plans.cache_clear()
    _cached_plan.cache_clear()
