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

    python benchmarks/bench_compile.py [--quick] [--variant qwen2.5-vl-3b] [--dtype float32]
        [--count 30] [--seed 0] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
import numpy as np


def stream_sizes(count: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(2 * int(rng.integers(1, 33)), 2 * int(rng.integers(1, 33))) for _ in range(count)]


def worker(p: dict) -> dict:
    import jax

    import qwen_vit_jax as qvj
    from qwen_vit_jax import plan as planlib
    from qwen_vit_jax.weights.keys import expected_param_shapes

    compiles = common.count_compiles()
    cfg = common.model_config(p["variant"], p["quick"])
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
        "versions": common.versions("jax", "jaxlib", "flax"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="qwen2.5-vl-3b")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--count", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2-block config (same sizes, same compile count)")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/compile[-quick].json)")
    args = ap.parse_args()
    sizes = stream_sizes(args.count, args.seed)
    r = common.run_worker(
        __file__, "stream", {"variant": args.variant, "quick": args.quick, "dtype": args.dtype, "sizes": sizes}
    )
    calls, buckets = r["calls"], r["buckets"]
    fills = [c["fill"] for c in calls]
    comp = [b["compile_s"] for b in buckets]
    summary = {
        "stream_compiles": r["stream_compiles"],
        "buckets_compiled": len(buckets),
        "setup_compiles": r["setup"]["compiles"],
        "stream_compile_seconds": r["stream_compile_seconds"],
        "stream_cache_hits": r["stream_cache_hits"],
        "bucket_compile_s_median": statistics.median(comp),
        "bucket_compile_s_max": max(comp),
        "fill_mean": statistics.fmean(fills),
        "fill_median": statistics.median(fills),
        "fill_min": min(fills),
        "padded_over_real_total": sum(c["padded_patches"] for c in calls) / sum(c["patches"] for c in calls),
    }
    print(
        f"{args.variant}{' (quick: 2 blocks)' if args.quick else ''}, {args.dtype}, {r['device']}: "
        f"{len(calls)} single images, h, w even in [2, 64], seed {args.seed}\n"
    )
    print(
        common.markdown_table(
            ["", "value"],
            [
                ["XLA compiles during the stream (all)", summary["stream_compiles"]],
                ["of which loaded from a persistent cache", summary["stream_cache_hits"]],
                ["buckets compiled", summary["buckets_compiled"]],
                ["XLA compiles building the encoder", summary["setup_compiles"]],
                ["backend compile seconds, stream total", f"{summary['stream_compile_seconds']:.1f}"],
                [
                    "compile seconds per bucket, median / max",
                    f"{summary['bucket_compile_s_median']:.1f} / {summary['bucket_compile_s_max']:.1f}",
                ],
                [
                    "fill = real / bucket patches, mean / median / min",
                    f"{summary['fill_mean']:.3f} / {summary['fill_median']:.3f} / {summary['fill_min']:.3f}",
                ],
                ["bucket patches / real patches, whole stream", f"{summary['padded_over_real_total']:.3f}"],
            ],
        )
    )
    print()
    print(common.markdown_table(["bucket", "compile s"], [[b["bucket"], f"{b['compile_s']:.2f}"] for b in buckets]))
    print()
    print(
        common.markdown_table(
            ["#", "h x w", "patches", "bucket patches", "fill", "compiles", "call s"],
            [
                [
                    i,
                    f"{c['h']}x{c['w']}",
                    c["patches"],
                    c["padded_patches"],
                    f"{c['fill']:.2f}",
                    c["compiles"],
                    f"{c['seconds']:.2f}",
                ]
                for i, c in enumerate(calls)
            ],
        )
    )
    common.write_json(
        args.out or common.default_out("compile", args.quick),
        {
            "bench": "compile",
            "variant": args.variant,
            "quick": args.quick,
            "dtype": args.dtype,
            "seed": args.seed,
            "summary": summary,
            **r,
        },
    )


if __name__ == "__main__" and not common.worker_main({"stream": worker}):
    main()
