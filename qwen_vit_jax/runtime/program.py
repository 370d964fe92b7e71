"""The compiled program: the encoder's forward for one device, its `shard_map` form for a mesh of
devices, and the shapes of a bucket's inputs (what `jax.jit(...).lower` takes). Shared by the
encoder (runtime/encoder.py) and the ahead-of-time compiles (tools/aot.py).
"""

from __future__ import annotations

import jax
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

    def per_device(state, pixels, plan):  # [1, N_pad, P], Plan of [1, ...] -> ([1, N_pad / mu, out], [...])
        out = forward_fn(state, pixels[0], jax.tree.map(lambda a: a[0], plan))  # (tokens, features)
        return jax.tree.map(lambda a: a[None], out)

    # check_vma=False: the platforms' attention kernels (Pallas calls) do not declare how their
    # outputs vary over the mesh axis; every value here varies with its device's slice anyway.
    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), data, data), out_specs=data, check_vma=False)


def mesh_specs(specs: tuple[jax.ShapeDtypeStruct, planlib.Plan], mesh: Mesh):
    """One bucket's input shapes (`input_specs`) stacked for the mesh: a leading [D] axis sharded
    over the data axis."""
    sharding, d = NamedSharding(mesh, P("data")), mesh.devices.size
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((d, *a.shape), a.dtype, sharding=sharding), specs)


def input_specs(cfg: VisionConfig, bucket: planlib.Bucket, dtype: str) -> tuple[jax.ShapeDtypeStruct, planlib.Plan]:
    """Shapes of one bucket's inputs: (pixels, abstract plan)."""
    pixels = jax.ShapeDtypeStruct((bucket.patches, cfg.patch_dim), dtype_named(dtype))
    return pixels, planlib.Plan.abstract(bucket)
