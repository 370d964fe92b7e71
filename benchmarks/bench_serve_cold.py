"""A cold server vs a warm one: images/s of 1 and of 16 clients, time to ready, and RSS.

    python benchmarks/bench_serve_cold.py                       # the demo's tiny tower, vs 09cf317
    python benchmarks/bench_serve_cold.py --model 3b --n 8 --clients 1,4 --max-queue 4 \\
        --declare 16x16 --rev ''                                # the real 3B tower, ours only

Every server is `qwen-vit-jax serve CKPT --workers 1 --max-queue 32` (--max-queue) on 127.0.0.1 (as
bench_serve.py starts it), each on a fresh JAX compilation cache unless it is a restart, meeting
bench_serve's JPEGs (5 sizes, 64..384 patches) for the first time: --n images, one per request,
by C clients in a closed loop (C from --clients). Scenarios, each a fresh server per C:

  rev cold            --rev's server (the revision before the batching rework), cold
  cold                ours, cold, --no-warmup-batches: batch shapes compile as traffic meets them
  cold, warm-up       ours, cold, --declare the 5 sizes --warmup-batches: the batch shapes they
                      form compile before /readyz (time to ready: the warm-up)
  restart             ours again on the compilation cache the warm-up filled: ready in seconds

Reported per scenario and C: seconds to ready, images/s (answered images over the loop's wall time;
the answers' statuses beside: a cold server may meet its --timeout), device calls and calls of one
item (from /metrics), programs compiled or loaded during the loop, and the server's RSS (its process
and workers) peak during the loop and at its end. The scenarios alternate within each round
(--rounds): the box is shared, so compare within a round.
Prints a markdown table and writes benchmarks/results/serve-cold[-3b].json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time

from bench_serve import WORK, RssSampler, checkpoint_worker, env, images, request, st
from common import ROOT, default_out, log, machine_line, markdown_table, rev_env, worktree, write_json

SIZES = "8x8,12x16,16x16,20x14,16x24"  # bench_serve's SIDES in patches: what --declare names


def one(ckpt: str, tree, environ: dict, flags: list, clients: int, blobs: list[bytes], label: str) -> dict:
    """One server: ready time, then every blob once by `clients` clients; its measures."""
    t0 = time.monotonic()
    server = st.Server(ckpt, "--workers", 1, *flags, log=WORK / f"cold_{label}.log", env=environ,
                       cwd=tree, ready_timeout=7200)  # fmt: skip
    with server:
        ready = time.monotonic() - t0
        m0 = st.metrics(server.url)
        with RssSampler(server) as rss:
            results, wall = asyncio.run(st.closed_loop(server.url, [request(b) for b in blobs], clients, timeout=600))
        m1 = st.metrics(server.url)
        end = server.rss_mb()
    ok = sum(r.items for r in results if r.status == 200)  # images/s counts these; the rest are reported

    def delta(k):
        return m1.get(k, 0.0) - m0.get(k, 0.0)

    out = {
        "ready_s": ready,
        "images_per_s": ok / wall,
        "statuses": {str(k): v for k, v in st.statuses(results).items()},  # a cold 3B server meets its timeout
        "calls": delta("qvj_batch_items_count"),
        "alone": delta("qvj_batch_items_bucket{le=1.0}"),
        "programs": delta("qvj_programs"),
        "programs_at_ready": m0.get("qvj_programs", 0.0),
        "rss_peak_mb": max((mb for _, mb, _ in rss.samples), default=end),
        "rss_end_mb": end,
    }
    log(f"{label}, {clients} clients: ready {ready:.1f} s, {out['images_per_s']:.2f} images/s, "
        f"{out['calls']:.0f} calls ({out['alone']:.0f} of one item), {out['programs']:.0f} programs, "
        f"RSS peak {out['rss_peak_mb']:.0f} MB, statuses {out['statuses']}")  # fmt: skip
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "3b"), default="tiny")
    p.add_argument("--rev", default="09cf317", help="the revision's cold server beside ours ('' to skip)")
    p.add_argument("--n", type=int, default=300, help="images per loop (default 300)")
    p.add_argument("--clients", default="1,16", help="client counts (default 1,16)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-queue", type=int, default=32, help="the servers' --max-queue (default 32)")
    p.add_argument("--declare", default=SIZES, help=f"the sizes the warm-up servers declare (default {SIZES})")
    p.add_argument("--out")
    args = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint_worker({"model": args.model})["path"]
    clients = [int(c) for c in args.clients.split(",")]
    ours = rev_env(ROOT, env())
    trees = {"ours": (ROOT, ours)}
    if args.rev:
        tree = worktree(args.rev)
        trees["rev"] = (tree, rev_env(tree, env()))
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        blobs = images("saturation", args.n)  # every server meets the same images for the first time
        for c in clients:
            fresh = {k: tempfile.mkdtemp(prefix="qvj-cold-", dir=WORK) for k in ("rev", "cold", "warm")}
            plan = [("cold", "ours", fresh["cold"], ["--no-warmup-batches"])]
            warm = ["--declare", args.declare, "--warmup-batches"]
            plan += [("cold, warm-up", "ours", fresh["warm"], warm), ("restart", "ours", fresh["warm"], warm)]
            if args.rev:
                plan.insert(0, (f"{args.rev} cold", "rev", fresh["rev"], []))
            for label, side, cache, flags in plan:
                tree, base = trees[side]
                environ = dict(base, JAX_COMPILATION_CACHE_DIR=cache)
                name = f"{label.replace(' ', '').replace(',', '_')}_{c}"
                flags = ["--max-queue", args.max_queue, *flags]
                runs.setdefault((label, c), []).append(one(ckpt, tree, environ, flags, c, blobs, name))
            log(f"round {r + 1}, {c} clients done")
    rows = []
    for (label, c), rs in runs.items():

        def med(k, rs=rs):
            return statistics.median(x[k] for x in rs)

        rows.append([
            label, c, f"{med('ready_s'):.1f}", " / ".join(f"{x['images_per_s']:.2f}" for x in rs),
            f"{med('calls'):.0f} ({med('alone'):.0f})", f"{med('programs_at_ready'):.0f} + {med('programs'):.0f}",
            f"{med('rss_peak_mb'):.0f} / {med('rss_end_mb'):.0f}",
            " / ".join(",".join(f"{k}: {v}" for k, v in x["statuses"].items()) for x in rs),
        ])  # fmt: skip
    cmd = "python benchmarks/bench_serve_cold.py " + " ".join(sys.argv[1:])
    headers = ["server", "clients", "ready s", "images/s", "calls (of one item)", "programs at ready + in loop",
               "RSS peak / end MB", "statuses"]  # fmt: skip
    print(f"\n{machine_line()}\n`{cmd}`\n\n" + markdown_table(headers, rows))
    out = args.out or default_out("serve-cold" + ("-3b" if args.model == "3b" else ""), False)
    write_json(out, {"command": cmd, "runs": {f"{k[0]} / {k[1]}": v for k, v in runs.items()}})


if __name__ == "__main__":
    main()
