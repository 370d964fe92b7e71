"""Where one real forward's wall time goes, op by op: the encoder's own program under the JAX
profiler, its XLA ops grouped by kind.

One JAX process: a `VisionEncoder` of the real-size tower with random weights (timing does not
depend on them), the grid [[1, s, s]] declared a recurring size (`warmup(grids, tight=True)`:
its tight bucket), then one traced `encode`. The trace's XLA:CPU events (one per op of the
compiled program, on the executor threads) are cut at every event boundary; each slice of wall time goes to
the innermost op running on each thread, split evenly between threads that run different ops at
once (XLA runs independent ops concurrently, e.g. the SwiGLU's gate and up dots), so the rows add
up to the traced wall time. Ops are named by the compiled HLO's fusions and grouped by the JAX
operation they come from (the `op_name` metadata): the dense layers' dots, the attention cores,
layer-weight slices, elementwise work and reductions. A big dot's op spans its parallel work
(YNNPACK's worker tasks on the other thread are not traced separately).

    python benchmarks/bench_trace.py [--variant qwen2.5-vl-3b] [--dtypes float32,bfloat16] [--side 36] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile

import common

SKIP = ("ThunkExecutor", "ThreadpoolListener", "SlinkyThreadPool", "end:")  # bookkeeping, not ops


def kind(meta: str, name: str) -> str:
    """The group of an HLO op, from the JAX operation that produced it (its op_name metadata)."""
    if "...i,io->...o" in meta or "np,pd->nd" in meta:
        return "dense layers' dots (qkv, proj, MLP, patch embed, merger)"
    if "wqd,wkd->wqk" in meta or "wqk,wkd->wqd" in meta:
        return "window attention dots"
    if "qd,kd->qk" in meta or "qk,kd->qd" in meta:
        return "full attention dots"
    if "dynamic_index_in_dim" in meta or "bitcast_convert_type" in meta:
        return "layer weight slices (and bf16 bits)"
    if "transpose" in meta or name.startswith(("wrapped_copy", "copy")) or "dynamic_update_slice" in meta:
        return "transposes / copies"
    return "elementwise and reductions (norms, rotary, softmax, masks, gathers, adds)"


def wall_per_op(xplane: str) -> dict[str, float]:
    """Seconds of wall time per op name (see the module docstring)."""
    import jax
    import numpy as np

    data = jax.profiler.ProfileData.from_file(xplane)
    threads = [
        sorted(
            (ev.start_ns, ev.start_ns + ev.duration_ns, ev.name) for ev in line.events if not ev.name.startswith(SKIP)
        )
        for plane in data.planes
        for line in plane.lines
        if "XLAEigen" in line.name  # XLA:CPU's executor threads
    ]
    bounds = np.array(sorted({t for evs in threads for s, e, _ in evs for t in (s, e)}), np.int64)
    wall = collections.Counter()
    slices = np.diff(bounds)
    inner = []
    for evs in threads:  # the innermost (latest started) op on this thread in each slice
        top = [None] * len(slices)
        start = np.full(len(slices), -1, np.int64)
        for s, e, name in evs:
            for i in range(np.searchsorted(bounds, s), np.searchsorted(bounds, e)):
                if s >= start[i]:
                    top[i], start[i] = name, s
        inner.append(top)
    for i, dt in enumerate(slices):
        running = [t[i] for t in inner if t[i] is not None]
        for name in running:
            wall[name] += dt / len(running) / 1e9
    return wall


def worker(p: dict) -> dict:
    import jax
    import numpy as np

    import qwen_vit_jax as qvj
    from qwen_vit_jax.plan import Bucket
    from qwen_vit_jax.weights.keys import expected_param_shapes

    cfg = qvj.PRESETS[p["variant"]]
    rng = np.random.default_rng(0)
    params = {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in expected_param_shapes(cfg).items()}
    enc = qvj.VisionEncoder(cfg, params, dtype=p["dtype"])
    del params
    grid = [[1, p["side"], p["side"]]]
    px = rng.standard_normal((p["side"] ** 2, cfg.patch_dim)).astype(np.float32)
    enc.warmup([grid], tight=True)  # a recurring size: its tight bucket
    for _ in range(2):
        enc.encode(px, grid)
    (bucket,) = [Bucket(**b) for b in enc.cost_report(grid)["buckets"]]
    times = common.time_calls(enc.encode, 3, px, grid)
    hlo = enc.programs.get(bucket).as_text()
    meta, shape = {}, {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) .*?op_name=\"([^\"]*)\"", line)
        if m:
            shape[m.group(1)], meta[m.group(1)] = m.group(2).split("{")[0], m.group(3)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            enc.encode(px, grid)
        wall = wall_per_op(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    groups = collections.Counter()
    for name, sec in wall.items():
        groups[kind(meta.get(name, ""), name)] += sec
    top = sorted(wall.items(), key=lambda kv: -kv[1])[: p["top"]]
    return {
        "bucket": str(bucket),
        "encode_s": times,
        "traced_s": sum(wall.values()),
        "groups": dict(groups),
        "top": [[n, s, shape.get(n, "?"), meta.get(n, "").split("/")[-1]] for n, s in top],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="qwen2.5-vl-3b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--side", type=int, default=36)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/trace.json)")
    args = ap.parse_args()
    print(common.machine_line())
    results = {}
    for dtype in args.dtypes.split(","):
        payload = {"variant": args.variant, "dtype": dtype, "side": args.side, "top": args.top}
        r = results[dtype] = common.run_worker(__file__, "trace", payload)
        total = r["traced_s"]
        print(
            f"\n### {args.variant}, {dtype}, [[1, {args.side}, {args.side}]] in {r['bucket']}: "
            f"encode {min(r['encode_s']):.2f}-{max(r['encode_s']):.2f} s untraced, {total:.2f} s traced\n"
        )
        rows = [
            [g, f"{1e3 * s:.0f}", f"{100 * s / total:.1f}%"]
            for g, s in sorted(r["groups"].items(), key=lambda kv: -kv[1])
        ]
        print(common.markdown_table(["group", "ms", "share"], rows))
        print()
        print(
            common.markdown_table(
                ["op", "ms", "output", "JAX operation"], [[n, f"{1e3 * s:.1f}", sh, m] for n, s, sh, m in r["top"]]
            )
        )
    common.write_json(args.out or common.default_out("trace", False), {"bench": "trace", "results": results})


if __name__ == "__main__" and not common.worker_main({"trace": worker}):
    main()
