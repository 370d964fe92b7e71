"""A request's program calls as mesh steps: on several local devices its frames balanced across
the mesh, one bucket for all of them (`plan_steps`); on one device (a mesh of one) each chunk's
plan as a step of its own (`chunk_step`).

Frames never attend to each other (full attention is per frame, windows lie inside a frame, the
merger is per 2x2 patch group), so a request splits across D devices at frame boundaries with no
traffic between them. The host plans it as a list of `Step`s; each step is one call of one
compiled program on the whole mesh:

  * rounds: the frames are cut into consecutive rounds so that no device gets more than
    policy.max_patches rows in a round (unless it holds a single larger frame), choosing among a
    few round counts the one that pads least (`_rounds`);
  * in a round, frames go to devices largest first, each to the device with the fewest rows so
    far, earlier rounds included (LPT; ties to the lower device), and keep their request order on
    their device; a device left without a frame gets a 2x2-patch placeholder frame whose output
    is dropped;
  * every device's frames are planned with the same patch count (the busiest device's rows
    padded as the policy pads: up to a rung, or with BucketPolicy(tight=True) to the blocks) and
    the plans padded to one bucket: the most window slots, tiles and key rows of any of them
    (an extra slot is empty, an extra tile is the documented empty tile, a wider key window only
    holds more masked keys), so one program per (bucket, mesh) serves;
  * the D plans are stacked into one Plan whose every leaf has a leading [D] axis, the pixels
    into [D, N_pad, patch_dim]; the result [D, N_pad / merge_unit, out_dim] is put back in
    request order by `Step.gather`, an index computed here.

Nothing here touches a device; calls.py places and runs the steps.
"""

from __future__ import annotations

import dataclasses
import heapq

import jax
import numpy as np

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.config import VisionConfig

PLACEHOLDER = (1, 2, 2)  # the frame an idle device runs: one merge unit, output dropped


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """One mesh call: D equal-bucket plans stacked, and where every frame's rows go.

    plan: a Plan whose leaves have a leading [D] axis (grid_thw None); plan.bucket is shared.
    runs: per device, int64 [r, 2] (first request row, rows): the request rows it holds, in order,
      copied one after another from row 0 of its shard.
    gather: int64 [tokens of this round]: for each merged token of the round, in request order,
      its row in the result flattened to [D * N_pad / merge_unit]; a slice where they are the
      first rows (one device: a chunk's).
    rows: real patch rows per device (for balance reports).
    """

    plan: planlib.Plan
    runs: tuple[np.ndarray, ...]
    gather: np.ndarray | slice
    rows: tuple[int, ...]

    def take(self, pixel_values, dtype):
        """The step's pixels: [D, N_pad, patch_dim] in `dtype`, each shard zero-padded; for `Patches`,
        Patches of [D, N_pad, S, p, p, C] uint8 with the table stacked [D, C, 256] (one per device)."""
        if isinstance(pixel_values, planlib.Patches):
            table = np.broadcast_to(pixel_values.table, (len(self.runs), *pixel_values.table.shape))
            return planlib.Patches(self.take(pixel_values.data, np.uint8), table, pixel_values.temporal_patch_size)
        n_pad = self.plan.bucket.patches
        out = np.zeros((len(self.runs), n_pad, *pixel_values.shape[1:]), dtype)  # [D, N_pad, P]
        for d, runs in enumerate(self.runs):
            at = 0
            for start, n in runs.tolist():
                out[d, at : at + n] = pixel_values[start : start + n]
                at += n
        return out


def chunk_step(plan: planlib.Plan, merge_unit: int) -> Step:
    """One device's call of one chunk's plan (plan/choice.py) as a step of a mesh of one: its rows
    from row 0 of the one shard, its tokens the result's first ones."""
    n = plan.n_patches
    runs = np.array([[plan.offset, n]], np.int64)
    return Step(plan=stack_plans([plan]), runs=(runs,), gather=slice(0, n // merge_unit), rows=(n,))


def balance(sizes: np.ndarray, n_bins: int, loads: list[int] | None = None) -> list[list[int]]:
    """Assign items of `sizes` [F] to `n_bins` bins, largest first, each to the bin with the least
    total so far (ties: the lower bin); within a bin, items in their original order. `loads`:
    the bins' totals before (earlier rounds), so that rounds even each other out.

    Largest-first greedy keeps max(bin) <= 4/3 of the optimum (Graham) and, for many small items,
    close to the mean. Deterministic: every process computes the same assignment.
    """
    order = np.argsort(-np.asarray(sizes, np.int64), kind="stable")  # [F] largest first, ties by index
    heap = [(0 if loads is None else int(loads[b]), b) for b in range(n_bins)]
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i in order.tolist():
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + int(sizes[i]), b))
    return [sorted(b) for b in bins]


def plan_steps(grid_thw, cfg: VisionConfig, policy: planlib.BucketPolicy, n_devices: int) -> list[Step]:
    """The mesh steps of a request over `n_devices` devices (see the module docstring)."""
    g = planlib.as_grid(grid_thw, cfg).array  # int64 [k, 3], validated once
    t = g[:, 0]
    frame_h, frame_w = np.repeat(g[:, 1], t), np.repeat(g[:, 2], t)  # [F] each
    size = frame_h * frame_w  # [F] rows per frame
    start = np.concatenate([[0], np.cumsum(size)[:-1]])  # [F] first request row of each frame
    rounds = _rounds(size, n_devices, policy)
    mu = cfg.merge_unit
    steps = []
    for a, b, sub in rounds:
        bins = [[a + i for i in f] for f in sub]
        rows = [int(size[f].sum()) for f in bins]
        n_pad = policy.padded_rows(max(rows))  # a rung (or with policy.tight a tileable size)
        # The floor makes every shard's padded rows n_pad (n_pad tiles into blocks, so the ladder
        # from it starts at n_pad itself); the block is a function of n_pad alone (a one-frame shard
        # too: frame_block = block), so it is shared.
        floor = dataclasses.replace(
            policy, min_patches=n_pad, max_patches=max(policy.max_patches, n_pad), frame_block=policy.block
        )
        plans = [planlib.make_plan(_sub_grid(f, frame_h, frame_w), cfg, floor) for f in bins]
        buckets = [p.bucket for p in plans]
        assert all(bk.patches == n_pad and bk.block == buckets[0].block for bk in buckets), buckets
        bucket = dataclasses.replace(
            buckets[0],
            windows=max(bk.windows for bk in buckets),
            key_rows=max(bk.key_rows for bk in buckets),
            tiles=max(bk.tiles for bk in buckets),
        )
        stacked = stack_plans([pad_plan(p, bucket) for p in plans])
        # gather: device d's k-th frame sits at merged row d * N_pad / mu + (its shard offset) / mu
        where = np.empty(b - a, np.int64)  # [frames of the round] first merged row in the result
        for d, f in enumerate(bins):
            if f:
                local = np.concatenate([[0], np.cumsum(size[f])[:-1]])
                where[np.asarray(f) - a] = (d * n_pad + local) // mu
        tokens = size[a:b] // mu
        first = np.repeat(where - np.concatenate([[0], np.cumsum(tokens)[:-1]]), tokens)
        gather = first + np.arange(int(tokens.sum()))  # [round tokens]
        steps.append(
            Step(plan=stacked, runs=tuple(_runs(f, start, size) for f in bins), gather=gather, rows=tuple(rows))
        )
    return steps


def _rounds(size: np.ndarray, n_devices: int, policy: planlib.BucketPolicy) -> list[tuple[int, int, list]]:
    """Cut the frames (rows per frame `size` [F]) into consecutive rounds and balance each:
    [(first frame, stop, balance(...) of the round)].

    A round may give a device at most policy.max_patches rows (the per-program budget) unless
    the device holds a single larger frame. Among r = the fewest rounds that allow it .. 4 more
    (rounds of near-equal rows, batching.split_even), the cut with the least
    sum(padded_rows(busiest device's rows)) + chunk_penalty per round wins (ties: fewer rounds): the
    ladder is geometric, so one more round can pad much less (100 frames of 1296 rows on 8 devices:
    one round of 13 frames on the busiest device pads to 20480 rows, two rounds of 7 frames to
    2 x 10240).
    """
    from qwen_vit_jax.runtime.batching import split_even

    total, cap, penalty = int(size.sum()), policy.max_patches, planlib.chunk_penalty(policy)
    last = len(size)  # one frame per round always fits
    best, best_cost, r = None, None, min(last, max(1, -(-total // (n_devices * cap))))
    while r <= last:
        cut = []
        cost = 0
        ok = True
        carried = [0] * n_devices  # each device's rows in earlier rounds
        for a, b in split_even(size, r):
            if a == b:
                continue
            bins = balance(size[a:b], n_devices, carried)
            loads = [int(size[a:b][f].sum()) for f in bins]
            carried = [c + n for c, n in zip(carried, loads)]
            ok &= all(n <= cap or len(f) == 1 for n, f in zip(loads, bins))
            cost += policy.padded_rows(max(loads)) + penalty
            cut.append((a, b, bins))
        if ok and (best is None or cost < best_cost):
            best, best_cost = cut, cost
        if best is not None:
            last = min(last, r + 4)
        r += 1
    return best


def _sub_grid(frames: list[int], frame_h: np.ndarray, frame_w: np.ndarray) -> np.ndarray:
    """The grid of a device's frames, consecutive equal (h, w) merged into one row (a plan depends
    on the frame sequence only, so this is also its cache key): int64 [k', 3]."""
    if not frames:
        return np.array([PLACEHOLDER], np.int64)
    rows: list[list[int]] = []
    for f in frames:
        h, w = int(frame_h[f]), int(frame_w[f])
        if rows and rows[-1][1] == h and rows[-1][2] == w:
            rows[-1][0] += 1
        else:
            rows.append([1, h, w])
    return np.array(rows, np.int64)


def _runs(frames: list[int], start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """A device's request rows as (first row, rows) runs, adjacent frames merged: int64 [r, 2]."""
    runs: list[list[int]] = []
    for f in frames:
        s, n = int(start[f]), int(size[f])
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1][1] += n
        else:
            runs.append([s, n])
    return np.array(runs, np.int64).reshape(-1, 2)


def pad_plan(plan: planlib.Plan, bucket: planlib.Bucket) -> planlib.Plan:
    """`plan` grown to `bucket` (same patches and block; at least its windows, tiles, key rows).

    Exact: an added window slot is empty (tokens and ids -1), so nothing gathers from it; an
    added tile is the Plan's empty tile (block 0, frames 0 .. -1, window start 0), which adds
    zeros; more key rows only widen each tile's key window with masked keys (a window that would
    pass the last row starts earlier, still holding the tile's frames).
    """
    own = plan.bucket
    if (own.patches, own.block, own.window_rows) != (bucket.patches, bucket.block, bucket.window_rows) or (
        own.windows > bucket.windows
        or own.tiles > bucket.tiles
        or not own.key_rows <= bucket.key_rows <= bucket.patches
    ):
        raise ValueError(f"cannot pad a plan of {own} to {bucket}")
    if own == bucket:
        return plan
    extra_w, extra_t = bucket.windows - own.windows, bucket.tiles - own.tiles

    def grow(a, n, fill):  # a [X, ...] -> [X + n, ...], new entries `fill`
        return np.concatenate([a, np.full((n, *a.shape[1:]), fill, a.dtype)])

    return dataclasses.replace(
        plan,
        bucket=bucket,
        window_tokens=grow(plan.window_tokens, extra_w, -1),
        window_ids=grow(plan.window_ids, extra_w, -1),
        tile_block=grow(plan.tile_block, extra_t, 0),
        tile_first_frame=grow(plan.tile_first_frame, extra_t, 0),
        tile_last_frame=grow(plan.tile_last_frame, extra_t, -1),
        tile_key_start=grow(np.minimum(plan.tile_key_start, bucket.patches - bucket.key_rows), extra_t, 0),
    )


def stack_plans(plans: list[planlib.Plan]) -> planlib.Plan:
    """Plans of one bucket -> one Plan with a leading [D] axis on every leaf (grid_thw None). One
    plan: views of its (cached, read-only) arrays, nothing copied."""
    if len(plans) == 1:
        return planlib.Plan(plans[0].bucket, *[getattr(plans[0], k)[None] for k in planlib.Plan.ARRAYS])
    leaves = [[getattr(p, k) for k in planlib.Plan.ARRAYS] for p in plans]
    return planlib.Plan(plans[0].bucket, *[np.stack(col) for col in zip(*leaves)])


def check_devices(devices) -> list:
    """`devices` as a list of distinct devices of this process (a mesh spans local devices only:
    several hosts each run their own encoder on their own inputs)."""
    devices = list(devices)
    if not devices:
        raise ValueError("devices= is empty: give at least one device (e.g. jax.local_devices())")
    if not all(isinstance(d, jax.Device) for d in devices):
        raise ValueError(f"devices= must hold jax.Device objects, got {devices!r}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices= holds a device twice: {devices}")
    me = jax.process_index()
    if foreign := [d for d in devices if d.process_index != me]:
        raise ValueError(
            f"devices= holds devices of other processes {foreign}; an encoder runs on this "
            f"process's devices (jax.local_devices()); split the inputs across processes"
        )
    if len({d.platform for d in devices}) > 1:
        raise ValueError(f"devices= mixes platforms: {devices}")
    return devices
