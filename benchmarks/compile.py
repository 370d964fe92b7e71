"""Compiles over a stream of image sizes: how many XLA programs, how long each bucket takes to
compile, and how much padding the bucket ladder costs.

A fresh JAX process builds a VisionEncoder (random weights: compile cost does not depend on
them) and encodes a stream of single images, sizes h, w even in [2, 64] patches (fixed seed),
one `encode` call each. Every XLA compile in the process is counted through jax.monitoring
(common.count_compiles: /jax/core/compile/backend_compile_duration fires once per program,
jit programs and eager-op helpers alike; loads from a persistent compilation cache count too
and are reported apart: leave JAX_COMPILATION_CACHE_DIR unset). Also reported:
VisionEncoder.compile_seconds per bucket, each call's seconds, and fill = real patches /
bucket patches (1 = no padding).

The tower is the 2-block version of --variant (the compile count and the fill are the real tower's,
only the seconds shrink); --full-size compiles the real one. --quick: 5 sizes.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks import common
from benchmarks.workloads.grids import compile_stream


def add_args(p) -> None:
    p.add_argument("--variant", default="qwen2.5-vl-3b")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--count", type=int, help="stream length (default 30; --quick 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full-size", action="store_true", help="the real tower (its compile seconds), not 2 blocks")


def worker(p: dict) -> dict:
    import jax

    import qwen_vit_jax as qvj
    from qwen_vit_jax import plan as planlib
    from qwen_vit_jax.weights.keys import expected_param_shapes

    compiles = common.count_compiles()
    cfg = common.model_config(p["variant"], not p["full_size"])
    rng = np.random.default_rng(0)
    params = {k: 0.02 * rng.standard_normal(shape, dtype=np.float32) for k, shape in expected_param_shapes(cfg).items()}
    before = compiles["count"]
    t0 = time.perf_counter()
    enc = qvj.VisionEncoder(cfg, params, dtype=p["dtype"])
    setup = {"seconds": time.perf_counter() - t0, "compiles": compiles["count"] - before}
    del params

    calls, start = [], dict(compiles)
    for h, w in p["sizes"]:
        grid = np.array([[1, h, w]])
        px = common.random_pixels(grid, cfg.patch_dim, len(calls))
        padded = sum(pl.bucket.patches for pl in planlib.make_plans(grid, cfg, enc.policy))
        n0, known = compiles["count"], set(enc.compile_seconds)
        seconds = common.time_calls(enc.encode, 1, px, grid)[0]
        calls.append(
            {
                "h": h,
                "w": w,
                "patches": h * w,
                "padded_patches": padded,
                "fill": h * w / padded,
                "compiles": compiles["count"] - n0,
                "seconds": seconds,
                "new_buckets": [str(b) for b in enc.compile_seconds if b not in known],
            }
        )
    return {
        "device": str(jax.devices()[0]),
        "persistent_cache_dir": jax.config.jax_compilation_cache_dir,
        "setup": setup,
        "calls": calls,
        "stream_compiles": compiles["count"] - start["count"],
        "stream_compile_seconds": compiles["seconds"] - start["seconds"],
        "stream_cache_hits": compiles["cache_hits"] - start["cache_hits"],
        "buckets": [
            {"bucket": str(b), "compile_s": s}
            for b, s in sorted(enc.compile_seconds.items(), key=lambda kv: kv[0].patches)
        ],
    }


def run(args) -> dict:
    sizes = compile_stream(args.count or (5 if args.quick else 30), args.seed)
    payload = {"variant": args.variant, "full_size": args.full_size, "dtype": args.dtype, "sizes": sizes}
    r = common.run_worker(__name__, "stream", payload)
    calls, buckets = r["calls"], r["buckets"]
    fills, comp = [c["fill"] for c in calls], [b["compile_s"] for b in buckets]
    summary = {
        "stream_compiles": r["stream_compiles"],
        "buckets_compiled": len(buckets),
        "setup_compiles": r["setup"]["compiles"],
        "stream_compile_seconds": r["stream_compile_seconds"],
        "stream_cache_hits": r["stream_cache_hits"],
        "bucket_compile_s_median": statistics.median(comp),
        "bucket_compile_s_max": max(comp),
        "fill_mean": statistics.fmean(fills),
        "fill_min": min(fills),
        "padded_over_real_total": sum(c["padded_patches"] for c in calls) / sum(c["patches"] for c in calls),
    }
    return {
        "variant": args.variant,
        "full_size": args.full_size,
        "dtype": args.dtype,
        "seed": args.seed,
        "summary": summary,
        **r,
    }


def report(result: dict) -> str:
    d = result["data"]
    s, calls = d["summary"], d["calls"]
    patches = [c["patches"] for c in calls]
    rows = [
        ["XLA compiles during the stream (all)", f"**{s['stream_compiles']}** (target <= 12)"],
        ["of which loaded from a persistent cache", s["stream_cache_hits"]],
        ["buckets compiled", s["buckets_compiled"]],
        ["XLA compiles building the encoder", s["setup_compiles"]],
        [
            "compile seconds per bucket, median / max",
            f"{s['bucket_compile_s_median']:.1f} / {s['bucket_compile_s_max']:.1f}",
        ],
        ["fill = real / bucket patches, mean / min", f"{s['fill_mean']:.3f} / {s['fill_min']:.3f}"],
        ["bucket patches / real patches, whole stream", f"**{s['padded_over_real_total']:.3f}**"],
    ]
    tower = d["variant"] + ("" if d.get("full_size") else ", 2 blocks (compiles and fill as the real tower's)")
    return (
        f"{tower}, {d['dtype']}, a fresh process: {len(calls)} single images, h and w even in [2, 64] (seed "
        f"{d['seed']}; {min(patches)} to {max(patches)} patches), one `encode` each, every XLA compile counted:"
        "\n\n" + common.markdown_table(["", "value"], rows)
    )


WORKERS = {"stream": worker}
