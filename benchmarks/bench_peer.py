"""The JAX peer: EasyDeL 0.3.0's jitted Qwen2VLVisionTransformer vs our VisionEncoder on the
Qwen2-VL-2B tower, float32, one image per call.

Same weights: one HF checkpoint (random weights, as in bench_forward), converted by us
(convert_checkpoint) and by EasyDeL itself (from_pretrained(..., from_torch=True), reading
a hub-layout copy of config.json: EasyDeL 0.3.0 cannot read the nested text_config that
transformers 5.x writes). EasyDeL's forward loops over grid_thw in Python and splits
attention by its values, so it is jitted with the grid as a compile-time constant: one
program per distinct grid. Ours compiles one program per bucket; the timed sizes are declared
recurring sizes (`warmup([grid], tight=True)`, counted in the first call): their tight buckets,
rows rounded only to the attention blocks (1296 patches: 1296 rows), against EasyDeL's program
for exactly that shape. A third side, "ours, default ladder", times the same sizes with nothing
declared: the ladder's bucket (1296 patches: 1536 rows), what a size seen once runs. Both compile
cold: EasyDeL's import switches JAX's persistent compilation cache on, the worker switches it off
again.

EasyDeL lives in its own venv (it pins an older jax and imports torch and pillow):
    python -m venv /work/easydel-venv
    /work/easydel-venv/bin/pip install torch==2.13.0 easydel==0.3.0 pillow
The sides alternate, each round a fresh process per side (--rounds). Each process: load,
then per size a first call (compile) and --repeats timed calls (medians over all rounds);
in the first round, then the size-change probe: a first and a second call on each of a few
new sizes, with the XLA compiles they triggered (common.count_compiles) and their seconds.
The stream part (--stream N, default 10): N distinct single images (h, w even in [8, 36],
seed 1), each encoded once, in a fresh process per side and round that has compiled nothing:
the wall time of the whole stream, compiles included (ours: the ladder, no size declared).
--stream-only skips the timed sizes; --stream-bound adds ours with every stream size declared
and compiled before the clock (tight buckets): forward time alone, the most any bucket policy
could save.

    python benchmarks/bench_peer.py [--quick] [--sizes 16,36] [--repeats N] [--rounds N]
        [--stream N] [--stream-only] [--stream-bound]
        [--easydel-python /work/easydel-venv/bin/python] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import common
import numpy as np

VARIANT = "qwen2-vl-2b"
SEED = 0
LADDER = "ours, default ladder"  # the timed sizes with no size declared: the ladder's bucket


def probe_sides(sizes: list[int]) -> list[list[int]]:
    """New (h, w) after the timed sizes: a little off each, then a transpose."""
    return [[s, s + 2] for s in sizes] + [[sizes[-1] + 2, sizes[-1]]]


def stream_sizes(n: int = 10, seed: int = 1, lo: int = 8, hi: int = 36) -> list[list[int]]:
    """n distinct (h, w), both even in [lo, hi] (seed 1): the stream part's images."""
    rng = np.random.default_rng(seed)
    out: list[list[int]] = []
    while len(out) < n:
        hw = [int(x) for x in 2 * rng.integers(lo // 2, hi // 2 + 1, size=2)]
        if hw not in out:
            out.append(hw)
    return out


def run_stream(call, p: dict, compiles: dict, declare=None) -> dict:
    """Encode each stream size once, in order, in a process that has compiled nothing yet: the
    wall time of the whole stream, compiles included (pixels made before the clock starts).
    `declare(grid)`, if given, runs for every size before the clock: the bound (ours with every
    size declared and compiled, its tight bucket: forward time only, no compile and no ladder
    padding)."""
    grids = [np.array([[1, h, w]]) for h, w in p["stream"]]
    inputs = [(common.random_pixels(g, p["patch_dim"], SEED), g) for g in grids]
    for g in grids if declare is not None else ():
        declare(g)
    per, c_start, t_start = [], compiles["count"], time.perf_counter()
    for px, g in inputs:
        c0, t0 = compiles["count"], time.perf_counter()
        call(px, g)
        per.append({"grid": g.tolist(), "s": time.perf_counter() - t0, "compiles": compiles["count"] - c0})
    return {"total_s": time.perf_counter() - t_start, "compiles": compiles["count"] - c_start, "per_size": per}


def run_sides(call, p: dict, compiles: dict, declare=None) -> dict:
    """Time call(px, grid) on the timed sizes, then probe new sizes. `declare(grid)`, if given,
    runs before a timed size's first call and counts in its time (ours: warmup(tight=True), the
    grid's tight bucket: what a size that recurs runs)."""
    out = {"sizes": {}, "probe": []}
    for side in p["sizes"]:
        g = np.array([[1, side, side]])
        px = common.random_pixels(g, p["patch_dim"], SEED)
        c0 = compiles["count"]
        t0 = time.perf_counter()
        if declare is not None:
            declare(g)
        first = time.perf_counter() - t0 + common.time_calls(call, 1, px, g)[0]
        np.save(f"{p['outputs']}/{p['name']}-{side}.npy", call(px, g))
        out["sizes"][side] = {
            "first": first,
            "first_compiles": compiles["count"] - c0,
            "times": common.time_calls(call, p["repeats"], px, g),
        }
    for h, w in p["probe"]:
        g = np.array([[1, h, w]])
        px = common.random_pixels(g, p["patch_dim"], SEED)
        c0 = compiles["count"]
        first = common.time_calls(call, 1, px, g)[0]
        out["probe"].append(
            {
                "h": h,
                "w": w,
                "first": first,
                "compiles": compiles["count"] - c0,
                "second": common.time_calls(call, 1, px, g)[0],
            }
        )
    out["persistent_cache_hits"] = compiles["cache_hits"]
    return out


def easydel_worker(p: dict) -> dict:
    import functools

    import easydel as ed
    import jax
    import jax.numpy as jnp
    from flax import nnx

    # Importing easydel turns JAX's persistent compilation cache on (ejkernel's ejit sets
    # jax_compilation_cache_dir): from the second process on, programs would be loaded instead
    # of compiled. Off before the first compile (the setting is read once), so both sides
    # compile cold, as ours does by default; persistent_cache_hits checks it.
    jax.config.update("jax_enable_compilation_cache", False)
    compiles = common.count_compiles()
    t0 = time.perf_counter()
    model = ed.AutoEasyDeLModelForImageTextToText.from_pretrained(
        p["hub"],
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
        from_torch=True,
        auto_shard_model=False,
        verbose=False,
    )
    graphdef, state = nnx.split(model.model.visual)
    load = time.perf_counter() - t0

    @functools.cache
    def program(grid: tuple):  # the grid is static: EasyDeL iterates over its values
        g = np.array(grid)
        biggest = int(g[:, 1:].max())
        return jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, grid_thw=g, max_grid_size=biggest))

    def call(px, g):
        return np.asarray(program(tuple(map(tuple, g.tolist())))(state, jnp.asarray(px)))

    return {
        "load_s": load,
        "device": str(jax.devices()[0]),
        **(run_stream(call, p, compiles) if p.get("stream") else run_sides(call, p, compiles)),
        "versions": common.versions("easydel", "jax", "jaxlib", "flax"),
    }


def ours_worker(p: dict) -> dict:
    import jax

    import qwen_vit_jax as qvj

    compiles = common.count_compiles()
    t0 = time.perf_counter()
    enc = qvj.VisionEncoder.from_pretrained(p["ours"], dtype="float32")
    load = time.perf_counter() - t0
    declare = lambda g: enc.warmup([g], tight=True)  # noqa: E731  a size that recurs: its tight bucket
    return {
        "load_s": load,
        "device": str(jax.devices()[0]),
        "numerics": str(enc.num),
        **(
            run_sides(enc.encode, p, compiles, None if p.get("ladder") else declare)
            if not p.get("stream")
            else run_stream(enc.encode, p, compiles, declare if p.get("bound") else None)
        ),
        "versions": common.versions("jax", "jaxlib", "flax"),
    }


def print_timed(args, sizes: list[int], runs: dict, rows: list, rounds: int, repeats: int) -> None:
    """The timed sizes' table and the new-size probe's."""
    print(
        f"{VARIANT}{' (quick: 2 blocks)' if args.quick else ''} float32, {rounds} round(s) x {repeats} "
        f"timed calls per side, {runs['ours'][0]['device']}\n"
    )
    print(
        common.markdown_table(
            ["patches", "impl", "median", "vs EasyDeL", "first call", "compiles (first)", "rel diff vs ours"], rows
        )
    )
    probed = {impl: rs for impl, rs in runs.items() if rs[0]["probe"]}
    probe_rows = []
    for i, (h, w) in enumerate(probe_sides(sizes)):
        row = [f"{h}x{w}"]
        for rs in probed.values():
            pr = rs[0]["probe"][i]
            row += [pr["compiles"], common.fmt_seconds(pr["first"]), common.fmt_seconds(pr["second"])]
        probe_rows.append(row)
    print("\nNew image sizes after warm-up (first process of each side):\n")
    heads = ["h x w", *(f"{impl} {x}" for impl in probed for x in ("compiles", "first call", "second call"))]
    print(common.markdown_table(heads, probe_rows))


def hub_layout(hf_dir: str) -> str:
    """A copy of the checkpoint with config.json in the hub (transformers 4.4x) layout: text
    fields at the top level. The weights file is linked, not copied."""
    hf = pathlib.Path(hf_dir)
    hub = hf.parent / "hub"
    if not hub.is_dir():
        tmp = hf.parent / "hub.tmp"
        tmp.mkdir(exist_ok=True)
        config = json.loads((hf / "config.json").read_text())
        text = config.pop("text_config")
        text.pop("model_type", None)
        (tmp / "config.json").write_text(json.dumps({**config, **text}, indent=1))
        if not (tmp / "model.safetensors").exists():
            os.symlink(hf / "model.safetensors", tmp / "model.safetensors")
        tmp.rename(hub)
    return str(hub)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,36", help="image sides in patches: grid [[1, s, s]]")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="processes per side, alternating")
    ap.add_argument("--stream", type=int, default=10, help="distinct sizes of the stream part (0: skip it)")
    ap.add_argument("--stream-only", action="store_true", help="run the stream part only")
    ap.add_argument(
        "--stream-bound",
        action="store_true",
        help="also time ours on the stream with every size declared and compiled before the clock",
    )
    ap.add_argument("--easydel-python", default="/work/easydel-venv/bin/python")
    ap.add_argument("--quick", action="store_true", help="2-block config, sides 8 and 16, 2 repeats, 1 round")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/peer[-quick].json)")
    args = ap.parse_args()
    sizes = [8, 16] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeats, rounds = (2, 1) if args.quick else (args.repeats, args.rounds)

    cfg = common.model_config(VARIANT, args.quick)
    dirs = common.checkpoint(__file__, VARIANT, args.quick)
    outputs = pathlib.Path(dirs["hf"]).parent / "outputs"
    outputs.mkdir(exist_ok=True)
    payload = {
        **dirs,
        "hub": hub_layout(dirs["hf"]),
        "sizes": sizes,
        "repeats": repeats,
        "probe": probe_sides(sizes),
        "patch_dim": cfg.patch_dim,
        "outputs": str(outputs),
    }
    stream = stream_sizes(args.stream, hi=16 if args.quick else 36) if args.stream else []

    def worker(impl: str, extra: dict) -> dict:
        if impl == "EasyDeL":
            python, env = args.easydel_python, common.torch_env()
            easydel = {**payload, "name": "easydel", **extra}
            return common.run_worker(__file__, "easydel", easydel, python=python, env=env)
        if impl == LADDER:  # no size declared: the default ladder's bucket; no new-size probe
            return common.run_worker(__file__, "ours", {**payload, "name": "ours-ladder", "ladder": True, "probe": []})
        return common.run_worker(__file__, "ours", {**payload, "name": "ours", **extra})

    runs, streams = {"EasyDeL": [], "ours": [], LADDER: []}, {"EasyDeL": [], "ours": []}
    for i in range(rounds):
        payload["probe"] = payload["probe"] if i == 0 else []  # new sizes: first round only
        order = ("EasyDeL", "ours", LADDER) if i % 2 == 0 else (LADDER, "ours", "EasyDeL")  # sides alternate
        for impl in order if not args.stream_only else ():
            runs[impl].append(worker(impl, {}))
        for impl in [x for x in order if x != LADDER] if stream else ():
            streams[impl].append(worker(impl, {"stream": stream}))  # a fresh process: nothing compiled
        if stream and args.stream_bound:
            streams.setdefault("ours, all sizes declared (bound)", []).append(
                worker("ours", {"stream": stream, "bound": True})
            )

    rows, records = [], []
    for side in sizes if not args.stream_only else ():
        med = {
            impl: statistics.median(t for r in rs for t in r["sizes"][str(side)]["times"]) for impl, rs in runs.items()
        }
        ed_out, ours_out, ladder_out = (
            np.load(outputs / f"{name}-{side}.npy") for name in ("easydel", "ours", "ours-ladder")
        )
        rel = float(np.linalg.norm(ed_out - ours_out) / np.linalg.norm(ours_out))
        rel_ladder = float(np.linalg.norm(ladder_out - ours_out) / np.linalg.norm(ours_out))
        for impl, rs in runs.items():
            first = statistics.median(r["sizes"][str(side)]["first"] for r in rs)
            rows.append(
                [
                    side * side,
                    impl,
                    common.fmt_seconds(med[impl]),
                    f"{med['EasyDeL'] / med[impl]:.2f}x",
                    common.fmt_seconds(first),
                    rs[0]["sizes"][str(side)]["first_compiles"],
                    {"EasyDeL": f"{rel:.1e}", LADDER: f"{rel_ladder:.1e}"}.get(impl, "-"),
                ]
            )
        records.append(
            {
                "patches": side * side,
                "grid_thw": [[1, side, side]],
                "median_s": med,
                "speedup_vs_easydel": med["EasyDeL"] / med["ours"],
                "speedup_vs_easydel_ladder": med["EasyDeL"] / med[LADDER],
                "rel_diff_easydel_vs_ours": rel,
                "rel_diff_ladder_vs_ours": rel_ladder,
            }
        )
    if not args.stream_only:
        print_timed(args, sizes, runs, rows, rounds, repeats)
    if stream:
        total = {impl: statistics.median(r["total_s"] for r in rs) for impl, rs in streams.items()}
        print(
            f"\nStream: {len(stream)} distinct single images (h, w even in [8, {max(max(hw) for hw in stream)}], "
            f"seed 1: {', '.join(f'{h}x{w}' for h, w in stream)}), each encoded once in a fresh process, "
            f"wall time of the stream including compiles (load excluded), median over {rounds} round(s):\n"
        )
        print(
            common.markdown_table(
                ["impl", "stream wall", "per round", "compiles", "vs EasyDeL"],
                [
                    [
                        impl,
                        common.fmt_seconds(total[impl]),
                        ", ".join(common.fmt_seconds(r["total_s"]) for r in rs),
                        rs[0]["compiles"],
                        f"{total['EasyDeL'] / total[impl]:.2f}x",
                    ]
                    for impl, rs in streams.items()
                ],
            )
        )
    load = {
        impl: statistics.median(r["load_s"] for r in rs) for impl, rs in (streams if args.stream_only else runs).items()
    }
    print("\nLoad (convert + place weights), median: " + ", ".join(f"{k} {v:.1f} s" for k, v in load.items()))
    common.write_json(
        args.out or common.default_out("peer", args.quick),
        {
            "bench": "peer",
            "variant": VARIANT,
            "quick": args.quick,
            "repeats": repeats,
            "rounds": rounds,
            "records": records,
            "load_s": load,
            "runs": runs,
            "stream_sizes": stream,
            "streams": streams,
        },
    )


if __name__ == "__main__" and not common.worker_main(
    {
        "easydel": easydel_worker,
        "ours": ours_worker,
        "build": common.build_checkpoint,
    }
):
    main()
