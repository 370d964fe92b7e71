"""`qwen-vit-jax serve` against hostile clients: the real server (a subprocess on 127.0.0.1, the demo's
tiny Qwen2.5-VL tower with the released preprocessing, max_pixels 12,845,056) and attackers in this
process (tests/serve_attacks.py).

    flock /tmp/qvj-bench.lock python benchmarks/bench_serve_hostile.py                 # the working tree
    flock /tmp/qvj-bench.lock python benchmarks/bench_serve_hostile.py --baseline main # and a revision

Phases, per tree (the baseline's first):

  attack   --sockets N sockets (half silent, half trickling a request head one byte every 0.25 s)
           against `--max-connections M`, kept at N for --seconds (the attacker reopens every socket the
           server closes); meanwhile a real client sends one request a second, each on a fresh
           connection with a 10 s timeout: seconds until its first 200, and its statuses. Run for
           each (N, M) of --attacks (default 24 vs 16, the issue's, and 520 vs 512, the default
           limit), other flags the defaults (--header-timeout 10, --workers as the CLI's default).
  big      a 7000x7000 PNG (49 MP, under the 50 MP cap) and, 1 s later, a 112x112 JPEG, against a
           server with the defaults (the per-item bound: the patch budget, 16,384 patches): each
           one's seconds to its answer and the big one's grid; after a warm-up pair of other images
           (the buckets compiled or loaded from bench_serve's compilation cache, untimed). The
           server's RSS (its process and workers) every 0.25 s: before, peak, after. Again for
           each `--max-item-patches N` of --bounds (the working tree only: a baseline may not know it).

Prints a markdown table and writes benchmarks/results/serve_hostile.json. The box is shared: name it
and its load (the table's caption does).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import threading
import time

from common import (
    CACHE,
    ROOT,
    log,
    machine_line,
    markdown_table,
    rev_env,
    run_worker,
    worker_main,
    worktree,
    write_json,
)

sys.path.insert(0, str(ROOT / "tests"))
import serve_attacks as sa  # noqa: E402  (shared with tests/test_serve_hostile.py)
import serve_traffic as st  # noqa: E402

HERE = pathlib.Path(__file__).resolve()
WORK = CACHE / "serve"


def checkpoint_worker(p: dict) -> dict:
    """Worker: the demo's tiny checkpoint (the released preprocessor config), built once under the cache."""
    from qwen_vit_jax.tools.demo import prepare_checkpoint

    return {"path": str(prepare_checkpoint("tiny", CACHE, log=log))}


def server_env(tree: pathlib.Path) -> dict:
    """The server's environment: `tree`'s package first, bench_serve's persistent compilation cache."""
    cache = WORK / "jax_cache"
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    env.pop("PYTHONPATH", None)
    return rev_env(tree, env)


class RSS:
    """The server's RSS (MB, its workers included) every 0.25 s, on a thread."""

    def __init__(self, server: st.Server):
        self.server, self.samples, self._stop = server, [server.rss_mb()], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.25):
            self.samples.append(self.server.rss_mb())

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.server.rss_mb())
        return {"before_mb": self.samples[0], "peak_mb": max(self.samples), "after_mb": self.samples[-1]}


def attack(ckpt: str, tree: pathlib.Path, label: str, sockets: int, max_connections: int, seconds: float) -> dict:
    """N hostile sockets kept open against --max-connections M; a real client once a second."""
    import httpx

    flags = ["--max-connections", max_connections]
    with st.Server(ckpt, *flags, log=WORK / f"hostile_{label}.log", env=server_env(tree), cwd=tree) as server:
        body = st.body([st.jpeg(112, 112, seed=1)])
        assert httpx.post(server.url + st.ROUTE, content=body, timeout=120).status_code == 200  # warm
        groups = [sa.Sockets(server.port, silent=sockets // 2, slow=sockets - sockets // 2)]
        rss = RSS(server)
        t0, first, statuses, next_try, reopened = time.monotonic(), None, [], time.monotonic() + 0.5, 0
        try:
            while time.monotonic() - t0 < seconds:
                gone = sum(len(g.closed) for g in groups)
                if gone > reopened:  # keep N open: a persistent attacker
                    groups.append(sa.Sockets(server.port, silent=gone - reopened))
                    reopened = gone
                if time.monotonic() >= next_try:
                    next_try += 1.0
                    try:
                        status = httpx.post(server.url + st.ROUTE, content=body, timeout=10).status_code
                    except httpx.HTTPError as e:
                        status = type(e).__name__
                    statuses.append(status)
                    if status == 200 and first is None:
                        first = time.monotonic() - t0
                time.sleep(0.05)
        finally:
            for g in groups:
                g.close()
        memory = rss.stop()
        closed = {k: v for k, v in st.metrics(server.url).items() if k.startswith("qvj_connections_closed_total")}
    counts = {str(s): statuses.count(s) for s in sorted(set(statuses), key=str)}
    log(f"{label} attack {sockets} vs {max_connections}: first 200 at {first} s, {counts}, reopened {reopened}")
    return {"first_200_s": first, "statuses": counts, "reopened": reopened, "closed": closed, "rss": memory}


def big(ckpt: str, tree: pathlib.Path, label: str, flags: list) -> dict:
    """The 49 MP image and a small one a second later, after a warm-up pair."""
    import httpx

    def send(blob: bytes, out: dict, key: str) -> None:
        t0 = time.monotonic()
        try:
            r = httpx.post(server.url + st.ROUTE, content=st.body([blob]), timeout=300)
            out[key] = (r.status_code, time.monotonic() - t0, r.json()["data"][0]["grid_thw"] if r.is_success else None)
        except httpx.HTTPError as e:
            out[key] = (type(e).__name__, time.monotonic() - t0, None)

    with st.Server(ckpt, *flags, log=WORK / f"hostile_big_{label}.log", env=server_env(tree), cwd=tree) as server:
        rounds = {}
        for name, seed in (("warm-up", 0), ("timed", 1)):
            big_png, small = _big_png(seed), st.jpeg(112, 112, seed=100 + seed)
            rss = RSS(server)
            out: dict = {}
            t = threading.Thread(target=send, args=(big_png, out, "big"))
            t.start()
            time.sleep(1.0)
            send(small, out, "small")
            t.join()
            rounds[name] = {**out, "rss": rss.stop()}
            log(f"{label} {name}: big {out['big']}, small {out['small']}")
    return rounds["timed"]


def _big_png(seed: int) -> bytes:
    """sa.big_png with its gradient block moved by `seed` (other bytes, the same size)."""
    import io

    from PIL import Image

    im = Image.open(io.BytesIO(sa.big_png(7000)))
    im.paste((seed * 37 % 256, 60, 90), (10 + seed, 10, 200 + seed, 200))
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def main() -> None:
    if worker_main({"checkpoint": checkpoint_worker}):
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", metavar="REV", help="also measure this revision's server (first)")
    p.add_argument("--attacks", default="24:16,520:512", help="N:M pairs, sockets : --max-connections ('': none)")
    p.add_argument("--bounds", default="", help="--max-item-patches values for more big phases (working tree)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long each attack lasts")
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_hostile.json"))
    args = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    ckpt = run_worker(str(HERE), "checkpoint", {})["path"]
    trees = ({args.baseline: worktree(args.baseline)} if args.baseline else {}) | {"working tree": ROOT}
    pairs = [tuple(int(x) for x in a.split(":")) for a in args.attacks.split(",") if a]
    results, rows = {}, []
    for label, tree in trees.items():
        res = results[label] = {"attacks": {}}
        for n, m in pairs:
            a = res["attacks"][f"{n}:{m}"] = attack(ckpt, tree, label.replace(" ", "_"), n, m, args.seconds)
            first = "never" if a["first_200_s"] is None else f"{a['first_200_s']:.1f} s"
            closed = ", ".join(f"{k.split('=')[1].rstrip('}')} {v:.0f}" for k, v in a["closed"].items() if v)
            rows.append(
                [
                    label,
                    f"{n} idle sockets vs --max-connections {m}",
                    f"first 200 after {first}",
                    f"{args.seconds:.0f} s, 1 request/s: {a['statuses']}; reopened {a['reopened']}; "
                    f"closed: {closed or '-'}; RSS {a['rss']['before_mb']:.0f} -> {a['rss']['peak_mb']:.0f} MB",
                ]
            )
        bounds = [None] + ([int(x) for x in args.bounds.split(",") if x] if tree == ROOT else [])
        for bound in [] if args.skip_big else bounds:
            flags = [] if bound is None else ["--max-item-patches", bound]
            name = "big" if bound is None else f"big_{bound}"
            b = res[name] = big(ckpt, tree, f"{label.replace(' ', '_')}_{bound}", flags)
            (bs, bt, grid), (ss, stime, _), mem = b["big"], b["small"], b["rss"]
            server = label if bound is None else f"{label}, --max-item-patches {bound}"
            rows.append([server, "7000x7000 PNG (49 MP)", f"{bt:.1f} s ({bs})", f"grid {grid}"])
            rows.append(
                [
                    server,
                    "112x112 JPEG sent 1 s after it",
                    f"{stime:.1f} s ({ss})",
                    f"RSS {mem['before_mb']:.0f} -> peak {mem['peak_mb']:.0f} -> {mem['after_mb']:.0f} MB",
                ]
            )
    print(machine_line())
    print(markdown_table(["server", "attack", "result", "notes"], rows))
    write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
