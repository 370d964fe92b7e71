"""`qwen-vit-jax serve` against hostile clients: the real server (a subprocess on 127.0.0.1, the demo's
tiny Qwen2.5-VL tower with the released preprocessing, max_pixels 12,845,056) and attackers in this
process (workloads/attacks.py).

    python -m benchmarks hostile                   # the working tree
    python -m benchmarks hostile --against main    # and a revision's server (first)
    python -m benchmarks hostile --against main --attacks '' --skip-big --label edges   # the edges alone

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
           (the buckets compiled or loaded from the serve suites' compilation cache, untimed). The
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

--quick: every phase on one server (--max-connections 2 --max-item-patches 256): 4 sockets for 2 s,
a 2000x2000 PNG, the "user" edge case.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pathlib
import threading
import time

from benchmarks import common
from benchmarks.common import log, markdown_table
from benchmarks.workloads import attacks as sa
from benchmarks.workloads import traffic as st

AGAINST = "also measure this revision's server (first)"


def add_args(p) -> None:
    p.add_argument("--attacks", help="N:M pairs, sockets : --max-connections (default 24:16,520:512; '': none)")
    p.add_argument("--bounds", default="", help="--max-item-patches values for more big phases (working tree)")
    p.add_argument("--seconds", type=float, help="how long each attack lasts (default 30; --quick 2)")
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--edges", help=f"edge cases (default {','.join(EDGE_CASES)}; --quick user; '': none)")
    p.add_argument("--edge-seconds", type=float, help="how long the head, answer and bodies cases last (default 15)")


@contextlib.contextmanager
def server_of(ckpt: str, tree: pathlib.Path, name: str, flags: list, shared=None):
    """A server of `tree` with `flags` (its log: hostile_NAME.log), or `shared`, one already running (the
    quick runs: every phase on one server)."""
    if shared is not None:
        yield shared
        return
    log_path = st.bench_dir() / f"hostile_{name}.log"
    with st.Server(ckpt, *flags, log=log_path, env=st.server_env(tree), cwd=tree) as server:
        yield server


def attack(
    ckpt, tree: pathlib.Path, label: str, sockets: int, max_connections: int, seconds: float, shared=None
) -> dict:
    """N hostile sockets kept open against --max-connections M; a real client once a second."""
    import httpx

    flags = ["--max-connections", max_connections]
    with server_of(ckpt, tree, label, flags, shared) as server:
        body = st.body([st.jpeg(112, 112, seed=1)])
        assert httpx.post(server.url + st.ROUTE, content=body, timeout=120).status_code == 200  # warm
        groups = [sa.Sockets(server.port, silent=sockets // 2, slow=sockets - sockets // 2)]
        t0, first, statuses, next_try, reopened = time.monotonic(), None, [], time.monotonic() + 0.5, 0
        with st.RssSampler(server) as rss:
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
        for g in groups:
            g.close()
        memory = rss.summary()
        closed = {k: v for k, v in st.metrics(server.url).items() if k.startswith("qvj_connections_closed_total")}
    counts = {str(s): statuses.count(s) for s in sorted(set(statuses), key=str)}
    log(f"{label} attack {sockets} vs {max_connections}: first 200 at {first} s, {counts}, reopened {reopened}")
    return {"first_200_s": first, "statuses": counts, "reopened": reopened, "closed": closed, "rss": memory}


def big(ckpt: str, tree: pathlib.Path, label: str, flags: list, side: int, shared=None) -> dict:
    """The side x side PNG (7000: 49 MP) and a small one a second later, after a warm-up pair."""
    import httpx

    def send(blob: bytes, out: dict, key: str) -> None:
        t0 = time.monotonic()
        try:
            r = httpx.post(server.url + st.ROUTE, content=st.body([blob]), timeout=300)
            out[key] = (r.status_code, time.monotonic() - t0, r.json()["data"][0]["grid_thw"] if r.is_success else None)
        except httpx.HTTPError as e:
            out[key] = (type(e).__name__, time.monotonic() - t0, None)

    with server_of(ckpt, tree, f"big_{label}", flags, shared) as server:
        rounds = {}
        for name, seed in (("warm-up", 0), ("timed", 1)):
            big_png, small = _big_png(seed, side), st.jpeg(112, 112, seed=100 + seed)
            out: dict = {}
            with st.RssSampler(server) as rss:
                t = threading.Thread(target=send, args=(big_png, out, "big"))
                t.start()
                time.sleep(1.0)
                send(small, out, "small")
                t.join()
            rounds[name] = {**out, "rss": rss.summary()}
            log(f"{label} {name}: big {out['big']}, small {out['small']}")
    return rounds["timed"]


def edges(
    ckpt, tree, label: str, cases: list[str], seconds: float, answer_s: float, settle: float, shared=None
) -> dict:
    """The edge cases against one server of `tree`, one after another, `settle` s apart."""
    import httpx

    flags = ["--max-connections", 40]
    with server_of(ckpt, tree, f"edges_{label}", flags, shared) as server:
        assert httpx.post(server.url + st.ROUTE, content=st.body([st.jpeg(112, 112, seed=1)]), timeout=120).is_success
        out = {}
        ico = _ico_body() if "ico" in cases else None  # made here, before the clocks start
        for k, case in enumerate(cases):
            time.sleep(settle)  # the last case's memory returned
            with st.RssSampler(server) as rss:
                probe = sa.Prober(server.url, seed=k + 1)
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
                    result = sa.flood_heads(server.port, 20, seconds)
                elif case == "answer":  # the 16,384-patch call takes 10-20 s on 2 cores, then S to cut off
                    result = sa.non_readers(server.port, 3, answer_s)
                elif case == "user":
                    result = sa.huge_user(server.url)
                elif case == "bodies":
                    result = sa.stalled_bodies(server.port, 40, seconds)
                else:
                    raise ValueError(f"--edges: unknown case {case!r}")
                result["seconds"] = result.get("seconds", time.monotonic() - t0)
                time.sleep(settle / 2)
            out[case] = {**result, "small": probe.stop(), "rss": rss.summary()}
            log(f"{label} {case}: {out[case]}")
        closed = {k: v for k, v in st.metrics(server.url).items() if k.startswith("qvj_connections_closed_total")}
        out["closed"] = closed
    return out


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


def _big_png(seed: int, side: int) -> bytes:
    """sa.big_png with its gradient block moved by `seed` (other bytes, the same size)."""
    from PIL import Image

    im = Image.open(io.BytesIO(sa.big_png(side)))
    im.paste((seed * 37 % 256, 60, 90), (10 + seed, 10, 200 + seed, 200))
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


QUICK_FLAGS = ["--max-connections", 2, "--max-item-patches", 256]


def hostile(args, ckpt: str, tree: pathlib.Path, name: str, shared) -> dict:
    """Every phase against `tree`'s servers (`shared`: one already running)."""
    pairs = [tuple(int(x) for x in a.split(":")) for a in args.attacks.split(",") if a]
    res = {"attacks": {}, "big": {}}
    for n, m in pairs:
        res["attacks"][f"{n}:{m}"] = attack(ckpt, tree, name, n, m, args.seconds, shared)
    bounds = [None] + ([int(x) for x in args.bounds.split(",") if x] if tree == common.ROOT else [])
    for bound in [] if args.skip_big else [256] if args.quick else bounds:
        flags = [] if bound is None else ["--max-item-patches", bound]
        res["big"][str(bound or "")] = big(ckpt, tree, f"{name}_{bound}", flags, args.big_side, shared)
    if args.edges:  # the answer case: a 16,384-patch call (10-20 s on 2 cores), then the cut-off
        settle = 0.2 if args.quick else 2.0
        cases = [c for c in args.edges.split(",") if c]
        res["edges"] = edges(ckpt, tree, name, cases, args.edge_seconds, 90.0, settle, shared)
    return res


def run(args) -> dict:
    st.bench_dir().mkdir(parents=True, exist_ok=True)
    ckpt = common.run_worker("common", "demo", {"model": "tiny"})["path"]
    rev = common.rev_info(args.against) if args.against else None
    trees = ({rev["hash"][:7]: common.worktree(rev["hash"])} if rev else {}) | {"working tree": common.ROOT}
    if args.attacks is None:
        args.attacks = "4:2" if args.quick else "24:16,520:512"
    if args.edges is None:
        args.edges = "user" if args.quick else ",".join(EDGE_CASES)
    args.seconds = args.seconds or (2.0 if args.quick else 30.0)
    args.edge_seconds = args.edge_seconds or (1.0 if args.quick else 15.0)
    args.big_side = 2000 if args.quick else 7000
    results = {}
    for label, tree in trees.items():
        with contextlib.ExitStack() as stack:
            shared = None  # quick: every phase on one server, the flags of all (4 sockets vs 2, 256 patches)
            if args.quick:
                shared = stack.enter_context(server_of(ckpt, tree, "quick", QUICK_FLAGS))
            results[label] = hostile(args, ckpt, tree, label.replace(" ", "_"), shared)
    sizes = {"seconds": args.seconds, "big_side": args.big_side, "edge_seconds": args.edge_seconds}
    return sizes | {"against": rev, "results": results}


def report(result: dict) -> str:
    d, rows = result["data"], []
    for label, res in d["results"].items():
        for pair, a in res["attacks"].items():
            n, m = pair.split(":")
            first = "**never**" if a["first_200_s"] is None else f"first 200 after {a['first_200_s']:.1f} s"
            closed = ", ".join(f"{k.split('=')[1].rstrip('}')} {v:.0f}" for k, v in a["closed"].items() if v)
            notes = f"1 request/s for {d['seconds']:.0f} s: {a['statuses']}"
            notes += f"; reopened {a['reopened']}" if a.get("reopened") is not None else ""
            notes += f"; closed: {closed or '-'}"
            if a.get("rss"):
                notes += f"; RSS {a['rss']['before_mb']:.0f} -> {a['rss']['peak_mb']:.0f} MB"
            rows.append([label, f"{n} idle / slow sockets vs `--max-connections {m}`", first, notes])
        for bound, b in res["big"].items():
            (bs, bt, grid), (ss, stime, _), mem = b["big"], b["small"], b["rss"]
            server = label + (f", `--max-item-patches {bound}`" if bound else "")
            mp = d["big_side"] ** 2 / 1e6
            rows.append(
                [
                    server,
                    f"{d['big_side']}x{d['big_side']} PNG ({mp:.0f} MP)",
                    f"{bt:.1f} s ({bs})",
                    f"grid {grid}" if grid else "-",
                ]
            )
            rows.append([server, "112x112 JPEG sent 1 s after it", f"{stime:.1f} s ({ss})"])
            rows[-1].append(f"RSS {mem['before_mb']:.0f} -> peak {mem['peak_mb']:.0f} -> {mem['after_mb']:.0f} MB")
    text = (
        "`qwen-vit-jax serve` on 127.0.0.1, the demo's tiny Qwen2.5-VL tower with the released preprocessing "
        "(max_pixels 12,845,056), float32, every flag at its default but the ones named; attackers and clients "
        "in the same box."
    )
    attacked = bool(rows)
    if attacked:
        text = text[:-1] + ":\n\n" + markdown_table(["server", "attack", "result", "notes"], rows) + "\n\n"
    cases = list(dict.fromkeys(c for res in d["results"].values() for c in res.get("edges", {}) if c in EDGE_CASES))
    if cases:  # the trees side by side, case by case
        rows = [_edge_row(label, c, res["edges"][c]) for c in cases for label, res in d["results"].items()]
        head = ["server", "case", "result", "a small request meanwhile", "RSS MB before -> peak -> after"]
        text += (
            ("" if attacked else " ")
            + "The edges: one server per tree (`--max-connections 40`), the cases one after another (each at most "
            f"{d.get('edge_seconds', 15):g} s), a real client sending a fresh 112x112 JPEG once a second meanwhile:\n\n"
            + markdown_table(head, rows)
        )
    return text


WORKERS: dict = {}
