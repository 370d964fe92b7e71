"""A request's program calls: `prepare` (host only: plan, check, pad) and `run` (one transfer, every
call dispatched before anything is fetched, results unpadded in request order). Split so that a
caller can prepare the next request on the host while the device runs this one (a service's
batches), and so that a benchmark can time the parts.

On one device a request's chunks each get a plan (the bucket choice, plan/choice.py) and its
pixels padded to that plan's bucket; on a mesh its frames are balanced over the devices
(devices.py), one call per step, every input with a leading [D] axis.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.config import dtype_named
from qwen_vit_jax.runtime import cost
from qwen_vit_jax.runtime import devices as devlib
from qwen_vit_jax.runtime.pixels import checked_pixels
from qwen_vit_jax.runtime.program import Programs


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
    """A request ready for the device, host arrays only.

    grid: the request's validated grid.
    calls: per program call, (pixels, plan): pixels padded to the plan's bucket ([N_pad, patch_dim]
      in the compute dtype, or `Patches`; on a mesh [D, N_pad, ...]) and its Plan (on a mesh the
      devices' plans stacked).
    frames: the programs' pixel form: None for float rows, else the `Patches`' frames per row.
    steps: on a mesh, the steps that put results back in request order (devices.Step); else None.
    """

    grid: planlib.Grid
    calls: list[tuple[np.ndarray | planlib.Patches, planlib.Plan]]
    frames: int | None
    steps: list[devlib.Step] | None = None

    @property
    def plans(self) -> list[planlib.Plan]:
        return [p for _, p in self.calls]

    @property
    def pixels(self) -> list[np.ndarray | planlib.Patches]:
        return [x for x, _ in self.calls]

    @property
    def buckets(self) -> list[planlib.Bucket]:
        return [p.bucket for _, p in self.calls]


def prepare(
    programs: Programs,
    choice: planlib.BucketChoice,
    pixel_values,
    grid_thw,
    check_finite: bool = True,
    batched: bool = False,
) -> Prepared:
    """Plan a request (one device: `choice.plans`, or `choice.batch_plans` when `batched`; a mesh:
    `devices.plan_steps` with choice's policy), check its pixels once (runtime/pixels.py) and pad
    them to every call's bucket."""
    grid = planlib.as_grid(grid_thw, programs.cfg)  # validated once: every step below takes the Grid
    dtype = dtype_named(programs.dtype)
    if programs.mesh is None:
        plans = choice.batch_plans(grid) if batched else choice.plans(grid)
        px = checked_pixels(pixel_values, grid, programs.cfg, check_finite)
        return Prepared(grid=grid, calls=[(p.pad_rows(px, dtype), p) for p in plans], frames=_frames(px))
    steps = devlib.plan_steps(grid, programs.cfg, choice.policy, len(programs.devices))
    px = checked_pixels(pixel_values, grid, programs.cfg, check_finite)
    return Prepared(grid=grid, calls=[(s.take(px, dtype), s.plan) for s in steps], frames=_frames(px), steps=steps)


def _frames(px) -> int | None:
    """The program's pixel form for these (checked, unpadded) pixels: None for float rows, else the
    `Patches`' frames per row."""
    return px.frames_per_patch if isinstance(px, planlib.Patches) else None


def run(programs: Programs, prepared: Prepared, return_deepstack: bool = False):
    """Send a prepared request's inputs in one transfer, dispatch every call, then fetch: float32
    tokens [N // merge_unit, out_dim] in request order, with return_deepstack (tokens, [one such
    array per deepstack layer])."""
    if programs.mesh is None:
        where = programs.devices[0]
    else:
        where = NamedSharding(programs.mesh, P("data"))  # leading [D] axis of every input, a slice per device
    inputs = jax.device_put(prepared.calls, where)
    frames = prepared.frames
    outs = [programs.get(p.bucket, frames)(programs.state, x, p) for x, p in inputs]  # (tokens, features) each
    if prepared.steps is None:

        def rows(arrays):  # one [N_pad / mu, out] per call -> its real rows, calls in order
            return np.concatenate([p.unpad(np.asarray(a)) for p, a in zip(prepared.plans, arrays)])

    else:

        def rows(arrays):  # one [D, N_pad / mu, out] per step -> the request's rows in order
            return np.concatenate(
                [np.asarray(a).reshape(-1, a.shape[-1])[s.gather] for s, a in zip(prepared.steps, arrays)]
            )

    tokens = rows([o[0] for o in outs])
    if not return_deepstack:
        return tokens
    return tokens, [rows([o[1][k] for o in outs]) for k in range(programs.cfg.num_deepstack)]


def buckets(programs: Programs, choice: planlib.BucketChoice, grid_thw) -> list[planlib.Bucket]:
    """The bucket of each program call the next encode of a request makes (a chunk, or a mesh step),
    without its pixels."""
    grid = planlib.as_grid(grid_thw, programs.cfg)
    if programs.mesh is None:
        return [p.bucket for p in choice.plans(grid)]
    return [s.plan.bucket for s in devlib.plan_steps(grid, programs.cfg, choice.policy, len(programs.devices))]


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
    copies = len(programs.devices)  # 1 without a mesh: every device runs every step's bucket
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
