"""The service's throughput at saturation, the working tree vs a revision: servers of each started
in turn (`qwen-vit-jax serve` on 127.0.0.1, the demo's tiny tower, as bench_serve.py starts them),
each warmed up on 2 x 150 images, then 300 images by 32 clients in a closed loop; the median of
--rounds rounds per side.

    python benchmarks/ab_serve.py 3bfad40 --rounds 2           # bench_serve's compilation cache
    python benchmarks/ab_serve.py 3bfad40 --rounds 2 --cold    # a fresh cache for every server

With the shared cache a side whose batch shapes an earlier run compiled only loads them; --cold
is a server meeting the traffic for the first time.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import subprocess
import sys
import tempfile

from bench_serve import WORK, checkpoint_worker, env, images, request, st
from common import ROOT, log, machine_line, markdown_table, rev_env, worktree


def imported_from(tree, environ: dict) -> pathlib.Path:
    """The qwen_vit_jax a server started in `tree` with `environ` imports (checked: `python -c` puts
    its working directory first on sys.path, so one started from ours would import ours)."""
    code = "import qwen_vit_jax; print(qwen_vit_jax.__file__)"
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, env=environ, cwd=tree, capture_output=True, text=True, check=True)
    return pathlib.Path(out.stdout.strip()).resolve().parent.parent


def saturation(ckpt: str, tree, environ: dict, label: str) -> float:
    warm, sat = images("warmup", 300), images("saturation", 300)
    server = st.Server(ckpt, "--workers", 1, "--max-queue", 32, log=WORK / f"ab_{label}.log", env=environ, cwd=tree)
    with server:
        for k in range(2):
            asyncio.run(st.closed_loop(server.url, [request(b) for b in warm[k * 150 : (k + 1) * 150]], 32))
        m0 = st.metrics(server.url)
        results, wall = asyncio.run(st.closed_loop(server.url, [request(b) for b in sat], 32, timeout=120))
        m1 = st.metrics(server.url)
    if st.statuses(results) != {200: len(sat)}:
        raise RuntimeError(f"{label}: not every request answered: {st.statuses(results)}")
    calls, alone = (m1[k] - m0.get(k, 0.0) for k in ("qvj_batch_items_count", "qvj_batch_items_bucket{le=1.0}"))
    log(f"{label}: {calls:.0f} device calls in saturation, {alone:.0f} of one item")
    return len(sat) / wall


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rev", help="the revision to compare the working tree with")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cold", action="store_true", help="a fresh compilation cache for every server")
    args = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint_worker({"model": "tiny"})["path"]
    trees = {args.rev: worktree(args.rev), "working tree": ROOT}
    for label, tree in trees.items():  # once per tree: the environment only differs by the cache folder
        if (found := imported_from(tree, rev_env(tree, env()))) != pathlib.Path(tree).resolve():
            raise RuntimeError(f"{label}: a server would import {found}, not {tree}")
    rates: dict[str, list[float]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for label, tree in trees.items():
            environ = rev_env(tree, env())
            if args.cold:
                environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="qvj-ab-cache-", dir=WORK)
            rates[label].append(saturation(ckpt, tree, environ, label.replace(" ", "_")))
            log(f"round {r + 1}, {label}: {rates[label][-1]:.2f} images/s")
    med = {k: statistics.median(v) for k, v in rates.items()}
    rows = [
        [k, " / ".join(f"{x:.2f}" for x in rates[k]), f"{med[k]:.2f}", f"{med[k] / med[args.rev]:.2f}x"] for k in trees
    ]
    cmd = "python benchmarks/ab_serve.py " + " ".join(sys.argv[1:])
    print(
        f"\n{machine_line()}\n`{cmd}`\n\n"
        + markdown_table(["side", "images/s per round", "median", "vs " + args.rev], rows)
    )


if __name__ == "__main__":
    main()
