"""What padding and attention tiling cost: `VisionEncoder.cost_report` on the real-size towers.

For each variant, one JAX process builds a VisionEncoder (zero weights: the FLOP count and
temp memory do not depend on them) and asks `cost_report` about:
  - the multi-frame seed cases: [[10, 36, 36]], ten [10, 36, 36] videos, ten videos
    [10, 36 +- 2, 36 +- 2] (seed 1, as tests/test_plan.py), and one 128 x 128-patch image;
  - the same cases once they recur (tight buckets: BucketPolicy(tight=True), what the encoder
    uses for a grid declared with warmup(grids, tight=True));
  - one 36 x 36-patch image, and the 30-size stream of bench_compile.py (single images, h, w even
    in [2, 64], seed 0): the mean and max of the per-image ratio, and the aggregate (sum of
    compiled over sum of ideal: what the machine actually spends);
  - temp memory for 1x, 2x and 4x the patches (images of 32 x 32, 32 x 64, 64 x 64 patches);
  - the seconds it took to compile each bucket's program (the one `encode` runs).
compiled_flops counts the matmuls of the bucket's forward as it runs (cost.dot_flops: the traced
program's dot_generals, loop bodies times their trip counts), ideal_flops the analytic count on the
real rows (qwen_vit_jax.cost).

    python benchmarks/bench_cost.py [--quick] [--variants qwen2.5-vl-3b,qwen2-vl-2b,qwen3-vl-8b] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics

import common
import numpy as np
from bench_compile import stream_sizes

VARIANTS = ("qwen2.5-vl-3b", "qwen2-vl-2b", "qwen3-vl-8b")


def seed_cases() -> dict[str, list[list[int]]]:
    jitter = np.random.default_rng(1).integers(-1, 2, (10, 2))
    return {
        "[[10, 36, 36]]": [[10, 36, 36]],
        "ten [10, 36, 36]": [[10, 36, 36]] * 10,
        "ten [10, 36+-2, 36+-2]": [[10, 36 + 2 * int(a), 36 + 2 * int(b)] for a, b in jitter],
        "[[1, 128, 128]]": [[1, 128, 128]],
        "[[1, 36, 36]]": [[1, 36, 36]],
    }


def worker(p: dict) -> dict:
    import qwen_vit_jax as qvj
    from qwen_vit_jax.weights.keys import expected_param_shapes

    cfg = common.model_config(p["variant"], p["quick"])
    params = {k: np.zeros(s, np.float32) for k, s in expected_param_shapes(cfg).items()}
    enc = qvj.VisionEncoder(cfg, params)
    cases = {name: enc.cost_report(grid) for name, grid in seed_cases().items()}
    # The same grids declared recurring sizes: what their tight buckets (warmup(tight=True)) cost.
    tight = qvj.VisionEncoder(cfg, params, policy=qvj.BucketPolicy(tight=True))
    cases.update({f"{name} (recurring: tight)": tight.cost_report(grid) for name, grid in seed_cases().items()})
    reports = [enc.cost_report([[1, h, w]]) for h, w in p["sizes"]]
    stream = [r["flops_ratio"] for r in reports]
    aggregate = sum(r["compiled_flops"] for r in reports) / sum(r["ideal_flops"] for r in reports)
    memory = {
        f"{k}x": enc.cost_report(grid)["temp_bytes"]
        for k, grid in ((1, [[1, 32, 32]]), (2, [[1, 32, 64]]), (4, [[1, 64, 64]]))
    }
    compile_s = {f"{b.patches}/T{b.tiles}/K{b.key_rows}": s for b, s in enc.compile_seconds.items()}
    return {
        "cases": cases,
        "stream_ratios": stream,
        "stream_aggregate": aggregate,
        "temp_bytes": memory,
        "compile_seconds": compile_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--quick", action="store_true", help="2-block configs")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/cost[-quick].json)")
    args = ap.parse_args()
    sizes = stream_sizes(30, 0)
    results = {
        v: common.run_worker(__file__, "cost", {"variant": v, "quick": args.quick, "sizes": sizes})
        for v in args.variants.split(",")
    }
    rows = []
    for v, r in results.items():
        for name, c in r["cases"].items():
            buckets = ", ".join(f"{b['patches']}/T{b['tiles']}/K{b['key_rows']}" for b in c["buckets"])
            rows.append(
                [
                    v,
                    name,
                    c["patches"],
                    c["padded_patches"],
                    buckets,
                    f"{c['compiled_flops'] / 1e12:.2f}",
                    f"{c['ideal_flops'] / 1e12:.2f}",
                    f"{c['flops_ratio']:.3f}",
                    f"{c['temp_bytes'] / 2**20:.0f}",
                ]
            )
        s = r["stream_ratios"]
        rows.append(
            [
                v,
                "30-size stream (mean / max; aggregate = sum / sum)",
                "-",
                "-",
                "-",
                "-",
                "-",
                f"{statistics.fmean(s):.3f} / {max(s):.2f}; {r['stream_aggregate']:.3f}",
                "-",
            ]
        )
    print(
        common.markdown_table(
            [
                "variant",
                "request",
                "patches",
                "padded",
                "buckets (N_pad/T/K)",
                "compiled TFLOP",
                "ideal TFLOP",
                "ratio",
                "temp MiB",
            ],
            rows,
        )
    )
    print()
    print(
        common.markdown_table(
            ["variant", "temp MiB at 1x / 2x / 4x patches (1024 / 2048 / 4096)"],
            [[v, " / ".join(f"{b / 2**20:.0f}" for b in r["temp_bytes"].values())] for v, r in results.items()],
        )
    )
    print()
    print(
        common.markdown_table(
            ["variant", "buckets compiled", "compile s per bucket: median / max", "compile s, 16384-row buckets"],
            [
                [
                    v,
                    len(r["compile_seconds"]),
                    f"{statistics.median(r['compile_seconds'].values()):.1f} / "
                    f"{max(r['compile_seconds'].values()):.1f}",
                    " / ".join(f"{s:.1f}" for b, s in r["compile_seconds"].items() if b.startswith("16384/")),
                ]
                for v, r in results.items()
            ],
        )
    )
    common.write_json(
        args.out or common.default_out("cost", args.quick),
        {"bench": "cost", "quick": args.quick, "sizes": sizes, "results": results},
    )


if __name__ == "__main__" and not common.worker_main({"cost": worker}):
    main()
