"""A request's program calls: `prepare` (host only: plan, check, pad) and `run` (one transfer,
every call dispatched before anything is fetched, results unpadded in request order). Split so that a
caller can prepare the next request on the host while the device runs this one (a service's
batches), and so that a benchmark can time the parts. `prepare_batch` plans independent items as
one call (a service's batch) and `ready_part` finds its longest part whose program is compiled.

A request's calls are `Programs.plan`'s steps (one device: a chunk's plan each; a mesh: its frames
balanced over the devices); every input has a leading [D] axis, D = 1 on one device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.config import dtype_named
from qwen_vit_jax.runtime import batching, cost
from qwen_vit_jax.runtime import devices as devlib
from qwen_vit_jax.runtime.pixels import checked_pixels
from qwen_vit_jax.runtime.program import Programs


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Prepared:
    """A request (or a batch of items) planned for the device, host arrays only.

    grid: its validated grid.
    steps: per program call, a devices.Step: its plan (the devices' plans stacked, a leading [D]
      axis; D = 1 on one device) and where its rows go.
    frames: the programs' pixel form: None for float rows, else the `Patches`' frames per row.
    dtype: the compute dtype's name (float rows are padded into it).
    items: a batch's (`prepare_batch`) merged tokens per item, in order; None for a request.
    load: returns the checked, unpadded pixels; called once, when `calls` is first read.
    calls: per step, (pixels padded [D, N_pad, ...] in the compute dtype or `Patches`, its Plan).
    """

    grid: planlib.Grid
    steps: list[devlib.Step]
    frames: int | None
    dtype: str
    items: tuple[int, ...] | None = None
    load: Callable[[], object] = dataclasses.field(repr=False)

    @functools.cached_property
    def calls(self) -> list[tuple[np.ndarray | planlib.Patches, planlib.Plan]]:
        px, dtype = self.load(), dtype_named(self.dtype)
        return [(s.take(px, dtype), s.plan) for s in self.steps]

    @property
    def pixels(self) -> list[np.ndarray | planlib.Patches]:
        return [x for x, _ in self.calls]

    @property
    def buckets(self) -> list[planlib.Bucket]:
        return [s.plan.bucket for s in self.steps]

    @property
    def program_keys(self) -> tuple[tuple[planlib.Bucket, int | None], ...]:
        """The programs it runs, (bucket, frames) each: what `Programs.get` compiles."""
        return tuple((s.plan.bucket, self.frames) for s in self.steps)

    @property
    def padded_rows(self) -> int:
        """Rows its calls compute on one device, padding included."""
        return sum(b.patches for b in self.buckets)

    def split(self, rows: np.ndarray) -> list[np.ndarray]:
        """A batch's result rows [tokens, ...] -> one array per item (views)."""
        return batching.split(rows, self.items)


def prepare(
    programs: Programs,
    choice: planlib.BucketChoice,
    pixel_values,
    grid_thw,
    check_finite: bool = True,
    batched: bool = False,
) -> Prepared:
    """Plan a request (`Programs.plan`: one device `choice.plans`, or `choice.batch_plans` when
    `batched`; a mesh its frames balanced), check its pixels once (runtime/pixels.py) and pad
    them to every call's bucket."""
    grid = planlib.as_grid(grid_thw, programs.cfg)  # validated once: every step below takes the Grid
    steps = programs.plan(choice, grid, batched)
    px = checked_pixels(pixel_values, grid, programs.cfg, check_finite)
    prepared = Prepared(grid=grid, steps=steps, frames=_frames([px]), dtype=programs.dtype, load=lambda: px)
    prepared.calls  # noqa: B018 (padded now: the host half of the work, done here)
    return prepared


def prepare_batch(programs: Programs, choice: planlib.BucketChoice, items, check_finite: bool = True) -> Prepared:
    """Independent items [(pixels, grid [k, 3]), ...] planned as one call: their rows in a batch plan
    (one item alone as `encode` plans it). Only planned: the pixels are joined, checked and padded
    when its calls are first read (`run`)."""
    items = list(items)
    if not items:
        raise ValueError("a batch holds at least one item")
    grids = [np.asarray(g).reshape(-1, 3) for _, g in items]
    grid = planlib.as_grid(np.concatenate(grids), programs.cfg)
    steps = programs.plan(choice, grid, batched=True)
    mu = programs.cfg.merge_unit
    tokens = tuple(int((g[:, 0] * g[:, 1] * g[:, 2]).sum()) // mu for g in grids)
    parts = [px for px, _ in items]

    def load():
        return checked_pixels(batching.join(parts), grid, programs.cfg, check_finite)

    return Prepared(grid=grid, steps=steps, frames=_frames(parts), dtype=programs.dtype, items=tokens, load=load)


def ready_part(programs: Programs, choice: planlib.BucketChoice, items, check_finite: bool = True) -> Prepared:
    """The longest leading part of a batch (`prepare_batch(items)`) whose programs are compiled, or
    its first item alone (planned as `encode` plans it, whether compiled or not). Parts whose batch
    plans would share a shape (their rows' rung and widest frame class) are planned once."""
    items = list(items)
    rows = np.cumsum([len(px) for px, _ in items])
    widest = np.maximum.accumulate([int((np.asarray(g)[..., 1] * np.asarray(g)[..., 2]).max()) for _, g in items])
    seen = set()
    for k in range(len(items), 1, -1):
        if rows[k - 1] <= choice.policy.max_patches:
            shape = (planlib.batch_rows(int(rows[k - 1]), choice.policy), planlib.frame_class(int(widest[k - 1])))
            if shape in seen:
                continue
            seen.add(shape)
        part = prepare_batch(programs, choice, items[:k], check_finite)
        if all(programs.ready(*p) for p in part.program_keys):
            return part
    return prepare_batch(programs, choice, items[:1], check_finite)


def _frames(parts: list) -> int | None:
    """The program's pixel form for these pixels: None for float rows, else the `Patches`' frames
    per row (joined items: the most of any, as Patches.concatenate repeats an image's frame)."""
    if all(isinstance(p, planlib.Patches) for p in parts):
        return max(p.frames_per_patch for p in parts)
    return None


def run(programs: Programs, prepared: Prepared, return_deepstack: bool = False):
    """Send a prepared request's inputs in one transfer, dispatch every call, then fetch: float32
    tokens [N // merge_unit, out_dim] in request order, with return_deepstack (tokens, [one such
    array per deepstack layer])."""
    inputs = jax.device_put(prepared.calls, programs.inputs)  # a slice of every input's [D] axis per device
    frames = prepared.frames
    outs = [programs.get(p.bucket, frames)(programs.state, x, p) for x, p in inputs]  # (tokens, features) each

    def rows(arrays):  # one [D, N_pad / mu, out] per step -> the request's rows in order
        return np.concatenate(
            [np.asarray(a).reshape(-1, a.shape[-1])[s.gather] for s, a in zip(prepared.steps, arrays)]
        )

    tokens = rows([o[0] for o in outs])
    if not return_deepstack:
        return tokens
    return tokens, [rows([o[1][k] for o in outs]) for k in range(programs.cfg.num_deepstack)]


def buckets(programs: Programs, choice: planlib.BucketChoice, grid_thw, batched: bool = False) -> list[planlib.Bucket]:
    """The bucket of each program call the next encode of a request makes (a chunk, or a mesh step),
    without its pixels; `batched`: of its rows as one batch (`prepare_batch`)."""
    return [s.plan.bucket for s in programs.plan(choice, planlib.as_grid(grid_thw, programs.cfg), batched)]


def warmup(programs: Programs, choice: planlib.BucketChoice, grids, *, tight: bool, uint8: bool, batched: bool):
    """`VisionEncoder.warmup`: compile the buckets of each grid's program calls (declared first
    when `tight`; its rows as one batch when `batched`); the buckets, in order."""
    out = []
    for g in grids:
        g = choice.declare(g) if tight else planlib.as_grid(g, programs.cfg)
        for bucket in buckets(programs, choice, g, batched):
            programs.get(bucket, patches_frames(g, programs.cfg) if uint8 else None)
            out.append(bucket)
    return out


def cost_report(programs: Programs, choice: planlib.BucketChoice, grid_thw) -> dict:
    """What the next encode of a request costs: a dict with

    `buckets` (one per program call: a chunk, tight ones for a declared grid and a request's
    recurring chunks; on several devices one per mesh step, run by every device), `compiled_flops`
    (the matmuls of those programs as they run: cost.dot_flops, summed over devices),
    `ideal_flops` (analytic: the same matmuls on the real rows only, attention over the real frames
    / windows), `flops_ratio`, `temp_bytes` (the compiled programs' largest temp allocation, per
    device, of the programs for float rows), `patches` and `padded_patches` (summed over devices),
    `host_to_device_bytes` (pixels and plans of every program call, all devices, as uint8
    `Patches`: what encode_images, encode_video and the CLI send), `host_to_device_bytes_float`
    (the same with float rows in the compute dtype, as `encode(pixel_values)` sends them) and
    `hf_pixel_bytes` (what HF's float32 pixel_values of the request weigh, for comparison).
    """
    g = planlib.as_grid(grid_thw, programs.cfg)
    cfg, calls = programs.cfg, buckets(programs, choice, g)  # the next encode's (tight ones for a recurring grid)
    copies = len(programs.devices)  # every device runs every step's bucket
    compiled = copies * sum(programs.flops(b) for b in calls)
    frames, windows = planlib.segment_lengths(g, cfg)
    ideal = cost.ideal_flops(cfg, frames, windows)
    temp = max(programs.memory(b).temp_size_in_bytes for b in calls)

    def sent(frames):  # bytes of every program call's inputs, all devices
        return copies * sum(_nbytes(programs.input_specs(b, frames)) for b in calls)

    return {
        "buckets": [dataclasses.asdict(b) for b in calls],
        "patches": g.patches,
        "padded_patches": copies * sum(b.patches for b in calls),
        "compiled_flops": compiled,
        "ideal_flops": ideal,
        "flops_ratio": compiled / ideal,
        "temp_bytes": int(temp),
        "host_to_device_bytes": sent(patches_frames(g, cfg)),
        "host_to_device_bytes_float": sent(None),
        "hf_pixel_bytes": g.patches * cfg.patch_dim * 4,
    }


def patches_frames(grid: planlib.Grid, cfg) -> int:
    """The frames per row of the `Patches` the preprocessors make for a grid: 1 for images (every
    t = 1), T when it holds a video."""
    return 1 if all(t == 1 for t, _, _ in grid.key) else cfg.temporal_patch_size


def _nbytes(tree) -> int:
    """Bytes of every array (or shape struct) in a pytree."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))
