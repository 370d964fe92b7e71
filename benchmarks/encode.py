"""The encode loop over many small images, the working tree vs a revision: the A/B a change to the
item path (data/, runtime/batching.py, the sinks) gets before it lands.

    python -m benchmarks encode --against HEAD~1      # 1,000 JPEGs, 4 rounds, .safetensors and .parquet
    python -m benchmarks encode --quick               # 24 JPEGs, the tree alone: seconds

`qwen-vit-jax encode` of --n distinct 128x96..320x240 JPEGs (one folder, written once under the
bench cache) through the host-bound tower (common.host_bound_checkpoint: one window block of width
32, so the host's work is what is timed), --workers 0 (the run is one process), to each of --outs,
each run in a fresh worker process, the sides alternating over --rounds after one untimed round (it
fills the JAX compilation cache both sides share): the loop's seconds (the CLI's summary line), the
whole `main()` with the final write, and the peak RSS. The outputs of the two sides are compared:
what they hold (names, grids, timestamps, embeddings: the same, or the change is wrong) and their
bytes (a revision may lay out the same embeddings otherwise, e.g. parquet's pages).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
import statistics
import time

from benchmarks import common

DEFAULTS = {"rounds": (4, 1)}
AGAINST = "ours at REV beside the working tree (its worktree first on PYTHONPATH): the same runs, alternating"


def add_args(p) -> None:
    p.add_argument("--n", type=int, help="images (default 1000; --quick 24)")
    p.add_argument(
        "--outs",
        type=lambda s: s.split(","),
        help="the output formats (default .safetensors,.parquet; --quick .safetensors)",
    )


def images(n: int) -> str:
    """A folder of n distinct small JPEGs under the bench cache, written once."""
    import numpy as np
    from PIL import Image

    folder = common.cache() / f"encode-jpegs-{n}"
    if not (folder / f"{n - 1:05d}.jpg").exists():
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        for i in range(n):
            w, h = 128 + 32 * (i % 7), 96 + 24 * (i % 7)
            px = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(px).save(folder / f"{i:05d}.jpg", quality=85)
    return str(folder)


def encode_worker(p: dict) -> dict:
    """Worker: `qwen-vit-jax encode` of p["images"] to p["out"] in this process."""
    import resource

    from qwen_vit_jax.tools.cli import main

    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        rc = main(["encode", p["ckpt"], p["images"], "-o", p["out"], "--overwrite", "--workers", "0"])
    wall = time.perf_counter() - t0
    loop = re.search(r"\(([0-9,]+) tokens x (\d+)\) in ([0-9.]+) s", out.getvalue())
    if rc != 0 or loop is None:
        raise RuntimeError(f"encode failed ({rc}): {out.getvalue()[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"loop_s": float(loop[3]), "wall_s": wall, "peak_mib": peak, "sha256": digest(p["out"])}


def digest(path: str) -> dict:
    """sha256 of an output's bytes, and of what it holds (names, grids, offsets, timestamps and the
    embeddings, as read back): a revision may write other bytes for the same embeddings."""
    import numpy as np

    from qwen_vit_jax.data.embeddings import read_embeddings

    with open(path, "rb") as f:
        raw = hashlib.sha256(f.read()).hexdigest()
    e = read_embeddings(path)
    h = hashlib.sha256("\n".join(e.names).encode())
    for a in (e.grid_thw, e.offsets, e.timestamps, e.embeddings):
        h.update(np.ascontiguousarray(a).tobytes())
    return {"bytes": raw, "content": h.hexdigest()}


def hb_checkpoint(p: dict) -> dict:
    return {"path": common.host_bound_checkpoint()}


def run(args) -> dict:
    n = args.n or (24 if args.quick else 1000)
    outs = args.outs or ([".safetensors"] if args.quick else [".safetensors", ".parquet"])
    ckpt = common.run_worker(__name__, "checkpoint", {})["path"]
    folder = images(n)
    sides = {"tree": common.ROOT}
    if args.against:
        sides[common.rev_info(args.against)["hash"][:7]] = common.worktree(args.against)
    cases = []
    for suffix in outs:

        def one(side, tree, suffix=suffix):
            p = {"ckpt": ckpt, "images": folder, "out": str(common.cache() / f"encode_out_{side}{suffix}")}
            env = None if tree == common.ROOT else common.rev_env(tree)
            return common.run_worker(__name__, "encode", p, env=env)

        common.alternate(1, sides, one)  # untimed: the compilation cache filled for both sides
        cases.append({"out": suffix, "runs": common.alternate(args.rounds, sides, one)})
    return {"n": n, "sides": list(sides), "cases": cases}


def report(result: dict) -> str:
    d = result["data"]
    sides = d["sides"]
    rows = []
    for case in d["cases"]:
        runs = case["runs"]
        keys = ("loop_s", "wall_s", "peak_mib")
        med = {s: {k: statistics.median(r[k] for r in runs[s]) for k in keys} for s in sides}
        cells = [case["out"]]
        for k, fmt in (("loop_s", "{:.2f}"), ("wall_s", "{:.2f}"), ("peak_mib", "{:,.0f}")):
            cells += [fmt.format(med[s][k]) for s in sides]
            if len(sides) == 2:
                cells.append(f"{med[sides[0]][k] / med[sides[1]][k]:.2f}")
        if len(sides) == 2:
            for k in ("content", "bytes"):
                cells.append("yes" if len({r["sha256"][k] for s in sides for r in runs[s]}) == 1 else "no")
        rows.append(cells)
    heads = ["OUT"]
    for what in ("loop s", "run s", "peak RSS MiB"):
        heads += [f"{s} {what}" for s in sides] + ([f"{what} {sides[0]} / {sides[1]}"] if len(sides) == 2 else [])
    heads += ["same embeddings", "same bytes"] if len(sides) == 2 else []
    return (
        f"`encode --workers 0` of {d['n']:,} small JPEGs (128x96 to 320x240) through the host-bound tower, "
        f"medians of {len(d['cases'][0]['runs'][sides[0]])} runs a side, fresh processes alternating:\n\n"
        + common.markdown_table(heads, rows)
    )


WORKERS = {"encode": encode_worker, "checkpoint": hb_checkpoint}
