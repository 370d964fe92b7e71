"""`qwen-vit-jax serve` under load, faults and bad input: the real server (a uvicorn subprocess on
127.0.0.1) driven by concurrent asyncio + httpx clients on JPEGs of mixed sizes.

    python -m benchmarks serve                      # the demo's tiny tower
    python -m benchmarks serve --model 3b           # the real 3B tower (random weights): results/serve-3b.json
    python -m benchmarks serve --against REV [--cold]   # saturation only, the working tree vs REV's server
    python -m benchmarks serve --quick              # 8 requests a phase of one size, 1 s phases: does it run?

Inputs: one JPEG per request, answered in base64 as qvj.serve.Client asks (`request`); JPEGs
(quality 90, a gradient plus noise, each its own seed) whose sizes cycle through workloads/grids.py's
SERVE_SIDES (px, multiples of 28: 5 grids of 64..192 patches), every phase on images of its own, so no phase
hits the cache unless it means to. Server: `qwen-vit-jax serve CKPT --workers W --max-queue Q` (the
other flags their defaults), with JAX's persistent compilation cache shared with the offline runs
(and kept between runs of this script), warmed up before anything is timed: --warmup-rounds rounds
of the saturation phase's traffic on images of their own (a batch of another composition lands in
another bucket: each new one compiles, or loads from the cache, once). Phases, in order:

  saturation  every one of --n images once, one image per request, --concurrency clients in a closed
              loop: images/s = answered images / the loop's wall time; vs offline: `qwen-vit-jax
              encode CKPT DIR -o OUT.safetensors --workers W` on the same images as files, run on the
              first third and on all of them: the extra images over the extra encode seconds (the
              summary lines', compile seconds taken out), i.e. past start-up; batch fill (patches /
              budget) and items per device call from /metrics over this phase
  latency     requests at Poisson arrivals of 50% of the saturation rate (open loop) for --seconds:
              p50 / p99 seconds from send to answer
  cache       --n requests, half of them images the saturation phase sent (the LRU holds them),
              closed loop: the share answered `cached`, from the responses and from /metrics
  overload    Poisson arrivals at 2x the larger of the saturation and offline rates (the saturation
              phase can pay compiles later batches do not), for --seconds or long enough for the
              backlog to pass --max-queue twice over: the share of 429s; every other
              request answered (200; none unanswered: no connection error, no client timeout); the
              server's RSS (its process and workers) every 0.25 s: before, peak, last, and the growth
              over the second half of the phase, and how much of it the in-memory LRU's growth is
  fuzz        --fuzz malformed bodies (workloads/traffic.py's `malformed`: 18 kinds, from not-JSON to
              a bomb's PNG header and paths / URLs the server must not open), 8 at a time: statuses
              (all must be 4xx), then GET /healthz
  kill        --concurrency clients in a closed loop; 1 s in, kill -9 of a preparation worker: every
              request answered (200 or 503), recovery = from the kill to the first 200 of a request
              sent after it, and the workers-replaced counter
  SIGTERM     the server's exit code and seconds to exit after SIGTERM (idle)

--against REV: the service's throughput at saturation, the working tree vs REV: servers of each
started in turn (REV's from its own worktree, checked to import REV's package), each warmed up on
2 x 150 images, then 300 images by 32 clients; --rounds rounds, medians. With the shared compilation
cache a side whose batch shapes an earlier run compiled only loads them; --cold gives every server a
fresh cache (a server meeting the traffic for the first time).
"""

from __future__ import annotations

import asyncio
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import common
from benchmarks.common import log, markdown_table
from benchmarks.workloads import traffic as st

DEFAULTS = {"rounds": (2, 1)}
AGAINST = "saturation only: the working tree's server vs this revision's, alternating (--rounds)"
SUMMARY = re.compile(r"encoded ([\d,]+) inputs? \(.*?\) in ([\d.]+) s \(([\d.e+-]+) inputs/s")
COMPILED = re.compile(r"program\(s\) compiled in ([\d.]+) s")
# seeds of each phase's images: disjoint ranges
TIMEOUT, request, images, RssSampler = st.TIMEOUT, st.request, st.phase_images, st.RssSampler


def work() -> pathlib.Path:
    return st.bench_dir()


def demo_checkpoint(model: str) -> str:
    """The demo's random checkpoint of `model` ("tiny" or "3b"), built once in the bench cache."""
    return common.run_worker("common", "demo", {"model": model})["path"]


def offline(ckpt: str, blobs: list[bytes], dtype: str, workers: int, quick: bool = False) -> dict:
    """`qwen-vit-jax encode` on the same images as files, on the first third and on all of them (fresh
    processes): images/s past start-up = the extra images over the extra encode seconds, compile
    seconds taken out of both (the summary line's); and the whole run's own inputs/s (quick: one run)."""
    folder = work() / "offline_inputs"
    runs = []
    for k in (len(blobs),) if quick else (len(blobs) // 3, len(blobs)):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for i, b in enumerate(blobs[:k]):
            (folder / f"{i:06d}.jpg").write_bytes(b)
        cmd = [sys.executable, "-c", st.CLI, "encode", ckpt, str(folder), "-o", str(work() / "offline.safetensors")]
        cmd += ["--overwrite", "--workers", str(workers), "--dtype", dtype]
        p = subprocess.run(
            cmd, env=st.server_env(), capture_output=True, text=True, cwd=common.ROOT, check=False, timeout=3600
        )
        m, c = SUMMARY.search(p.stdout), COMPILED.search(p.stdout)
        if p.returncode or not m or not c:
            raise RuntimeError(f"offline encode failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-2000:]}")
        runs.append(
            {"inputs": int(m.group(1).replace(",", "")), "seconds": float(m.group(2)), "compile_s": float(c.group(1))}
        )
    a, b = ({"inputs": 0, "seconds": 0.0, "compile_s": 0.0} if quick else runs[0]), runs[-1]
    extra = (b["seconds"] - b["compile_s"]) - (a["seconds"] - a["compile_s"])
    # past start-up: the extra images over the extra seconds (too few images to tell: the whole run's rate)
    steady = (b["inputs"] - a["inputs"]) / extra if extra > 0.5 else b["inputs"] / b["seconds"]
    return {"images_per_s": steady, "whole_run_images_per_s": b["inputs"] / b["seconds"], "runs": runs}


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def batch_stats(after: dict, before: dict) -> dict:
    calls = delta(after, before, "qvj_batch_fill_count")
    return {
        "device_calls": calls,
        "batch_fill": delta(after, before, "qvj_batch_fill_sum") / max(calls, 1),
        "items_per_call": delta(after, before, "qvj_batch_items_sum") / max(calls, 1),
        "padding": delta(after, before, "qvj_batch_padding_sum") / max(calls, 1),
    }


def cache_stats(after: dict, before: dict) -> dict:
    keys = {k for k in after if k.startswith("qvj_cache_total{")}
    counts = {k[len("qvj_cache_total{result=") : -1]: delta(after, before, k) for k in keys}
    total = sum(counts.values())
    hits = total - counts.get("miss", 0.0)
    return {"lookups": counts, "hit_rate": hits / total if total else float("nan")}


def answered(results) -> dict:
    s = st.statuses(results)
    errors = sorted({r.error for r in results if r.status == st.UNANSWERED})
    return {
        "statuses": {str(k): v for k, v in s.items()},
        "unanswered": s.get(st.UNANSWERED, 0),
        "errors": errors,
        "n": len(results),
    }


async def kill_phase(server: st.Server, bodies: list[bytes], concurrency: int, after: float = 1.0) -> dict:
    """Closed-loop load; a worker killed `after` s in. Every request answered; recovery time."""
    killed = {}

    async def killer():
        await asyncio.sleep(after)
        killed["pid"] = st.kill_worker(server)
        killed["at"] = time.monotonic()

    (results, wall), _ = await asyncio.gather(
        st.closed_loop(server.url, bodies, concurrency, timeout=TIMEOUT), killer()
    )
    after = [r for r in results if r.sent >= killed["at"] and r.status == 200]
    first_ok = min((r.sent + r.seconds for r in after), default=float("nan"))
    return {
        **answered(results),
        "seconds": wall,
        "killed_pid": killed["pid"],
        "recovery_s": first_ok - killed["at"],
        "workers_after": len(server.worker_pids()),
    }


def add_args(p) -> None:
    p.add_argument("--model", choices=("tiny", "3b"), default="tiny", help="the demo's tiny tower or the real 3B")
    p.add_argument("--n", type=int, help="images per phase (default 600; --quick 8; 3b: 24)")
    p.add_argument("--concurrency", type=int, help="clients of the closed loops (default 32; --quick 4; 3b: 8)")
    p.add_argument("--seconds", type=float, help="latency and overload phase length (default 20; --quick 1)")
    p.add_argument("--fuzz", type=int, help="malformed bodies (default 2000; --quick 18)")
    p.add_argument("--warmup", type=int, help="warm-up requests per round (default: --n; 3b: 8)")
    p.add_argument("--warmup-rounds", type=int, help="warm-up rounds (default 2; --quick 1)")
    p.add_argument("--workers", type=int, default=1, help="preparation workers of the server and `encode` (default 1)")
    p.add_argument("--max-queue", type=int, help="the server's --max-queue (default 32; --quick 4)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cold", action="store_true", help="with --against: a fresh compilation cache for every server")


def run(args) -> dict:
    if args.against:
        return against(args)
    big = args.model == "3b"
    if big:
        args.label = args.label or "3b"
    args.n = args.n or (8 if args.quick else 24 if big else 600)
    args.concurrency = args.concurrency or (4 if args.quick else 8 if big else 32)
    args.seconds = args.seconds or (1.0 if args.quick else 20.0)
    args.fuzz = args.fuzz or (18 if args.quick else 2000)
    args.warmup = args.warmup or (8 if big else args.n)
    args.warmup_rounds = args.warmup_rounds or (1 if args.quick else 2)
    args.max_queue = args.max_queue or (4 if args.quick else 32)
    work().mkdir(parents=True, exist_ok=True)
    ckpt = demo_checkpoint(args.model)
    n, c = args.n, args.concurrency
    sizes = 1 if args.quick else 5  # quick: one image size, the fewest programs to compile
    log(f"images: {args.warmup_rounds} x {args.warmup} warm-up, {n} x 3 phases, kill {n}")
    warm, sat = images("warmup", args.warmup * args.warmup_rounds, sizes), images("saturation", n, sizes)
    cache_new, kill = images("cache", n // 2, sizes), images("kill", n, sizes)
    log("offline encode (twice) ...")
    off = offline(ckpt, sat, args.dtype, 0 if args.quick else args.workers, args.quick)
    log(f"offline: {off['images_per_s']:.2f} images/s")
    out: dict = {"mode": "phases", "model": args.model, "dtype": args.dtype, "workers": args.workers, "concurrency": c}
    out["sizes"] = sizes
    out["offline"] = off
    flags = ["--dtype", args.dtype, "--workers", args.workers, "--max-queue", args.max_queue]
    log_path = work() / "server.log"
    log_path.unlink(missing_ok=True)
    with st.Server(ckpt, *flags, log=log_path, env=st.server_env(), ready_timeout=1800) as server:
        log(f"server ready on {server.url} (pid {server.pid})")
        out["warmup"] = []
        for k in range(args.warmup_rounds):  # the batches' programs: compiled, or loaded from the cache
            part = warm[k * args.warmup : (k + 1) * args.warmup]
            results, wall = asyncio.run(st.closed_loop(server.url, [request(b) for b in part], c, timeout=TIMEOUT))
            out["warmup"].append({**answered(results), "seconds": wall, "images_per_s": len(part) / wall})
            log(f"warm-up round {k + 1}: {len(part) / wall:.2f} images/s")

        m0 = st.metrics(server.url)
        results, wall = asyncio.run(st.closed_loop(server.url, [request(b) for b in sat], c, timeout=TIMEOUT))
        m1 = st.metrics(server.url)
        ok = sum(r.items for r in results if r.status == 200)
        rate = ok / wall
        out["saturation"] = {
            **answered(results),
            "seconds": wall,
            "images_per_s": rate,
            "programs_compiled": int(delta(m1, m0, "qvj_programs")),  # or loaded from the persistent cache
            "compile_s": delta(m1, m0, "qvj_compile_seconds"),
            "device_s": delta(m1, m0, "qvj_stage_seconds_sum{stage=device}"),
            **batch_stats(m1, m0),
        }
        out["saturation"]["vs_offline"] = rate / off["images_per_s"]
        log(f"saturation: {rate:.2f} images/s ({out['saturation']['vs_offline']:.2f}x offline)")

        k = max(int(0.5 * rate * args.seconds), 10)
        lat_bodies = [request(b) for b in images("latency", k, sizes)]
        results, wall = asyncio.run(st.open_loop(server.url, lat_bodies, 0.5 * rate, seed=1, timeout=TIMEOUT))
        ok_s = [r.seconds for r in results if r.status == 200]
        out["latency"] = {
            **answered(results),
            "rate": 0.5 * rate,
            "seconds": wall,
            "p50": st.percentile(ok_s, 50),
            "p99": st.percentile(ok_s, 99),
        }
        log(f"latency at 50%: p50 {out['latency']['p50']:.3f} s, p99 {out['latency']['p99']:.3f} s")

        m0 = st.metrics(server.url)
        replay = [b for pair in zip(sat[: n // 2], cache_new) for b in pair]  # seen, new, seen, new, ...
        results, wall = asyncio.run(st.closed_loop(server.url, [request(b) for b in replay], c, timeout=TIMEOUT))
        m1 = st.metrics(server.url)
        items = sum(r.items for r in results)
        out["cache"] = {
            **answered(results),
            "seconds": wall,
            "images_per_s": items / wall,
            "cached_share": sum(r.cached for r in results) / max(items, 1),
            **cache_stats(m1, m0),
        }
        log(f"cache: {out['cache']['cached_share']:.0%} answered from the cache")

        # 2x the larger of the saturation rate and offline's (the saturation phase may have paid
        # compiles that later batches do not), long enough for the backlog to pass --max-queue twice
        capacity = max(rate, off["images_per_s"])
        k = max(int(2 * capacity * max(args.seconds, 2 * args.max_queue / capacity)), 20)
        k = min(k, 64) if args.quick else k
        over_bodies = [request(b) for b in images("overload", k, sizes)]
        base = server.rss_mb()
        with RssSampler(server) as rss:
            results, wall = asyncio.run(
                st.open_loop(server.url, over_bodies, 2 * capacity, seed=2, timeout=TIMEOUT, max_in_flight=2048)
            )
        mem, lru = [mb for _, mb, _ in rss.samples], [mb for _, _, mb in rss.samples]
        h = len(mem) // 2 if len(mem) > 1 else 0
        s = st.statuses(results)
        out["overload"] = {
            **answered(results),
            "rate": 2 * capacity,
            "seconds": wall,
            "share_429": s.get(429, 0) / len(results),
            "accepted_not_200": sum(v for k_, v in s.items() if k_ not in (200, 429)),
            "rss_mb": {
                "before": base,
                "peak": max(mem),
                "last": mem[-1],
                "second_half_growth": mem[-1] - mem[h],
                "second_half_lru_growth": lru[-1] - lru[h],
            },
            "rss_samples": rss.samples,
        }
        log(f"overload: {out['overload']['share_429']:.0%} 429s, statuses {s}")

        cases = st.malformed(args.fuzz, seed=0, good=warm[0])
        t0 = time.monotonic()
        fz = asyncio.run(st.fuzz(server.url, cases))
        fs = st.statuses([r for _, r in fz])
        out["fuzz"] = {
            "n": len(fz),
            "seconds": time.monotonic() - t0,
            "statuses": {str(k_): v for k_, v in fs.items()},
            "not_4xx": sorted({w for w, r in fz if not 400 <= r.status < 500}),
            "alive": server.alive(),
        }
        log(f"fuzz: {fs}, alive {out['fuzz']['alive']}")

        m0 = st.metrics(server.url)
        out["kill"] = asyncio.run(kill_phase(server, [request(b) for b in kill], c, 0.1 if args.quick else 1.0))
        m1 = st.metrics(server.url)
        out["kill"]["replaced"] = delta(m1, m0, "qvj_workers_replaced_total")
        log(f"kill: {out['kill']['statuses']}, recovery {out['kill']['recovery_s']:.2f} s")

        t0 = time.monotonic()
        code = server.stop()
        out["sigterm"] = {"exit_code": code, "seconds": time.monotonic() - t0}
    return out


def report(result: dict) -> str:
    r = result["data"]
    if r["mode"] == "against":
        return report_against(r)
    s, lat, ca, ov, fz, k = (r[x] for x in ("saturation", "latency", "cache", "overload", "fuzz", "kill"))
    mem, off = ov["rss_mb"], r["offline"]
    rows = [
        [
            "throughput at saturation",
            f"{s['images_per_s']:.2f} images/s",
            f"{r['concurrency']} clients, {s['n']} images, statuses {s['statuses']}",
        ],
        [
            "offline `encode`, same images",
            f"{off['images_per_s']:.2f} images/s",
            f"past start-up; whole run {off['whole_run_images_per_s']:.2f} images/s, --workers {r['workers']}",
        ],
        ["served / offline", f"{s['vs_offline']:.2f}x", "goal >= 0.9x"],
        [
            "warm-up rounds (same traffic, other images)",
            " / ".join(f"{w['images_per_s']:.2f}" for w in r["warmup"]) + " images/s",
            "new batch compositions compile (or load from the cache) in the first",
        ],
        [
            "batch fill, items per device call",
            f"{s['batch_fill']:.2f}, {s['items_per_call']:.1f}",
            f"{s['device_calls']:.0f} calls in {s['device_s']:.0f} s, padding {s['padding']:.2f}, "
            f"{s['programs_compiled']} programs compiled or loaded ({s['compile_s']:.1f} s)",
        ],
        [
            "latency at 50% load, p50 / p99",
            f"{lat['p50'] * 1e3:.0f} / {lat['p99'] * 1e3:.0f} ms",
            f"{lat['rate']:.1f} requests/s Poisson, {lat['n']} requests, statuses {lat['statuses']}",
        ],
        [
            "cache hit rate, half the images seen",
            f"{ca['cached_share']:.0%} (metrics {ca['hit_rate']:.0%})",
            f"{ca['images_per_s']:.2f} images/s",
        ],
        [
            "2x overload: 429s",
            f"{ov['share_429']:.0%}",
            f"{ov['n'] / ov['seconds']:.1f} requests/s sent (asked {ov['rate']:.1f}) for {ov['seconds']:.0f} s, "
            f"statuses {ov['statuses']}",
        ],
        ["2x overload: unanswered", f"{ov['unanswered']}", "no connection error, no client timeout"],
        [
            "2x overload: server RSS",
            f"{mem['before']:.0f} -> peak {mem['peak']:.0f}, last {mem['last']:.0f} MB",
            f"second half {mem['second_half_growth']:+.0f} MB, of which the LRU "
            f"{mem.get('second_half_lru_growth', float('nan')):+.0f} MB (bounded by --cache-mb)",
        ],
        [
            "fuzz: malformed bodies",
            f"{fz['n']}: {fz['statuses']}",
            f"{fz['seconds']:.1f} s; not 4xx: {fz['not_4xx'] or 'none'}; alive after: {fz['alive']}",
        ],
        [
            "kill -9 of a worker mid-load",
            f"recovery {k['recovery_s']:.2f} s",
            f"statuses {k['statuses']}, unanswered {k['unanswered']} {k['errors'] or ''}, replaced {k['replaced']:.0f}",
        ],
        ["SIGTERM (idle)", f"exit {r['sigterm']['exit_code']}", f"{r['sigterm']['seconds']:.1f} s"],
    ]
    return (
        f"`qwen-vit-jax serve --workers {r['workers']}` on 127.0.0.1, the demo's {r['model']} tower, {r['dtype']}, "
        f"{r['concurrency']} asyncio + httpx clients in the same box, one JPEG per request in {r.get('sizes', 5)} "
        "sizes (64-192 patches), base64 answers, warmed up on other images:\n\n"
        + markdown_table(["measure", "value", "notes"], rows)
    )


def imported_from(tree, environ: dict) -> pathlib.Path:
    """The qwen_vit_jax a server started in `tree` with `environ` imports (checked: `python -c` puts
    its working directory first on sys.path, so one started from ours would import ours)."""
    code = "import qwen_vit_jax; print(qwen_vit_jax.__file__)"
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, env=environ, cwd=tree, capture_output=True, text=True, check=True)
    return pathlib.Path(out.stdout.strip()).resolve().parent.parent


def saturation(ckpt: str, tree, environ: dict, label: str, n: int) -> dict:
    """Warm-up (2 x n / 2 images), then n images by 32 clients: images/s, device calls, calls of one item."""
    warm, sat = images("warmup", n), images("saturation", n)
    server = st.Server(ckpt, "--workers", 1, "--max-queue", 32, log=work() / f"ab_{label}.log", env=environ, cwd=tree)
    with server:
        for k in range(2):
            asyncio.run(st.closed_loop(server.url, [request(b) for b in warm[k * n // 2 : (k + 1) * n // 2]], 32))
        m0 = st.metrics(server.url)
        results, wall = asyncio.run(st.closed_loop(server.url, [request(b) for b in sat], 32, timeout=TIMEOUT))
        m1 = st.metrics(server.url)
    if st.statuses(results) != {200: len(sat)}:
        raise RuntimeError(f"{label}: not every request answered: {st.statuses(results)}")
    calls, alone = (m1[k] - m0.get(k, 0.0) for k in ("qvj_batch_items_count", "qvj_batch_items_bucket{le=1.0}"))
    log(f"{label}: {len(sat) / wall:.2f} images/s, {calls:.0f} device calls, {alone:.0f} of one item")
    return {"images_per_s": len(sat) / wall, "device_calls": calls, "calls_of_one": alone}


def against(args) -> dict:
    """--against REV: saturation throughput, the working tree's server vs REV's, alternating."""
    work().mkdir(parents=True, exist_ok=True)
    rev = common.rev_info(args.against)
    args.label = args.label or f"against-{rev['hash'][:7]}"
    ckpt = demo_checkpoint("tiny")
    trees = {"REV": common.worktree(rev["hash"]), "tree": common.ROOT}
    for label, tree in trees.items():  # once per tree: the environment only differs by the cache folder
        if (found := imported_from(tree, st.server_env(tree))) != pathlib.Path(tree).resolve():
            raise RuntimeError(f"{label}: a server would import {found}, not {tree}")
    n = 16 if args.quick else 300

    def one(label: str, tree) -> dict:
        environ = st.server_env(tree)
        if args.cold:
            environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="qvj-ab-cache-", dir=work())
        return saturation(ckpt, tree, environ, label, n)

    runs = common.alternate(args.rounds, trees, one)
    return {"mode": "against", "against": rev, "cold": args.cold, "n": n, "rounds": args.rounds, "runs": runs}


def report_against(d: dict) -> str:
    rev = d["against"]["hash"][:7]
    med = {k: statistics.median(r["images_per_s"] for r in rs) for k, rs in d["runs"].items()}
    rows = [
        [rev if k == "REV" else "working tree", " / ".join(f"{r['images_per_s']:.2f}" for r in rs), f"{med[k]:.2f}"]
        + [
            f"**{med[k] / med['REV']:.2f}x**",
            " / ".join(f"{r['device_calls']:.0f} ({r['calls_of_one']:.0f})" for r in rs),
        ]
        for k, rs in d["runs"].items()
    ]
    cache = "a fresh compilation cache per server" if d["cold"] else "the shared compilation cache"
    return (
        f"Saturation, {d['n']} images by 32 clients after 2 x {d['n'] // 2} warm-up images, servers alternating, "
        f"{cache}; the tiny tower; against {rev} ({d['against']['subject']}):\n\n"
        + markdown_table(["server", "images/s per round", "median", f"vs {rev}", "device calls (of one item)"], rows)
    )


WORKERS: dict = {}
