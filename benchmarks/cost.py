"""What padding and attention tiling cost: `VisionEncoder.cost_report` on the real-size towers.

For each variant, one JAX process builds a VisionEncoder (zero weights: the FLOP count and
temp memory do not depend on them) and asks `cost_report` about:
  - the multi-frame seed cases: [[10, 36, 36]], ten [10, 36, 36] videos, ten videos
    [10, 36 +- 2, 36 +- 2] (seed 1, as tests/test_plan.py), and one 128 x 128-patch image;
  - the same cases once they recur (tight buckets: BucketPolicy(tight=True), what the encoder
    uses for a grid declared with warmup(grids, tight=True));
  - one 36 x 36-patch image, and the 30-size stream of the compile suite (single images, h, w even
    in [2, 64], seed 0): the mean and max of the per-image ratio, and the aggregate (sum of
    compiled over sum of ideal: what the machine actually spends);
  - temp memory for 1x, 2x and 4x the patches (images of 32 x 32, 32 x 64, 64 x 64 patches);
  - the seconds it took to compile each bucket's program (the one `encode` runs).
compiled_flops counts the matmuls of the bucket's forward as it runs (cost.dot_flops: the traced
program's dot_generals, loop bodies times their trip counts), ideal_flops the analytic count on the
real rows (qwen_vit_jax.cost).

--quick: the first variant's 2-block tower, a small video, a stream of 2.
"""

from __future__ import annotations

import statistics

import numpy as np

from benchmarks import common
from benchmarks.workloads.grids import compile_stream, cost_cases

VARIANTS = ("qwen2.5-vl-3b", "qwen2-vl-2b", "qwen3-vl-8b")


def add_args(p) -> None:
    p.add_argument("--variants", help=f"towers (default {','.join(VARIANTS)}; --quick: the first)")


def worker(p: dict) -> dict:
    import qwen_vit_jax as qvj
    from qwen_vit_jax.weights.keys import expected_param_shapes

    cfg = common.model_config(p["variant"], p["quick"])
    params = {k: np.zeros(s, np.float32) for k, s in expected_param_shapes(cfg).items()}
    enc = qvj.VisionEncoder(cfg, params)
    grids = p["cases"]
    cases = {name: enc.cost_report(grid) for name, grid in grids.items()}
    # The same grids declared recurring sizes: what their tight buckets (warmup(tight=True)) cost.
    tight = qvj.VisionEncoder(cfg, params, policy=qvj.BucketPolicy(tight=True))
    cases.update({f"{name} (recurring: tight)": tight.cost_report(grid) for name, grid in grids.items()})
    reports = [enc.cost_report([[1, h, w]]) for h, w in p["sizes"]]
    stream = [r["flops_ratio"] for r in reports]
    aggregate = sum(r["compiled_flops"] for r in reports) / sum(r["ideal_flops"] for r in reports)
    memory = {
        f"{k}x": enc.cost_report(grid)["temp_bytes"]
        for k, grid in ((1, [[1, 32, 32]]), (2, [[1, 32, 64]]), (4, [[1, 64, 64]]))[: 1 if p["quick"] else 3]
    }
    compile_s = {f"{b.patches}/T{b.tiles}/K{b.key_rows}": s for b, s in enc.compile_seconds.items()}
    return {
        "cases": cases,
        "stream_ratios": stream,
        "stream_aggregate": aggregate,
        "temp_bytes": memory,
        "compile_seconds": compile_s,
    }


def run(args) -> dict:
    variants = (args.variants or (VARIANTS[0] if args.quick else ",".join(VARIANTS))).split(",")
    cases = cost_cases()
    if args.quick:  # small grids: each compiles in seconds
        cases = {"[[2, 16, 16]]": [[2, 16, 16]]}
    sizes = compile_stream(2 if args.quick else 30, 0)
    payload = {"quick": args.quick, "sizes": sizes, "cases": cases}
    return {
        "sizes": sizes,
        "results": {v: common.run_worker(__name__, "cost", {**payload, "variant": v}) for v in variants},
    }


def _buckets(c: dict) -> str:
    """A case's buckets as N_pad/T/K, runs of equal ones counted; more than four distinct: their count
    and the range of K."""
    names = [f"{b['patches']}/T{b['tiles']}/K{b['key_rows']}" for b in c["buckets"]]
    if len(set(names)) > 4:
        keys = [b["key_rows"] for b in c["buckets"]]
        return f"{len(names)} chunks, K {min(keys)}" + (f"-{max(keys)}" if max(keys) > min(keys) else "")
    runs = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return " + ".join(f"{k} x {n}" if k > 1 else n for n, k in runs)


def report(result: dict) -> str:
    d = result["data"]
    rows, stream_rows, temp_rows = [], [], []
    for v, r in d["results"].items():
        for name, c in r["cases"].items():
            if name.endswith("(recurring: tight)"):
                continue
            t = r["cases"][f"{name} (recurring: tight)"]
            rows.append([v, name, _buckets(c), f"{c['flops_ratio']:.3f}", _buckets(t), f"**{t['flops_ratio']:.3f}**"])
        s = r["stream_ratios"]
        stream_rows.append([v, f"{statistics.fmean(s):.3f}", f"{max(s):.2f}", f"**{r['stream_aggregate']:.3f}**"])
        temp_rows.append([v, " / ".join(f"{b / 2**20:.0f}" for b in r["temp_bytes"].values())])
    heads = ["tower", "request", "first time: buckets (N_pad/T/K)", "ratio", "recurring: buckets", "ratio"]
    return (
        "Matmul FLOPs of the programs that run (every dot at its padded shape, loop bodies times their trip counts) "
        "over the same matmuls on the real rows; zero weights. First time: a fresh encoder (the ladder; equal chunks "
        "of one request tight); recurring: the grid declared (`warmup(grids, tight=True)`: tight buckets).\n\n"
        + common.markdown_table(heads, rows)
        + f"\n\nThe compile suite's stream of {len(d['sizes'])} single images (never declared: the ladder):\n\n"
        + common.markdown_table(["tower", "mean ratio per image", "max", "aggregate (sum / sum)"], stream_rows)
        + "\n\nTemp memory, MiB, at 1x / 2x / 4x patches (32x32, 32x64, 64x64 images): "
        + "; ".join(f"{v} {t}" for v, t in temp_rows)
        + "."
    )


WORKERS = {"cost": worker}
