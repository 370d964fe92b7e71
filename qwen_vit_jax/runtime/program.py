"""The compiled programs: the encoder's forward for one device, its `shard_map` form for a mesh of
devices, the shapes of a bucket's inputs (what `jax.jit(...).lower` takes), and `Programs`, a
tower's weights on its devices with one compiled program per bucket. Shared by the encoder
(runtime/encoder.py) and the ahead-of-time compiles (tools/aot.py).

One device is a mesh of one (maxtext's and jax-llm-examples' habit): every program is the
`shard_map` form, every input has a leading [D] axis, and `Programs.plan` is the one place that
tells one device (the bucket choice's plans, plan/choice.py) from several (frames balanced over
the devices, devices.py). Nothing else asks how many devices there are.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import threading
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.config import VisionConfig, dtype_named
from qwen_vit_jax.model.numerics import Numerics
from qwen_vit_jax.model.vit import abstract_model, as_bits, fill_state
from qwen_vit_jax.runtime import cost
from qwen_vit_jax.runtime.devices import Step, chunk_step, plan_steps


def forward(graphdef: nnx.GraphDef, state: nnx.State, pixels: jax.Array, plan: planlib.Plan):
    """The encoder's program for one device: (tokens, deepstack features: [] without deepstack
    mergers). pixels [N_pad, P] -> tokens [N_pad / mu, out_dim]."""
    return nnx.merge(graphdef, state)(pixels, plan, deepstack=True)


def mesh_program(forward_fn, mesh: Mesh):
    """The program of one bucket on a mesh: `shard_map` runs the single-device `forward_fn(state,
    pixels, plan)` on each device's slice (pixels [1, N_pad, P], plan leaves [1, ...]) with the
    replicated parameters; no collective, so devices never wait for each other inside a step."""
    data = P("data")

    def per_device(
        state, pixels, plan
    ):  # [1, N_pad, P] (or Patches of [1, ...]), Plan of [1, ...] -> ([1, N_pad / mu, out], [...])
        first = functools.partial(jax.tree.map, lambda a: a[0])
        out = forward_fn(state, first(pixels), first(plan))  # (tokens, features)
        return jax.tree.map(lambda a: a[None], out)

    # check_vma=False: the platforms' attention kernels (Pallas calls) do not declare how their
    # outputs vary over the mesh axis; every value here varies with its device's slice anyway.
    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), data, data), out_specs=data, check_vma=False)


def mesh_specs(specs: tuple[jax.ShapeDtypeStruct, planlib.Plan], mesh: Mesh):
    """One bucket's input shapes (`input_specs`) stacked for the mesh: a leading [D] axis sharded
    over the data axis."""
    sharding, d = NamedSharding(mesh, P("data")), mesh.devices.size
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((d, *a.shape), a.dtype, sharding=sharding), specs)


def input_specs(cfg: VisionConfig, bucket: planlib.Bucket, dtype: str, frames: int | None = None):
    """Shapes of one bucket's inputs: (pixels, abstract plan). pixels: float rows [N_pad, patch_dim]
    in the compute dtype (frames None), or `Patches` of `frames` frames per row (uint8
    [N_pad, frames, p, p, C] and the float32 [C, 256] table)."""
    n = bucket.patches
    if frames is None:
        pixels = jax.ShapeDtypeStruct((n, cfg.patch_dim), dtype_named(dtype))
    else:
        data = jax.ShapeDtypeStruct((n, frames, cfg.patch_size, cfg.patch_size, cfg.in_channels), np.uint8)
        table = jax.ShapeDtypeStruct((cfg.in_channels, 256), np.float32)
        pixels = planlib.Patches(data, table, cfg.temporal_patch_size)
    return pixels, planlib.Plan.abstract(bucket)


def enable_compilation_cache(path: str | os.PathLike, min_compile_seconds: float = 0.0) -> pathlib.Path:
    """Opt in to JAX's persistent compilation cache in directory `path` (created if missing).

    Process-wide (JAX's own setting, `jax_compilation_cache_dir`): every later compile of this
    process, ours or not, is looked up there first and stored there after. Programs that
    compiled faster than `min_compile_seconds` are not stored (JAX's default is 1 s; 0 stores
    every bucket). A cache written by another jax / jaxlib version or for another device is
    not used (JAX keys entries on both). Trusted data: do not point it at a directory others
    can write. Returns the resolved path.
    """
    from jax.experimental.compilation_cache import compilation_cache

    path = pathlib.Path(path).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"compilation cache path {path} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is on
    return path


class Programs:
    """A tower's weights on its devices and its compiled programs, one per bucket and pixel form.

    `graphdef` and `state` are the model split as NNX splits it (the state's stacked bfloat16
    block weights held as their uint16 bits: model.vit.as_bits); `forward(state, pixels, plan)` is
    the pure function every program compiles; `get(bucket, frames)` the compiled program of a
    bucket (compiled on first use, once however many threads ask); `flops` and `memory` what it
    computes and allocates. With several devices the parameters are replicated over `mesh` (a data
    axis) and a program takes every input with a leading [D] axis (`mesh_program`).

    Args:
      cfg: the tower's config.
      params: flat parameters (the converter's layout: "blocks.attn.qkv.kernel" -> array).
      numerics: how the tower computes (model.numerics.numerics_for: dtype, device, attention).
      devices: one device, or several local ones (distinct, one platform: devices.check_devices).
    """

    def __init__(self, cfg: VisionConfig, params: dict[str, np.ndarray], numerics: Numerics, devices: list):
        self.cfg, self.numerics, self.devices = cfg, numerics, list(devices)
        self.mesh = Mesh(np.array(self.devices), ("data",))  # one device: a mesh of one
        self.inputs = NamedSharding(self.mesh, P("data"))  # every input's leading [D] axis, a slice per device
        self.graphdef, abstract = nnx.split(abstract_model(cfg, numerics=numerics))
        # replicated (every device holds all parameters), placed in one go
        self.state = as_bits(fill_state(abstract, params, numerics, NamedSharding(self.mesh, P())))
        # How a request becomes program calls, chosen once: one device runs the bucket choice's
        # plans (chunks, declared sizes, batch plans); several balance its frames (devices.py).
        self._steps = _chunk_steps if len(self.devices) == 1 else functools.partial(_balanced_steps, len(self.devices))
        self.compile_seconds: dict[planlib.Bucket, float] = {}  # summed over a bucket's pixel forms
        self._compiled: dict[tuple[planlib.Bucket, int | None], jax.stages.Compiled] = {}  # (bucket, frames)
        self._lock = threading.Lock()  # held while compiling: a new bucket is compiled once
        self._flops: dict[planlib.Bucket, float] = {}

    @property
    def dtype(self) -> str:
        return self.numerics.dtype

    @property
    def compile_count(self) -> int:
        """Programs compiled so far (one per bucket and pixel form; one loaded from the persistent
        compilation cache counts too)."""
        return len(self._compiled)

    def forward(self, state: nnx.State, pixels, plan: planlib.Plan):
        """The program of one device: (tokens, deepstack features: [] without deepstack mergers)."""
        return forward(self.graphdef, state, pixels, plan)

    def input_specs(self, bucket: planlib.Bucket, frames: int | None = None):
        """Shapes of one bucket's inputs on one device (`input_specs`)."""
        return input_specs(self.cfg, bucket, self.dtype, frames)

    def plan(self, choice: planlib.BucketChoice, grid: planlib.Grid, batched: bool = False) -> list[Step]:
        """A validated grid's program calls, one `Step` each (its plans stacked [D, ...] and where its
        rows go). One device: `choice.plans` (or `choice.batch_plans` when `batched`: the grid's
        rows are independent items). Several: its frames balanced over the devices
        (devices.plan_steps) with the choice's policy, tight for a declared size."""
        return self._steps(choice, grid, batched)

    def ready(self, bucket: planlib.Bucket, frames: int | None = None) -> bool:
        """Whether `get(bucket, frames)` returns at once (its program is compiled)."""
        return (bucket, frames) in self._compiled

    def get(self, bucket: planlib.Bucket, frames: int | None = None) -> jax.stages.Compiled:
        """The compiled program of `bucket` for float pixel rows (frames None) or for `Patches` of
        `frames` frames per row; called as program(state, pixels, plan) -> (tokens, features), every
        input and output with a leading [D] axis (a Step's)."""
        key = (bucket, frames)
        program = self._compiled.get(key)
        if program is not None:  # the hot path takes no lock
            return program
        with self._lock:  # one compile at a time; a waiter finds the program done
            program = self._compiled.get(key)
            if program is not None:
                return program
            t0 = time.perf_counter()
            specs = mesh_specs(self.input_specs(bucket, frames), self.mesh)
            program = jax.jit(mesh_program(self.forward, self.mesh)).lower(self.state, *specs).compile()
            self.compile_seconds[bucket] = self.compile_seconds.get(bucket, 0.0) + time.perf_counter() - t0
            self._compiled[key] = program  # last: a lock-free reader sees a finished entry
        return program

    def flops(self, bucket: planlib.Bucket) -> float:
        """The matmul FLOPs of one device's program of `bucket` as it runs (cost.dot_flops)."""
        if bucket not in self._flops:
            traced = jax.jit(self.forward).trace(self.state, *self.input_specs(bucket))
            self._flops[bucket] = cost.dot_flops(traced.jaxpr)
        return self._flops[bucket]

    def memory(self, bucket: planlib.Bucket, frames: int | None = None):
        """The compiled program's memory analysis (temp_size_in_bytes, argument_size_in_bytes, ...)."""
        return self.get(bucket, frames).memory_analysis()


def _chunk_steps(choice: planlib.BucketChoice, grid: planlib.Grid, batched: bool) -> list[Step]:
    """One device: the bucket choice's plans, each a step of a mesh of one."""
    plans = choice.batch_plans(grid) if batched else choice.plans(grid)
    return [chunk_step(p, choice.cfg.merge_unit) for p in plans]


def _balanced_steps(n_devices: int, choice: planlib.BucketChoice, grid: planlib.Grid, batched: bool) -> list[Step]:
    """Several devices: the frames balanced over them (a batch's items too: they are frames); a
    declared size's shards padded tightly."""
    policy = dataclasses.replace(choice.policy, tight=True) if choice.is_declared(grid) else choice.policy
    return plan_steps(grid, choice.cfg, policy, n_devices)
