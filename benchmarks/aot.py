"""Deviceless compiles of the real towers for every accelerator target: per bucket the temp and peak
memory per device, matmul FLOPs, bytes moved and the roofline estimate, for one device and for a
mesh of --devices. What `qwen-vit-jax aot` reports (tools/aot.py `run`), one worker process per
target, tower and device count (the TPU and CUDA compilers are loaded once each). Needs the accel
extra. Memory is the compiled program's (evidence); the roofline is an estimate at the published
peaks, max(matmul FLOPs / peak, matmul bytes / bandwidth).

--quick: the 2-block Qwen2.5-VL tower for an H100, one device, one small image.
"""

from __future__ import annotations

from benchmarks import common

SIZES = "36x36,10x36x36,16x32x32"  # `qwen-vit-jax aot`'s default: an image, a video, the largest bucket


def add_args(p) -> None:
    p.add_argument("--variants", default="qwen2.5-vl-3b,qwen3-vl-8b")
    p.add_argument("--targets", default="h100,h200,tpu-v5e,tpu-v6e")
    p.add_argument("--devices", type=int, default=8, help="the mesh besides one device (default 8)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sizes", default=SIZES, help=f"requests, HxW or TxHxW (default {SIZES})")


def worker(p: dict) -> dict:
    """Compile every bucket of p["sizes"] for one target, tower and device count, deviceless."""
    import jax
    import numpy as np

    from qwen_vit_jax.config import parse_sizes
    from qwen_vit_jax.tools import aot

    if not common.IN_PROCESS:
        jax.config.update("jax_enable_compilation_cache", False)  # a deviceless program cannot be loaded back
    cfg = common.model_config(p["variant"], p["quick"])
    grids = [np.array([s]) for s in parse_sizes(p["sizes"], "--sizes")]
    reports = aot.run(p["target"], cfg, grids, p["dtype"], p["devices"], progress=None)
    return {
        "reports": [
            {"rows": r.bucket.patches, "patches": r.patches, "compile_s": r.compile_s, "temp_bytes": r.temp_bytes}
            | {"peak_bytes": r.peak_bytes, "fits": r.fits(), "flops": r.flops, "bytes_moved": r.bytes_moved}
            | {"roofline_s": r.roofline_s, "host_ops": list(r.host_ops)}
            for r in reports
        ]
    }


def run(args) -> dict:
    if args.quick:
        args.variants, args.targets, args.devices, args.sizes = "qwen2.5-vl-3b", "h100", 1, "8x8"
    out = {"dtype": args.dtype, "sizes": args.sizes, "targets": {}}
    for target in args.targets.split(","):
        rows = out["targets"][target] = []
        for variant in args.variants.split(","):
            for devices in sorted({1, args.devices}):
                p = {"variant": variant, "quick": args.quick, "target": target, "devices": devices}
                r = common.run_worker(__name__, "compile", p | {"dtype": args.dtype, "sizes": args.sizes})
                rows += [{"tower": variant, "devices": devices, **x} for x in r["reports"]]
    return out


def report(result: dict) -> str:
    d, parts = result["data"], []
    heads = ["tower", "devices", "rows / device", "real rows", "compile s", "temp MiB", "peak MiB", "fits"]
    heads += ["GFLOP / device", "GB moved", "roofline ms (estimate)"]
    for target, reports in d["targets"].items():
        rows = [
            [r["tower"], r["devices"], f"{r['rows']:,}", f"{r['patches']:,}", f"{r['compile_s']:.1f}"]
            + [f"{r['temp_bytes'] / 2**20:,.0f}", f"{r['peak_bytes'] / 2**20:,.0f}", "yes" if r["fits"] else "NO"]
            + [f"{r['flops'] / 1e9:,.0f}", f"{r['bytes_moved'] / 1e9:.1f}", f"{r['roofline_s'] * 1e3:.2f}"]
            for r in reports
        ]
        parts.append(f"{target}, {d['dtype']}, requests {d['sizes']}:\n\n{common.markdown_table(heads, rows)}")
    return "\n\n".join(parts)


WORKERS = {"compile": worker}
