"""`qwen-vit-jax serve` under load, faults and bad input: the real server (a uvicorn subprocess on
127.0.0.1) driven by concurrent asyncio + httpx clients on JPEGs of mixed sizes.

    python benchmarks/bench_serve.py                      # the demo's tiny tower
    python benchmarks/bench_serve.py --quick              # fewer requests, shorter phases (~2 min)
    python benchmarks/bench_serve.py --model 3b --quick   # the real Qwen2.5-VL-3B tower (random weights)

Inputs: one JPEG per request, answered in base64 as qvj.serve.Client asks (`request`); JPEGs
(quality 90, a gradient plus noise, each its own seed) whose sizes cycle through SIDES
(px, multiples of 28: 5 grids of 64..192 patches), every phase on images of its own, so no phase
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
  fuzz        --fuzz malformed bodies (tests/serve_traffic.py's `malformed`: 18 kinds, from not-JSON to
              a bomb's PNG header and paths / URLs the server must not open), 8 at a time: statuses
              (all must be 4xx), then GET /healthz
  kill        --concurrency clients in a closed loop; 1 s in, kill -9 of a preparation worker: every
              request answered (200 or 503), recovery = from the kill to the first 200 of a request
              sent after it, and the workers-replaced counter
  SIGTERM     the server's exit code and seconds to exit after SIGTERM (idle)

Prints a markdown table and writes benchmarks/results/serve[-3b][-quick].json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

from common import CACHE, ROOT, default_out, log, machine_line, markdown_table, run_worker, worker_main, write_json

sys.path.insert(0, str(ROOT / "tests"))
import serve_traffic as st  # noqa: E402  (shared with tests/test_serve_load.py)

HERE = pathlib.Path(__file__).resolve()
WORK = CACHE / "serve"
SIDES = [(112, 112), (168, 224), (224, 224), (280, 196), (224, 336)]  # (h, w) px: grids of 64..192 patches
SUMMARY = re.compile(r"encoded ([\d,]+) inputs? \(.*?\) in ([\d.]+) s \(([\d.e+-]+) inputs/s")
COMPILED = re.compile(r"program\(s\) compiled in ([\d.]+) s")
# seeds of each phase's images: disjoint ranges
TIMEOUT = 120.0  # s, the clients' limit: past the server's own (--timeout 60, a 504), so no answer is cut off
SEEDS = {"warmup": 0, "saturation": 100_000, "latency": 200_000, "cache": 300_000, "overload": 400_000, "kill": 500_000}


def request(image: bytes) -> bytes:
    """One image's request body, answered in base64 float32 as qvj.serve.Client asks (float lists
    are OpenAI's default: exact too, but ~2x the bytes and a JSON parse per float on the client)."""
    return st.body([image], encoding_format="base64")


def checkpoint_worker(p: dict) -> dict:
    """Worker: the demo's random checkpoint of p["model"] ("tiny" or "3b"), built once under the cache."""
    from qwen_vit_jax.tools.demo import prepare_checkpoint

    return {"path": str(prepare_checkpoint(p["model"], CACHE, log=log))}


def images(phase: str, n: int) -> list[bytes]:
    base = SEEDS[phase]
    return [st.jpeg(*SIDES[i % len(SIDES)], seed=base + i) for i in range(n)]


def env() -> dict:
    """The server's and the offline runs' environment: one persistent compilation cache, no torch needed."""
    cache = WORK / "jax_cache"
    return dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )


def offline(ckpt: str, blobs: list[bytes], dtype: str, workers: int) -> dict:
    """`qwen-vit-jax encode` on the same images as files, on the first third and on all of them (fresh
    processes): images/s past start-up = the extra images over the extra encode seconds, compile
    seconds taken out of both (the summary line's); and the whole run's own inputs/s."""
    folder = WORK / "offline_inputs"
    runs = []
    for k in (len(blobs) // 3, len(blobs)):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for i, b in enumerate(blobs[:k]):
            (folder / f"{i:06d}.jpg").write_bytes(b)
        cmd = [sys.executable, "-c", st.CLI, "encode", ckpt, str(folder), "-o", str(WORK / "offline.safetensors")]
        cmd += ["--overwrite", "--workers", str(workers), "--dtype", dtype]
        p = subprocess.run(cmd, env=env(), capture_output=True, text=True, cwd=ROOT, check=False, timeout=3600)
        m, c = SUMMARY.search(p.stdout), COMPILED.search(p.stdout)
        if p.returncode or not m or not c:
            raise RuntimeError(f"offline encode failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-2000:]}")
        runs.append(
            {"inputs": int(m.group(1).replace(",", "")), "seconds": float(m.group(2)), "compile_s": float(c.group(1))}
        )
    (a, b) = runs
    steady = (b["inputs"] - a["inputs"]) / max((b["seconds"] - b["compile_s"]) - (a["seconds"] - a["compile_s"]), 1e-9)
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


class RssSampler:
    """The server's RSS (MB) and its in-memory LRU's bytes (qvj_cache_bytes, MB: bounded by
    --cache-mb, so growth within it is the cache filling, not a leak) every `period` s in a thread,
    while in a `with` block: samples of (seconds, rss, lru)."""

    def __init__(self, server: st.Server, period: float = 0.25):
        self.server, self.period, self.samples = server, period, []
        self._stop = threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        t0 = time.monotonic()
        while not self._stop.is_set():
            lru = st.metrics(self.server.url).get("qvj_cache_bytes", 0.0) / 2**20
            self.samples.append((time.monotonic() - t0, self.server.rss_mb(), lru))
            self._stop.wait(self.period)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def answered(results) -> dict:
    s = st.statuses(results)
    errors = sorted({r.error for r in results if r.status == st.UNANSWERED})
    return {
        "statuses": {str(k): v for k, v in s.items()},
        "unanswered": s.get(st.UNANSWERED, 0),
        "errors": errors,
        "n": len(results),
    }


async def kill_phase(server: st.Server, bodies: list[bytes], concurrency: int) -> dict:
    """Closed-loop load; a worker killed 1 s in. Every request answered; recovery time."""
    killed = {}

    async def killer():
        await asyncio.sleep(1.0)
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


def run(args) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    ckpt = run_worker(str(HERE), "checkpoint", {"model": args.model})["path"]
    n, c = args.n, args.concurrency
    log(f"images: {args.warmup_rounds} x {args.warmup} warm-up, {n} x 3 phases, kill {n}")
    warm, sat = images("warmup", args.warmup * args.warmup_rounds), images("saturation", n)
    cache_new, kill = images("cache", n // 2), images("kill", n)
    log("offline encode (twice) ...")
    off = offline(ckpt, sat, args.dtype, args.workers)
    log(f"offline: {off['images_per_s']:.2f} images/s")
    out: dict = {"model": args.model, "dtype": args.dtype, "workers": args.workers, "concurrency": c, "offline": off}
    flags = ["--dtype", args.dtype, "--workers", args.workers, "--max-queue", args.max_queue]
    log_path = WORK / "server.log"
    log_path.unlink(missing_ok=True)
    with st.Server(ckpt, *flags, log=log_path, env=env(), ready_timeout=1800) as server:
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
        lat_bodies = [request(b) for b in images("latency", k)]
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
        over_bodies = [request(b) for b in images("overload", k)]
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
        out["kill"] = asyncio.run(kill_phase(server, [request(b) for b in kill], c))
        m1 = st.metrics(server.url)
        out["kill"]["replaced"] = delta(m1, m0, "qvj_workers_replaced_total")
        log(f"kill: {out['kill']['statuses']}, recovery {out['kill']['recovery_s']:.2f} s")

        t0 = time.monotonic()
        code = server.stop()
        out["sigterm"] = {"exit_code": code, "seconds": time.monotonic() - t0}
    return out


def table(r: dict) -> str:
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
    return markdown_table(["measure", "value", "notes"], rows)


def main():
    if worker_main({"checkpoint": checkpoint_worker}):
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "3b"), default="tiny", help="the demo's tiny tower or the real 3B")
    p.add_argument("--quick", action="store_true", help="fewer images, shorter phases")
    p.add_argument("--n", type=int, help="images per phase (default 600; --quick 150; 3b: 24 / 8)")
    p.add_argument("--concurrency", type=int, help="clients of the closed loops (default 32; 3b: 8)")
    p.add_argument("--seconds", type=float, help="latency and overload phase length (default 20; --quick 8)")
    p.add_argument("--fuzz", type=int, help="malformed bodies (default 2000; --quick 1000)")
    p.add_argument("--warmup", type=int, help="warm-up requests per round (default: --n; 3b: 8)")
    p.add_argument("--warmup-rounds", type=int, default=2, help="warm-up rounds (default 2)")
    p.add_argument("--workers", type=int, default=1, help="preparation workers of the server and `encode` (default 1)")
    p.add_argument("--max-queue", type=int, default=32, help="the server's --max-queue (default 32)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", help="the JSON to write")
    p.add_argument("--table", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    args = p.parse_args()
    if args.table:
        import json

        saved = json.loads(pathlib.Path(args.table).read_text())
        print(f"`{saved['command']}`\n\n{table(saved['result'])}")
        return
    big = args.model == "3b"
    args.n = args.n or (8 if big and args.quick else 24 if big else 150 if args.quick else 600)
    args.concurrency = args.concurrency or (8 if big else 32)
    args.seconds = args.seconds or (8.0 if args.quick else 20.0)
    args.fuzz = args.fuzz or (1000 if args.quick else 2000)
    args.warmup = args.warmup or (8 if big else args.n)
    name = "serve" + ("-3b" if big else "")
    r = run(args)
    text = table(r)
    cmd = "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:])
    print(f"\n{machine_line()}\n`{cmd}`\n\n{text}")
    write_json(args.out or default_out(name, args.quick), {"command": cmd, "result": r})


if __name__ == "__main__":
    main()
