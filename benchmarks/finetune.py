"""Fine-tuning cost of the real Qwen2.5-VL-3B tower: compiled temp memory and step time of one
training step on one 36x36-patch image (1296 patches), full fine-tuning vs LoRA, with and without
remat, float32 and bfloat16.

    python -m benchmarks finetune [--dtypes float32,bfloat16] [--modes full,lora8,lora16] [--repeats 2]

A step is the loss sum(tokens * w) (w fixed random), its gradient w.r.t. the trained parameters
(every nnx.Param for full fine-tuning; nnx.LoRAParam for LoRA: rank r adapters on qkv and proj of
every block, qvj.add_lora) and an optax Adam update, in one jax.jit with the trained parameters and
the optimizer state donated. Each row is a fresh worker process: the converted random checkpoint
(common.checkpoint) loaded in the dtype, the step lowered and compiled (XLA's memory_analysis:
temp = activations kept for the backward pass plus scratch; arguments = weights, optimizer state,
inputs), then `--repeats` timed steps after one warm-up step (median reported). A step whose
temp + arguments + output (less the outputs that alias a donated argument) exceed --max-run-gib
is compiled (from the optimizer state's shapes) but not run. --quick: the 2-block tower, an 8x8
image, float32, LoRA r=8 with remat.
"""

from __future__ import annotations

import statistics
import time

from benchmarks import common

PRESET = "qwen2.5-vl-3b"
MiB = 1 << 20
DEFAULTS = {"repeats": (2, 1)}


def add_args(p) -> None:
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--modes", default="full,lora8,lora16", help="full, loraR (rank R)")
    p.add_argument(
        "--max-run-gib",
        type=float,
        default=9.0,
        help="run (time) a step only if its temp + arguments + non-aliased output fit in this many GiB "
        "(default 9: a shared 24 GiB machine); larger ones are compiled and reported without a step time",
    )


def step_worker(p: dict) -> dict:
    """Worker: compile + time one training step configuration."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import qwen_vit_jax as qvj

    model = qvj.load_model(p["ckpt"], dtype=p["dtype"])
    cfg = model.cfg
    if p["rank"]:
        qvj.add_lora(model, p["rank"], targets=("qkv", "proj"), rngs=nnx.Rngs(0))
    trained = nnx.LoRAParam if p["rank"] else nnx.Param
    graphdef, params, rest = nnx.split(model, trained, ...)
    tx = optax.adam(1e-4)
    opt_state = jax.eval_shape(tx.init, params)  # shapes only until the step is known to fit
    (plan,) = qvj.make_plans(np.asarray(p["grid"]), cfg, qvj.BucketPolicy(tight=True))
    rng = np.random.default_rng(0)
    pixels = jnp.asarray(plan.take(rng.standard_normal((plan.n_patches, cfg.patch_dim), dtype=np.float32)))
    w = jnp.asarray(rng.standard_normal((plan.bucket.patches // cfg.merge_unit, cfg.out_dim), dtype=np.float32))
    plan = jax.device_put(plan)
    remat = p["remat"]

    def step(params, opt_state, rest, pixels, plan, w):
        def loss_fn(params):
            return jnp.sum(nnx.merge(graphdef, params, rest)(pixels, plan, remat=remat) * w)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, rest, pixels, plan, w).compile()
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    # outputs that alias donated arguments (the new parameters and optimizer state) take no more
    need = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    times = []
    if need > p["max_run_gib"] * (1 << 30):  # this machine is shared: report the compile, skip the run
        return {
            **_memory(m),
            "compile_s": compile_s,
            "step_s": None,
            "trained": _count(params),
            "bucket": plan.bucket.patches,
        }
    opt_state = tx.init(params)
    for i in range(p["repeats"] + 1):
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, rest, pixels, plan, w)
        jax.block_until_ready((params, loss))
        if i:  # the first run: warm-up
            times.append(time.perf_counter() - t0)
    return {
        **_memory(m),
        "compile_s": compile_s,
        "step_s": statistics.median(times),
        "steps": times,
        "trained": _count(params),
        "bucket": plan.bucket.patches,
        "loss_finite": bool(np.isfinite(float(loss))),
    }


def _memory(m) -> dict:
    return {"temp": m.temp_size_in_bytes, "argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes}


def _count(params) -> int:
    import jax

    return int(sum(v.size for v in jax.tree.leaves(params)))


def run(args) -> dict:
    ckpt = common.checkpoint(PRESET, args.quick)["ours"]
    dtypes, modes = ("float32", "lora8") if args.quick else (args.dtypes, args.modes)
    grid = [[1, 8, 8]] if args.quick else [[1, 36, 36]]
    rows = []
    for dtype in dtypes.split(","):
        for mode in modes.split(","):
            rank = 0 if mode == "full" else int(mode.removeprefix("lora"))
            for remat in (True,) if args.quick else (False, True):
                p = {"ckpt": ckpt, "dtype": dtype, "rank": rank, "remat": remat, "repeats": args.repeats, "grid": grid}
                r = common.run_worker(__name__, "step", p | {"max_run_gib": args.max_run_gib})
                step = "not run (too large)" if r["step_s"] is None else f"{r['step_s']:.2f}"
                common.log(f"{dtype} {mode} remat={remat}: temp {r['temp'] / MiB:,.0f} MiB, step {step} s")
                rows.append({"dtype": dtype, "rank": rank, "remat": remat, **r})
    return {"tower": PRESET, "grid": grid, "repeats": args.repeats, "max_run_gib": args.max_run_gib, "rows": rows}


def report(result: dict) -> str:
    d = result["data"]
    (_, h, w), bucket = d["grid"][0], d["rows"][0]["bucket"]
    rows = [
        [r["dtype"], f"LoRA r={r['rank']}" if r["rank"] else "full", "yes" if r["remat"] else "no"]
        + [f"{r['temp'] / MiB:,.0f}", f"{r['argument'] / MiB:,.0f}"]
        + [f"not run: more than {d['max_run_gib']:g} GiB" if r["step_s"] is None else f"{r['step_s']:.2f}"]
        + [f"{r['compile_s']:.0f}"]
        for r in d["rows"]
    ]
    return (
        f"One Adam step on the {d['tower']} tower, one {h}x{w}-patch image (its {bucket}-row tight bucket), the "
        "gradient w.r.t. every parameter (full) or the LoRA adapters only (rank r on `qkv` and `proj` of every "
        "block), parameters and optimizer state donated; temp and arguments from XLA's memory analysis of the "
        f"compiled step; step time the median of {d['repeats']} after a warm-up step.\n\n"
        + common.markdown_table(["dtype", "trained", "remat", "temp MiB", "arguments MiB", "step s", "compile s"], rows)
    )


WORKERS = {"step": step_worker}
