"""The JAX peer: EasyDeL 0.3.0's jitted Qwen2VLVisionTransformer vs our VisionEncoder on the
Qwen2-VL-2B tower, float32, one image per call.

Same weights: one HF checkpoint (random weights, as in the forward suite), converted by us
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

EasyDeL lives in its own venv (it pins an older jax and imports torch and pillow), named by
--easydel-python or $EASYDEL_PYTHON:
    python -m venv easydel-venv
    easydel-venv/bin/pip install torch==2.13.0 easydel==0.3.0 pillow
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

--quick: the 2-block tower, one 8x8 image, a stream of 3; without EasyDeL (no --easydel-python, no
$EASYDEL_PYTHON) only our sides run there (a full run needs it).
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import time

import numpy as np

from benchmarks import common
from benchmarks.workloads.grids import distinct_stream

DEFAULTS = {"repeats": (3, 2), "rounds": (2, 1)}
VARIANT = "qwen2-vl-2b"
SEED = 0
LADDER = "ours, default ladder"  # the timed sizes with no size declared: the ladder's bucket
BOUND = "ours, all sizes declared (bound)"  # the stream with nothing to compile: the forward alone


def probe_sides(sizes: list[int]) -> list[list[int]]:
    """New (h, w) after the timed sizes: a little off each, then a transpose."""
    return [[s, s + 2] for s in sizes] + [[sizes[-1] + 2, sizes[-1]]]


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
        "versions": common.versions("easydel", "jax", "jaxlib", "flax", "torch"),
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
    }


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


def add_args(p) -> None:
    p.add_argument("--sizes", help="image sides in patches: grid [[1, s, s]] (default 16,36; --quick 8)")
    p.add_argument("--stream", type=int, help="distinct sizes of the stream part (default 10, --quick 3; 0: skip it)")
    p.add_argument("--stream-only", action="store_true", help="run the stream part only")
    p.add_argument(
        "--stream-bound",
        action="store_true",
        help="also time ours on the stream with every size declared and compiled before the clock",
    )
    p.add_argument("--easydel-python", default=os.environ.get("EASYDEL_PYTHON"), help="EasyDeL's venv's python")


def run(args) -> dict:
    sizes = [int(s) for s in (args.sizes or ("8" if args.quick else "16,36")).split(",")]
    n_stream = args.stream if args.stream is not None else (3 if args.quick else 10)
    if not args.easydel_python and not args.quick:
        raise SystemExit("peer: EasyDeL's python is needed (--easydel-python or $EASYDEL_PYTHON); see --help")
    dirs = common.checkpoint(VARIANT, args.quick)
    outputs = pathlib.Path(dirs["hf"]).parent / "outputs"
    outputs.mkdir(exist_ok=True)
    payload = {
        **dirs,
        "hub": hub_layout(dirs["hf"]),
        "sizes": sizes,
        "repeats": args.repeats,
        "patch_dim": common.model_config(VARIANT, args.quick).patch_dim,
        "outputs": str(outputs),
    }
    stream = distinct_stream(n_stream, hi=16 if args.quick else 36) if n_stream else []
    sides = {"EasyDeL": "easydel", "ours": "ours", LADDER: "ours-ladder"}
    if not args.easydel_python:
        common.log("no EasyDeL python (--easydel-python): our sides only")
        del sides["EasyDeL"]

    def worker(impl: str, extra: dict) -> dict:
        p = {**payload, "name": sides[impl], "probe": probe_sides(sizes) if extra.pop("probe", False) else [], **extra}
        if impl == "EasyDeL":
            return common.run_worker(__name__, "easydel", p, python=args.easydel_python, env=common.torch_env())
        return common.run_worker(__name__, "ours", p | ({"ladder": True, "probe": []} if impl == LADDER else {}))

    runs, streams, first = {k: [] for k in sides}, {k: [] for k in sides if k != LADDER}, True
    for rnd in range(args.rounds):
        order = list(sides) if rnd % 2 == 0 else list(sides)[::-1]
        for impl in order if not args.stream_only else ():
            runs[impl].append(worker(impl, {"probe": first}))  # new sizes: the first round only
        first = False
        for impl in [x for x in order if x != LADDER] if stream else ():
            streams[impl].append(worker(impl, {"stream": stream}))  # a fresh process: nothing compiled
        if stream and args.stream_bound:
            streams.setdefault(BOUND, []).append(worker("ours", {"stream": stream, "bound": True}))
    records = []
    for side in sizes if not args.stream_only else ():
        out = {name: np.load(outputs / f"{name}-{side}.npy") for name in sides.values()}
        rec = {"patches": side * side, "grid_thw": [[1, side, side]], "rel_diff": {}}
        for impl, rs in runs.items():
            rec[impl] = {
                "median": statistics.median(t for r in rs for t in r["sizes"][str(side)]["times"]),
                "round_medians": [statistics.median(r["sizes"][str(side)]["times"]) for r in rs],
                "first": statistics.median(r["sizes"][str(side)]["first"] for r in rs),
                "first_compiles": rs[0]["sizes"][str(side)]["first_compiles"],
            }
        rec["rel_diff"] = {
            impl: common.rel_diff(out[name], out["ours"]) for impl, name in sides.items() if impl != "ours"
        }
        records.append(rec)
    probes = {impl: rs[0]["probe"] for impl, rs in runs.items() if rs and rs[0]["probe"]}
    stream_rows = {
        impl: {"per_round": [r["total_s"] for r in rs], "compiles": rs[0]["compiles"]} for impl, rs in streams.items()
    }
    load = {impl: statistics.median(r["load_s"] for r in rs) for impl, rs in (runs if runs else streams).items() if rs}
    versions = next((r["versions"] for r in runs.get("EasyDeL", []) + streams.get("EasyDeL", [])), None)
    return {
        "variant": VARIANT,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "device": next(r["device"] for rs in (*runs.values(), *streams.values()) for r in rs),
        "records": records,
        "probes": probes,
        "stream_sizes": stream,
        "streams": stream_rows,
        "load_s": load,
        "easydel_versions": versions,
    }


def report(result: dict) -> str:
    d, fmt, parts = result["data"], common.fmt_seconds, []
    base = "EasyDeL" if any("EasyDeL" in r for r in d["records"]) or "EasyDeL" in d["streams"] else "ours"
    if d["records"]:
        rows = []
        for r in d["records"]:
            for impl in (x for x in ("EasyDeL", "ours", LADDER) if x in r):
                t = r[impl]
                per = " / ".join(fmt(x) for x in t["round_medians"])
                ratios = [b / a for a, b in zip(t["round_medians"], r[base]["round_medians"])]
                vs = f"**{r[base]['median'] / t['median']:.2f}x** ({', '.join(f'{x:.2f}' for x in ratios)})"
                rel = r["rel_diff"].get(impl)
                rows.append([r["patches"], impl, per, fmt(t["median"]), vs, fmt(t["first"]), t["first_compiles"]])
                rows[-1].append("-" if rel is None else f"{rel:.1e} vs ours")
        heads = ["patches", "side", "round medians", "median", f"vs {base} (per round)", "first call", "compiles"]
        parts.append(
            f"{d['variant']} float32 on {d['device']}, one image per call, a fresh process per side and round "
            f"(sides alternating), medians of {d['repeats']} calls x {d['rounds']} round(s):\n\n"
            + common.markdown_table(heads + ["rel diff"], rows)
        )
    if d["streams"]:
        sizes = ", ".join(f"{h}x{w}" for h, w in d["stream_sizes"])
        rows = []
        for impl, s in d["streams"].items():
            med = statistics.median(s["per_round"])
            vs = statistics.median(d["streams"][base]["per_round"]) / med
            rows.append([impl, " / ".join(fmt(x) for x in s["per_round"]), fmt(med), s["compiles"], f"**{vs:.2f}x**"])
        parts.append(
            f"A stream of {len(d['stream_sizes'])} distinct single images ({sizes}), each encoded once in a fresh "
            "process, wall time with every compile (load excluded):\n\n"
            + common.markdown_table(["side", "per round", "median", "compiles", f"vs {base}"], rows)
        )
    return "\n\n".join(parts)


WORKERS = {"easydel": easydel_worker, "ours": ours_worker}
