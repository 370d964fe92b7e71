"""A cold server vs a warm one: images/s of 1 and of 16 clients, time to ready, and RSS.

    python -m benchmarks serve_cold --against 09cf317          # the demo's tiny tower, and a revision's
    python -m benchmarks serve_cold --model 3b --n 8 --clients 1,4 --max-queue 4 --declare 16x16
                                                               # the real 3B tower: results/serve_cold-3b.json

Every server is `qwen-vit-jax serve CKPT --workers 1 --max-queue 32` (--max-queue) on 127.0.0.1 (as
the serve suite starts it), each on a fresh JAX compilation cache unless it is a restart, meeting
the serve suite's JPEGs (5 sizes, 64..384 patches) for the first time: --n images, one per request,
by C clients in a closed loop (C from --clients). Scenarios, each a fresh server per C:

  REV cold            --against's server (e.g. 09cf317, before the batching rework), cold
  cold                ours, cold, --no-warmup-batches: batch shapes compile as traffic meets them
  cold, warm-up       ours, cold, --declare the 5 sizes --warmup-batches: the batch shapes they
                      form compile before /readyz (time to ready: the warm-up)
  restart             ours again on the compilation cache the warm-up filled: ready in seconds

Reported per scenario and C: seconds to ready, images/s (answered images over the loop's wall time;
the answers' statuses beside: a cold server may meet its --timeout), device calls and calls of one
item (from /metrics), programs compiled or loaded during the loop, and the server's RSS (its process
and workers) peak during the loop and at its end. The scenarios alternate within each round
(--rounds): the box is shared, so compare within a round. --quick: 4 images, 1 client, the cold
scenario alone, one image size.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time

from benchmarks import common
from benchmarks.common import log, markdown_table
from benchmarks.workloads import traffic as st

SIZES = "8x8,12x16,16x16,20x14,16x24"  # grids.SERVE_SIDES in patches: what --declare names
DEFAULTS = {"rounds": (1, 1)}
AGAINST = "a revision's cold server beside ours (e.g. 09cf317, before the batching rework)"


def add_args(p) -> None:
    p.add_argument("--model", choices=("tiny", "3b"), default="tiny")
    p.add_argument("--n", type=int, help="images per loop (default 300; --quick 4)")
    p.add_argument("--clients", help="client counts (default 1,16; --quick 1)")
    p.add_argument("--max-queue", type=int, default=32, help="the servers' --max-queue (default 32)")
    p.add_argument("--declare", help=f"the sizes the warm-up servers declare (default {SIZES}; --quick 8x8)")


def one(ckpt: str, tree, environ: dict, flags: list, clients: int, blobs: list[bytes], label: str) -> dict:
    """One server: ready time, then every blob once by `clients` clients; its measures."""
    t0 = time.monotonic()
    server = st.Server(ckpt, "--workers", 1, *flags, log=st.bench_dir() / f"cold_{label}.log", env=environ,
                       cwd=tree, ready_timeout=7200)  # fmt: skip
    with server:
        ready = time.monotonic() - t0
        m0 = st.metrics(server.url)
        with st.RssSampler(server) as rss:
            results, wall = asyncio.run(
                st.closed_loop(server.url, [st.request(b) for b in blobs], clients, timeout=600)
            )
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


def run(args) -> dict:
    if args.model == "3b":
        args.label = args.label or "3b"
    n, declare = args.n or (4 if args.quick else 300), args.declare or ("8x8" if args.quick else SIZES)
    clients = [int(c) for c in (args.clients or ("1" if args.quick else "1,16")).split(",")]
    st.bench_dir().mkdir(parents=True, exist_ok=True)
    ckpt = common.run_worker("common", "demo", {"model": args.model})["path"]
    trees = {"ours": common.ROOT}
    rev = common.rev_info(args.against) if args.against else None
    if rev:
        trees["rev"] = common.worktree(rev["hash"])
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        blobs = st.phase_images("saturation", n, 1 if args.quick else 5)  # every server meets them for the first time
        for c in clients:
            fresh = {k: tempfile.mkdtemp(prefix="qvj-cold-", dir=st.bench_dir()) for k in ("rev", "cold", "warm")}
            plan = [("cold", "ours", fresh["cold"], ["--no-warmup-batches"])]
            warm = ["--declare", declare, "--warmup-batches"]
            plan += [("cold, warm-up", "ours", fresh["warm"], warm), ("restart", "ours", fresh["warm"], warm)]
            if rev:
                plan.insert(0, (f"{rev['hash'][:7]} cold", "rev", fresh["rev"], []))
            for label, side, cache, flags in plan[:1] if args.quick else plan:
                environ = dict(st.server_env(trees[side]), JAX_COMPILATION_CACHE_DIR=cache)
                name = f"{label.replace(' ', '').replace(',', '_')}_{c}"
                flags = ["--max-queue", args.max_queue, *flags]
                result = one(ckpt, trees[side], environ, flags, c, blobs, name)
                runs.setdefault(f"{label} / {c}", []).append(result | {"server": label, "clients": c})
            log(f"round {r + 1}, {c} clients done")
    rows = [summary(rs) for rs in runs.values()]
    return {"model": args.model, "n": n, "declare": declare, "against": rev, "rows": rows, "runs": runs}


def summary(rs: list[dict]) -> dict:
    """A scenario's rounds as the page shows them: the median time to ready, images/s per round, and
    the range (lowest, highest) of the rest."""

    def span(k):
        return [min(x[k] for x in rs), max(x[k] for x in rs)]

    out = {
        "server": rs[0]["server"],
        "clients": rs[0]["clients"],
        "ready_s": statistics.median(x["ready_s"] for x in rs),
    }
    out |= {k: span(k) for k in ("calls", "alone", "programs_at_ready", "programs", "rss_peak_mb", "rss_end_mb")}
    return out | {"images_per_s": [x["images_per_s"] for x in rs], "statuses": [x["statuses"] for x in rs]}


def report(result: dict) -> str:
    d, rows = result["data"], []

    def span(lo_hi, unit=""):
        lo, hi = (f"{x:.0f}" for x in lo_hi)
        return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"

    for r in d["rows"]:
        per = " / ".join(f"{x:.2f}" for x in r["images_per_s"])
        codes = sorted({k for s in r["statuses"] for k in s})
        counts = {k: [min(s.get(k, 0) for s in r["statuses"]), max(s.get(k, 0) for s in r["statuses"])] for k in codes}
        statuses = ", ".join(f"{k}: {span(v)}" for k, v in counts.items()) or "-"
        rows.append(
            [
                r["server"],
                r["clients"],
                f"{r['ready_s']:.1f}",
                f"**{statistics.median(r['images_per_s']):.2f}** ({per})",
            ]
            + [f"{span(r['calls'])} ({span(r['alone'])})", f"{span(r['programs_at_ready'])} + {span(r['programs'])}"]
            + [span(r["rss_peak_mb"], " MB"), statuses]
        )
    headers = ["server", "clients", "ready s", "images/s (per round)", "device calls (of one item)"]
    headers += ["programs at ready + in loop", "RSS peak", "statuses"]
    return (
        f"The demo's {d['model']} tower, {d['n']} of the serve suite's JPEGs met for the first time, one per request, "
        f"each server on a fresh compilation cache but the restart; warm-up servers declare {d['declare']}; medians "
        "of the rounds, ranges where they differ:\n\n" + markdown_table(headers, rows)
    )


WORKERS: dict = {}
