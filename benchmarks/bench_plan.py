"""Host index work: our numba plan vs everything HF 5.x's Qwen2.5-VL visual forward computes
before its blocks, on the five seed cases.

  ours (uncached)  qwen_vit_jax.plan.make_plans with the plan caches cleared before each call:
                   validation, rotary ids, frame and window tables, bucket padding, chunking.
                   The cleared plans' buffers go back to the plan package's BufferPool and are reused, as
                   in a long-running process whose cache evicts plans; the JSON's "first" is
                   the very first call of the process (cold: numba's cache, fresh pages).
                   cos/sin are not in it: our jitted forward computes them on the device.
  ours (cached)    the same call repeated (what `encode` pays for a grid it has seen).
  HF               get_vision_position_ids, get_vision_cu_seqlens, get_vision_window_index,
                   Qwen2_5_VLVisionRotaryEmbedding on those ids (cos, sin), the window
                   permutation of cos and sin, and argsort(window_index) (the reverse index).

Each side runs in its own process. HF runs twice, with OMP_WAIT_POLICY=ACTIVE: torch as
installed (one thread per core) and single-threaded, because its small index ops can be much
slower multi-threaded on a small or busy VM; ratios are against the faster of the two. The
processes alternate for --rounds rounds (ours, HF, HF 1 thread, ours, ...): the speed of a
shared VM drifts by up to 2x over minutes, and alternating spreads that drift over both sides.
Times are medians of the per-call timings of all rounds.

    python benchmarks/bench_plan.py [--quick] [--repeats N] [--rounds N] [--out PATH]
    python benchmarks/bench_plan.py --against REV    # + ours at REV in the same rounds (an A/B)
"""

from __future__ import annotations

import argparse
import dataclasses

import common
import numpy as np

VARIANT = "qwen2.5-vl-3b"


def seed_cases(seed: int = 0) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(seed)
    jitter = [[10, 36 + int(rng.choice([-2, 0, 2])), 36 + int(rng.choice([-2, 0, 2]))] for _ in range(10)]
    return {
        "1x8x8": [[1, 8, 8]],
        "1x36x36": [[1, 36, 36]],
        "10x36x36": [[10, 36, 36]],
        "10 videos 10x36x36": [[10, 36, 36]] * 10,
        "10 videos 10x(36+-2)^2": jitter,
    }


def ours_worker(p: dict) -> dict:
    from qwen_vit_jax import plan
    from qwen_vit_jax.presets import PRESETS

    cfg = PRESETS[VARIANT]
    clear = plan.clear_caches
    out = {}
    for name, grid in p["cases"].items():
        g = np.array(grid)
        first = common.time_calls(plan.make_plans, 1, g, cfg, setup=clear)[0]  # + loading numba's cache
        uncached = common.time_calls(plan.make_plans, p["repeats"], g, cfg, setup=clear)
        cached = common.time_calls(plan.make_plans, p["repeats"], g, cfg)
        out[name] = {
            "first": first,
            "uncached": common.summary(uncached),
            "cached": common.summary(cached),
            "buckets": [dataclasses.asdict(pl.bucket) for pl in plan.make_plans(g, cfg)],
        }
    return out


def hf_worker(p: dict) -> dict:
    import torch
    from transformers import vision_utils as vu
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionRotaryEmbedding

    from qwen_vit_jax.presets import PRESETS

    c = PRESETS[VARIANT]
    hf_cfg = Qwen2_5_VLVisionConfig(
        depth=c.depth,
        hidden_size=c.width,
        num_heads=c.num_heads,
        intermediate_size=c.intermediate_size,
        out_hidden_size=c.out_dim,
        window_size=c.window_size,
        fullatt_block_indexes=list(c.fullatt_block_indexes),
    )
    rotary = Qwen2_5_VLVisionRotaryEmbedding(hf_cfg)
    m, unit = hf_cfg.spatial_merge_size, hf_cfg.spatial_merge_size**2

    def index_work(g):
        pos = vu.get_vision_position_ids(g, m)
        cu = vu.get_vision_cu_seqlens(g)
        window_index, cu_window = vu.get_vision_window_index(g, m, hf_cfg.window_size, hf_cfg.patch_size)
        cos, sin = rotary(pos, pos)  # the first argument only names the device
        n = pos.shape[0]
        cos, sin = (t.reshape(n // unit, unit, -1)[window_index].reshape(n, -1) for t in (cos, sin))
        return cos, sin, cu, cu_window, torch.argsort(window_index)

    out = {"torch_threads": torch.get_num_threads(), "versions": common.versions("torch", "transformers")}
    with torch.no_grad():
        for name, grid in p["cases"].items():
            g = torch.tensor(grid, dtype=torch.int64)
            first = common.time_calls(index_work, 1, g)[0]
            times = common.time_calls(index_work, p["repeats"], g)
            out[name] = {"first": first, "times": common.summary(times)}
    return out


def merge_rounds(results: list[dict], keys: tuple[str, ...]) -> dict:
    """One worker result from several rounds' results: the timings under `keys` of every case
    pooled into one summary, "first" of the first round (the others' are alike), the rest as is."""
    out = dict(results[0])
    for name, case in results[0].items():
        if isinstance(case, dict) and "first" in case:
            out[name] = {**case, **{k: common.summary([t for r in results for t in r[name][k]["times"]]) for k in keys}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per case and process")
    ap.add_argument("--rounds", type=int, default=3, help="processes per side, alternating")
    ap.add_argument("--quick", action="store_true", help="5 repeats, 1 round")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/plan[-quick].json)")
    ap.add_argument("--against", metavar="REV", help="also time ours at this git revision, alternating")
    args = ap.parse_args()
    repeats, rounds = (5, 1) if args.quick else (args.repeats, args.rounds)
    cases = seed_cases()
    payload = {"cases": cases, "repeats": repeats}
    ours_rounds, hf_rounds, rev_rounds = [], [[], []], []
    rev_env = common.rev_env(common.worktree(args.against)) if args.against else None
    for _ in range(rounds):
        ours_rounds.append(common.run_worker(__file__, "ours", payload))
        if rev_env is not None:
            rev_rounds.append(common.run_worker(__file__, "ours", payload, env=rev_env))
        for runs, t in zip(hf_rounds, (None, 1)):
            runs.append(common.run_worker(__file__, "hf", payload, env=common.torch_env(t)))
    ours = merge_rounds(ours_rounds, ("uncached", "cached"))
    hf_runs = [merge_rounds(runs, ("times",)) for runs in hf_rounds]
    threads = [r["torch_threads"] for r in hf_runs]

    headers = [
        "case",
        "patches",
        *(f"HF {t} thr" for t in threads),
        "ours uncached",
        "ours cached",
        "HF / uncached",
        "HF / cached",
    ]
    rows, records = [], []
    for name, grid in cases.items():
        hfs = [r[name]["times"]["median"] for r in hf_runs]
        h, u, c = min(hfs), ours[name]["uncached"]["median"], ours[name]["cached"]["median"]
        patches = int(np.prod(grid, axis=1).sum())
        rows.append([name, patches, *map(common.fmt_seconds, (*hfs, u, c)), f"{h / u:.1f}x", f"{h / c:.0f}x"])
        records.append(
            {
                "case": name,
                "grid_thw": grid,
                "patches": patches,
                "hf": {f"threads_{t}": r[name] for t, r in zip(threads, hf_runs)},
                "ours": ours[name],
                "ratio_uncached": h / u,
                "ratio_cached": h / c,
            }
        )
    print(f"Host index work, medians of {rounds} round(s) x {repeats} calls (ratios vs the faster HF run)\n")
    print(common.markdown_table(headers, rows))
    against = None
    if rev_rounds:
        against = merge_rounds(rev_rounds, ("uncached", "cached"))
        ab = [
            [name, *(common.fmt_seconds(s[name][k]["median"]) for s in (against, ours) for k in ("uncached", "cached"))]
            + [f"{against[name]['uncached']['median'] / ours[name]['uncached']['median']:.2f}x"]
            for name in cases
        ]
        rev = args.against
        print(f"\nOurs at {rev} vs the working tree, same rounds\n")
        heads = ["case", f"{rev} uncached", f"{rev} cached", "tree uncached", "tree cached", f"{rev} / tree uncached"]
        print(common.markdown_table(heads, ab))
    versions = {**common.versions("numba", "numpy"), **hf_runs[0]["versions"]}
    common.write_json(
        args.out or common.default_out("plan", args.quick),
        {
            "bench": "plan",
            "variant": VARIANT,
            "repeats": repeats,
            "rounds": rounds,
            "cases": records,
            "versions": versions,
            "against": {"rev": args.against, "ours": against} if against else None,
        },
    )


if __name__ == "__main__" and not common.worker_main({"ours": ours_worker, "hf": hf_worker}):
    main()
