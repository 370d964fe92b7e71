"""The compiled program: the encoder's forward for one device, its `shard_map` form for a mesh of
devices, and the shapes of a bucket's inputs (what `jax.jit(...).lower` takes). Shared by the
encoder (runtime/encoder.py) and the ahead-of-time compiles (tools/aot.py).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.config import VisionConfig, dtype_named


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
