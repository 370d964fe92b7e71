"""Deviceless compiles of the real towers for every accelerator target, as markdown tables.

Runs `qwen-vit-jax aot` (one process per target, model and device count: the TPU and CUDA
compilers are loaded once each) with --json, then prints one table per target: per bucket the
temp and peak memory per device, matmul FLOPs, bytes moved and the roofline estimate, for one
device and for a mesh of --devices. Needs the accel extra.

    python benchmarks/bench_aot.py [--variants qwen2.5-vl-3b,qwen3-vl-8b] [--targets h100,h200,tpu-v5e,tpu-v6e]
        [--devices 8] [--dtype bfloat16] [--dir benchmarks/results/aot] [--tables-only]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import common


def run(args, variant: str, target: str, devices: int, out: pathlib.Path) -> None:
    if out.exists() and args.tables_only:
        return
    cmd = [sys.executable, "-m", "qwen_vit_jax.tools.cli", "aot", "--variant", variant, "--target", target]
    cmd += ["--devices", str(devices), "--dtype", args.dtype, "--json", str(out)]
    common.log(" ".join(cmd[2:]))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=common.ROOT)


def table(reports: list[tuple[str, int, dict]]) -> str:
    rows = []
    for variant, devices, r in reports:
        rows.append(
            [
                variant,
                devices,
                f"{r['bucket']['patches']:,}",
                f"{r['patches']:,}",
                f"{r['compile_s']:.1f}",
                f"{r['temp_bytes'] / 2**20:,.0f}",
                f"{r['peak_bytes'] / 2**20:,.0f}",
                "yes" if r["fits"] else "NO",
                f"{r['flops'] / 1e9:,.0f}",
                f"{r['bytes_moved'] / 1e9:.1f}",
                f"{r['roofline_s'] * 1e3:.2f}",
            ]
        )
    heads = ["tower", "devices", "rows / device", "real rows", "compile s", "temp MiB", "peak MiB", "fits"]
    return common.markdown_table(heads + ["GFLOP / device", "GB moved", "roofline ms (estimate)"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="qwen2.5-vl-3b,qwen3-vl-8b")
    ap.add_argument("--targets", default="h100,h200,tpu-v5e,tpu-v6e")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dir", default=str(common.RESULTS / "aot"))
    ap.add_argument("--tables-only", action="store_true", help="reuse the JSON already in --dir")
    args = ap.parse_args()
    out_dir = pathlib.Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for target in args.targets.split(","):
        reports = []
        for variant in args.variants.split(","):
            for devices in (1, args.devices):
                out = out_dir / f"{variant}-{target}-{devices}-{args.dtype}.json"
                run(args, variant, target, devices, out)
                reports += [(variant, devices, r) for r in json.loads(out.read_text())["reports"]]
        print(f"\n### {target}, {args.dtype}: deviceless compiles of the default `aot` sizes\n")
        print(table(reports))


if __name__ == "__main__":
    main()
