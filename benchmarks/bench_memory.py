"""Memory per bucket (weights + XLA's memory analysis of the compiled program) for the real-size
towers, and the peak RSS of one request 3x the largest bucket on the real Qwen2.5-VL-3B tower.

    python benchmarks/bench_memory.py                       # both parts, ~5 min on 2 cores
    python benchmarks/bench_memory.py --skip-rss            # the per-bucket table only
    python benchmarks/bench_memory.py --rss-max-patches 4096

Part 1 (`analyze` worker, one process per preset): an encoder with zero weights of the preset's
shapes, each bucket compiled and its `memory_analysis()` read: arguments (weights + pixels + plan
tables), output, temp (XLA's scratch for the largest live intermediates) and generated code.
No forward runs. The 7B towers differ from 2B / 3B only in the merger's output width.

Part 2 (`rss` worker): the random real-size 3B checkpoint (`demo.prepare_checkpoint("3b")`),
float32, with `BucketPolicy(max_patches=M)`; after loading and compiling, the kernel's peak-RSS
mark is reset (`/proc/self/clear_refs`), then ONE `encode` of 3 frames of M patches each (3
chunks of the largest bucket, all dispatched before any is fetched) runs and the new peak
(`VmHWM`) is read. The bound it is checked against (documented in docs/hardening.md):

    peak RSS <= steady RSS + sum over chunks (temp + 2 * (argument bytes - weight bytes
                                                      + output bytes))

steady RSS: after loading and compiling, with the caller's pixel_values allocated. Each chunk's
inputs (padded pixels + plan tables) and output exist twice: as host numpy arrays and as device
buffers (on CPU, in the same process). temp is XLA's scratch of one running program; `encode`
dispatches every chunk before fetching any, and the CPU runtime may run them concurrently, so
each chunk's temp counts (a first run that counted one temp measured 3,607 MiB against a
3,509 MiB bound: more than one was live).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, log, run_worker, worker_main  # noqa: E402

MiB = 1 << 20
BUCKET_PATCHES = (1024, 4096, 16384)  # single images of 32x32, 64x64, 128x128 patches


def _status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _analysis(program) -> dict:
    m = program.memory_analysis()
    return {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "code": m.generated_code_size_in_bytes,
        "alias": m.alias_size_in_bytes,
    }


def analyze(payload: dict) -> dict:
    """Per-bucket memory analysis of one preset (zero weights: only shapes matter)."""
    import numpy as np

    from qwen_vit_jax import plan as planlib
    from qwen_vit_jax.presets import PRESETS
    from qwen_vit_jax.runtime.encoder import VisionEncoder
    from qwen_vit_jax.weights.keys import expected_param_shapes

    cfg = PRESETS[payload["preset"]]
    shapes = expected_param_shapes(cfg)
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    rows = []
    for dtype in payload["dtypes"]:
        enc = VisionEncoder(cfg, params, dtype=dtype)
        weights = sum(
            int(np.prod(s)) * (2 if dtype == "bfloat16" and k.endswith("kernel") else 4) for k, s in shapes.items()
        )
        for n in payload["patches"]:
            side = int(round(n**0.5))
            (plan,) = planlib.make_plans([[1, side, side]], cfg, enc.policy)
            a = _analysis(enc.programs.get(plan.bucket))
            rows.append(
                {
                    "preset": payload["preset"],
                    "dtype": dtype,
                    "patches": plan.bucket.patches,
                    "weights": weights,
                    **a,
                    "peak": a["argument"] + a["output"] + a["temp"],
                }
            )
            log(f"{payload['preset']} {dtype} {plan.bucket.patches}: {rows[-1]}")
        del enc
    return {"rows": rows}


def rss(payload: dict) -> dict:
    """Peak RSS of one request of 3 x max_patches patches on the real 3B tower (float32)."""
    import time

    import jax
    import numpy as np

    from qwen_vit_jax import plan as planlib
    from qwen_vit_jax.runtime.encoder import VisionEncoder
    from qwen_vit_jax.tools.demo import prepare_checkpoint

    m = payload["max_patches"]
    side = int(round(m**0.5))
    grid = [[3, side, side]]  # 3 frames of M patches: 3 chunks of the largest bucket
    ckpt = prepare_checkpoint("3b", log=lambda s: log(s))
    base = _status_kib("VmRSS") * 1024
    enc = VisionEncoder.from_pretrained(ckpt, dtype="float32", policy=planlib.BucketPolicy(max_patches=m))
    plans = planlib.make_plans(grid, enc.cfg, enc.policy)
    buckets = sorted({p.bucket.patches for p in plans})
    analyses = [_analysis(enc.programs.get(p.bucket)) for p in plans]
    weights = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in jax.tree.leaves(enc.programs.state))
    n = sum(p.n_patches for p in plans)
    pixels = np.random.default_rng(0).standard_normal((n, enc.cfg.patch_dim), dtype=np.float32)
    steady = _status_kib("VmRSS") * 1024
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    log(f"encoding {n} patches in {len(plans)} chunks of buckets {buckets} ...")
    t0 = time.perf_counter()
    emb = enc.encode(pixels, grid)
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM") * 1024
    assert emb.shape == (n // enc.cfg.merge_unit, enc.cfg.out_dim) and np.isfinite(emb).all()
    transient = sum(a["argument"] - weights + a["output"] for a in analyses)
    bound = steady + sum(a["temp"] for a in analyses) + 2 * transient
    return {
        "max_patches": m,
        "grid": grid,
        "patches": n,
        "chunks": len(plans),
        "buckets": buckets,
        "rss_before_load": base,
        "weights": weights,
        "steady_rss": steady,
        "peak_rss": peak,
        "pixels": pixels.nbytes,
        "temp": sum(a["temp"] for a in analyses),
        "transient": transient,
        "bound": bound,
        "within_bound": peak <= bound,
        "encode_seconds": seconds,
        "analysis": analyses[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen2.5-vl-3b,qwen2-vl-2b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--patches", default=",".join(map(str, BUCKET_PATCHES)))
    ap.add_argument("--rss-max-patches", type=int, default=4096)
    ap.add_argument("--skip-analysis", action="store_true")
    ap.add_argument("--skip-rss", action="store_true")
    args = ap.parse_args()
    out = {}
    if not args.skip_analysis:
        rows = []
        for preset in args.presets.split(","):
            rows += run_worker(
                __file__,
                "analyze",
                {
                    "preset": preset,
                    "dtypes": args.dtypes.split(","),
                    "patches": [int(p) for p in args.patches.split(",")],
                },
            )["rows"]
        print("| preset | dtype | bucket | weights | arguments | output | temp | code | peak (arg+out+temp) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['preset']} | {r['dtype']} | {r['patches']} | {r['weights'] / MiB:,.0f} | "
                f"{r['argument'] / MiB:,.0f} | {r['output'] / MiB:,.1f} | {r['temp'] / MiB:,.0f} | "
                f"{r['code'] / MiB:,.1f} | {r['peak'] / MiB:,.0f} MiB |"
            )
        out["analysis"] = rows
    if not args.skip_rss:
        r = run_worker(__file__, "rss", {"max_patches": args.rss_max_patches})
        print(
            f"3B float32, request {r['grid']} = {r['patches']} patches in {r['chunks']} chunks "
            f"(buckets {r['buckets']}), encode {r['encode_seconds']:.1f} s"
        )
        for k in ("rss_before_load", "weights", "steady_rss", "temp", "transient", "pixels", "bound", "peak_rss"):
            print(f"  {k:16s} {r[k] / MiB:10,.0f} MiB")
        print(f"  peak within bound: {r['within_bound']}")
        out["rss"] = r
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps(out, indent=1) + "\n")
    if "rss" in out and not out["rss"]["within_bound"]:
        sys.exit("peak RSS above the documented bound")


if __name__ == "__main__":
    if not worker_main({"analyze": analyze, "rss": rss}):
        main()
