"""Compiled memory of one training step through the real-size tower, with and without remat.

    python benchmarks/bench_train_memory.py [--preset qwen2.5-vl-3b] [--grid 1,32,32]

The step is `jax.grad` of sum(tokens * w) w.r.t. every parameter and the pixels, for one bucket,
compiled from shapes only (abstract parameters: nothing is allocated or run). Reported: XLA's
memory analysis of the compiled step (temp = activations kept for the backward pass and scratch;
arguments = parameters + inputs; output = gradients), without and with `remat=True`
(jax.checkpoint per block), and the compile seconds.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
from flax import nnx

import qwen_vit_jax as qvj
from qwen_vit_jax.model.numerics import numerics_for
from qwen_vit_jax.model.vit import abstract_model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-vl-3b", choices=sorted(qvj.PRESETS))
    ap.add_argument("--grid", default="1,32,32", help="t,h,w of one image or video (default 1,32,32)")
    args = ap.parse_args()
    cfg = qvj.PRESETS[args.preset]
    grid = [[int(x) for x in args.grid.split(",")]]
    (plan,) = qvj.make_plans(grid, cfg)
    graphdef, state = nnx.split(abstract_model(cfg, numerics=numerics_for("float32")))
    pixels = jax.ShapeDtypeStruct((plan.bucket.patches, cfg.patch_dim), jnp.float32)
    weights = jax.ShapeDtypeStruct((plan.bucket.patches // cfg.merge_unit, cfg.out_dim), jnp.float32)
    print(
        f"{args.preset}, grid {grid}: bucket {plan.bucket.patches} rows; {jax.devices()[0].platform}, "
        f"{platform.processor() or platform.machine()}"
    )
    print(f"{'remat':>6} {'temp MiB':>9} {'args MiB':>9} {'out MiB':>8} {'compile s':>10}")
    for remat in (False, True):

        def step(state, pixels, weights, remat=remat):
            def loss(state, pixels):
                return jnp.sum(nnx.merge(graphdef, state)(pixels, plan, remat=remat) * weights)

            return jax.grad(loss, argnums=(0, 1))(state, pixels)

        t0 = time.perf_counter()
        compiled = jax.jit(step).lower(state, pixels, weights).compile()
        seconds = time.perf_counter() - t0
        m = compiled.memory_analysis()
        mib = 2.0**20
        print(
            f"{str(remat):>6} {m.temp_size_in_bytes / mib:>9.1f} {m.argument_size_in_bytes / mib:>9.1f} "
            f"{m.output_size_in_bytes / mib:>8.1f} {seconds:>10.1f}"
        )


if __name__ == "__main__":
    main()
