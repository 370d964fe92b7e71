"""`qwen-vit-jax serve` against hostile clients: the real server (a subprocess on 127.0.0.1, the demo's
tiny Qwen2.5-VL tower with the released preprocessing, max_pixels 12,845,056) and attackers in this
process (tests/serve_attacks.py).

    flock /tmp/qvj-bench.lock python benchmarks/bench_serve_hostile.py                 # the working tree
    flock /tmp/qvj-bench.lock python benchmarks/bench_serve_hostile.py --baseline main # and a revision
    python benchmarks/bench_serve_hostile.py --baseline main --attacks "" --skip-big  # the edges alone

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
  edges    one server per tree (`--max-connections 40`, other flags the defaults), the cases of --edges
           one after another, each for at most --edge-seconds; meanwhile a real client sends a fresh
           112x112 JPEG once a second (a fresh connection, 30 s timeout, from 127.0.0.1): its
           latencies and statuses. The server's RSS (its workers included): before, peak, after.
             ico     4 ICOs at once, each a 16x16 directory entry holding a 12000x12000 PNG
             head    20 connections streaming one request header as fast as they can (reconnecting
                     when closed)
             answer  3 clients asking for 64 identical 1792x1792 images (16,384 patches each: one
                     device call, then the cache) in float JSON, never reading the answer (until the
                     server has closed all three, 90 s at most)
             user    a body whose "user" holds 10 million empty lists (30 MB)
             bodies  40 request bodies that stall after 16 bytes, from 127.0.0.2 (another client
                     address), kept at 40 (the attacker reopens what is closed)

Prints a markdown table and writes benchmarks/results/serve_hostile.json. The box is shared: name it
and its load (the table's caption does).
"""

from __future__ import annotations

import argparse
import functools
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


class Prober:
    """A real client on a thread: a fresh 112x112 JPEG once a second on a fresh connection (30 s
    timeout), its (status, seconds) recorded; `stop()` -> a summary."""

    def __init__(self, url: str, seed: int):
        self.url, self.seed, self.results, self._stop = url, seed, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import httpx

        k = 0
        while not self._stop.is_set():
            body = st.body([st.jpeg(112, 112, seed=self.seed * 1000 + k)])
            k += 1
            t0 = time.monotonic()
            try:
                status = httpx.post(self.url + st.ROUTE, content=body, timeout=30).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            self.results.append((status, time.monotonic() - t0))
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - t0)))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(60)
        ok = sorted(t for s, t in self.results if s == 200)
        statuses = {str(s): sum(1 for x, _ in self.results if x == s) for s in {s for s, _ in self.results}}
        return {"statuses": statuses, "median_s": st.percentile(ok, 50), "max_s": max(ok) if ok else None}


def _flood_heads(port: int, n: int, seconds: float) -> dict:
    """`n` connections each streaming one request header as fast as they can for `seconds` (a
    connection the server closes is reopened): bytes sent, the server's answers' first bytes."""
    import socket

    stop, sent, answers = time.monotonic() + seconds, [0] * n, {}

    def one(i: int) -> None:
        while time.monotonic() < stop:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=2)
            except OSError:
                time.sleep(0.1)
                continue
            try:
                s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
                while time.monotonic() < stop:
                    sent[i] += s.send(b"a" * 65536)
            except OSError:
                pass
            try:
                s.settimeout(0.5)
                first = s.recv(16)[:12].decode("latin-1") or "closed"
            except OSError:
                first = "reset"
            answers[first] = answers.get(first, 0) + 1
            s.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return {"sent_mb": sum(sent) / 1e6, "answers": answers}


def _non_readers(port: int, n: int, seconds: float) -> dict:
    """`n` clients asking for 64 identical 1792x1792 images in float JSON and never reading: for
    `seconds` or until the server has closed them all. -> when each was closed."""
    import io
    import socket

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:1792, 0:1792]
    im = np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(im).save(buf, "PNG")
    request = sa.http_request("POST", st.ROUTE, st.body([buf.getvalue()] * 64))
    t0 = time.monotonic()
    with sa.NonReaders(port, request, n) as clients:
        closed = {}
        while len(closed) < n and time.monotonic() - t0 < seconds:
            for i, s in enumerate(clients.socks):
                # the kernel's TCP state (tcp_info's first byte): 1 established; a reset (7) or the
                # server's end of the stream (8) is the server's close, whatever is left unread
                if i not in closed and s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != 1:
                    closed[i] = time.monotonic() - t0
            time.sleep(0.25)
    return {"closed_after_s": sorted(closed.values()), "body_mb": len(request) / 1e6}


def _huge_user(url: str) -> dict:
    import httpx

    body = st.body([st.jpeg(56, 56, seed=5)])[:-1] + b', "user": [' + b"[]," * 9_999_999 + b"[]]}"
    t0 = time.monotonic()
    try:
        status = httpx.post(url + st.ROUTE, content=body, timeout=120).status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return {"status": status, "seconds": time.monotonic() - t0, "body_mb": len(body) / 1e6}


def _stalled_bodies(port: int, n: int, seconds: float) -> dict:
    """`n` bodies stalled after 16 bytes from 127.0.0.2, kept at n for `seconds`: the first bytes
    the server answered them with."""
    groups = [sa.Sockets(port, stalled=n, source="127.0.0.2")]
    t0, reopened = time.monotonic(), 0
    try:
        while time.monotonic() - t0 < seconds:
            gone = sum(len(g.closed) for g in groups)
            if gone > reopened:
                groups.append(sa.Sockets(port, stalled=gone - reopened, source="127.0.0.2"))
                reopened = gone
            time.sleep(0.1)
    finally:
        for g in groups:
            g.close()
    answers: dict = {}
    for g in groups:
        for _, first in g.closed.values():
            key = first[:12].decode("latin-1") or "closed"
            answers[key] = answers.get(key, 0) + 1
    return {"answers": answers, "reopened": reopened}


def edges(ckpt: str, tree: pathlib.Path, label: str, cases: list[str], seconds: float) -> dict:
    """The edge cases against one server of `tree`, one after another."""
    import httpx

    flags = ["--max-connections", 40]
    with st.Server(ckpt, *flags, log=WORK / f"hostile_edges_{label}.log", env=server_env(tree), cwd=tree) as server:
        assert httpx.post(server.url + st.ROUTE, content=st.body([st.jpeg(112, 112, seed=1)]), timeout=120).is_success
        out = {}
        ico = _ico_body() if "ico" in cases else None  # made here, before the clocks start
        for k, case in enumerate(cases):
            time.sleep(2.0)  # the last case's memory returned
            rss, probe = RSS(server), Prober(server.url, seed=k + 1)
            t0 = time.monotonic()
            if case == "ico":
                done: list = []

                def send_ico(done=done):
                    try:
                        r = httpx.post(server.url + st.ROUTE, content=ico, timeout=120)
                        done.append(r.status_code)
                    except httpx.HTTPError as e:
                        done.append(type(e).__name__)

                ts = [threading.Thread(target=send_ico) for _ in range(4)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join(150)
                result = {"statuses": {str(s): done.count(s) for s in set(done)}}
            elif case == "head":
                result = _flood_heads(server.port, 20, seconds)
            elif case == "answer":  # the 16,384-patch call takes 10-20 s on 2 cores, then S to cut off
                result = _non_readers(server.port, 3, ANSWER_S)
            elif case == "user":
                result = _huge_user(server.url)
            elif case == "bodies":
                result = _stalled_bodies(server.port, 40, seconds)
            else:
                raise ValueError(f"--edges: unknown case {case!r}")
            result["seconds"] = result.get("seconds", time.monotonic() - t0)
            time.sleep(1.0)
            out[case] = {**result, "small": probe.stop(), "rss": rss.stop()}
            log(f"{label} {case}: {out[case]}")
        closed = {k: v for k, v in st.metrics(server.url).items() if k.startswith("qvj_connections_closed_total")}
        out["closed"] = closed
    return out


ANSWER_S = 90.0  # the longest the answer case waits for its clients to be cut off


@functools.lru_cache(maxsize=1)
def _ico_body() -> bytes:
    return st.body([sa.ico_holding(12000)])


EDGE_CASES = {
    "ico": "4 ICOs at once: a 16x16 entry holding a 12000x12000 PNG",
    "head": "20 connections streaming a request header",
    "answer": "3 clients not reading a 64 x 1792x1792 answer",
    "user": '"user": 10M empty lists (30 MB body)',
    "bodies": "40 stalled bodies from 127.0.0.2, --max-connections 40",
}


def _edge_row(label: str, case: str, r: dict) -> list[str]:
    small, mem = r["small"], r["rss"]
    if case == "ico":
        what = f"statuses {r['statuses']}"
    elif case == "head":
        what = f"{r['sent_mb']:.0f} MB sent; answers {r['answers']}"
    elif case == "answer":
        closed = r["closed_after_s"]
        what = f"closed after {', '.join(f'{c:.1f}' for c in closed)} s" if closed else "never closed"
    elif case == "user":
        what = f"{r['status']} in {r['seconds']:.1f} s"
    else:
        what = f"answers {r['answers']}; reopened {r['reopened']}"
    med = "-" if small["median_s"] != small["median_s"] else f"{small['median_s']:.2f} s"
    worst = "-" if small["max_s"] is None else f"{small['max_s']:.1f} s"
    return [
        label,
        EDGE_CASES[case],
        what,
        f"{small['statuses']}, median {med}, max {worst}",
        f"{mem['before_mb']:.0f} -> {mem['peak_mb']:.0f} -> {mem['after_mb']:.0f}",
    ]


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
    p.add_argument("--edges", default=",".join(EDGE_CASES), help="edge cases ('': none): " + ", ".join(EDGE_CASES))
    p.add_argument("--edge-seconds", type=float, default=15.0, help="how long the head, answer and bodies cases last")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_hostile.json"))
    args = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    ckpt = run_worker(str(HERE), "checkpoint", {})["path"]
    trees = ({args.baseline: worktree(args.baseline)} if args.baseline else {}) | {"working tree": ROOT}
    pairs = [tuple(int(x) for x in a.split(":")) for a in args.attacks.split(",") if a]
    results, rows, edge_rows = {}, [], []
    cases = [c for c in args.edges.split(",") if c]
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
        if cases:
            res["edges"] = edges(ckpt, tree, label.replace(" ", "_"), cases, args.edge_seconds)
    for case in cases:  # the trees side by side, case by case
        edge_rows += [_edge_row(label, case, results[label]["edges"][case]) for label in trees]
    print(machine_line())
    if rows:
        print(markdown_table(["server", "attack", "result", "notes"], rows))
    if edge_rows:
        head = ["server", "case", "result", "a small request meanwhile", "RSS MB before -> peak -> after"]
        print(markdown_table(head, edge_rows))
    write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
