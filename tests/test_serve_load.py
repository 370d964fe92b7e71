"""`qwen-vit-jax serve` under overload, bad input and a killed worker, at small scale: one real server
(a subprocess, uvicorn on 127.0.0.1) on the tiny tower, driven by asyncio + httpx clients
(benchmarks/workloads/traffic.py; `python -m benchmarks serve` runs the same at scale and measures).

The server gets one image size, declared, and a patch budget of one image: every device call runs
the one compiled program, so the file costs start-up plus traffic, not compiles."""

from __future__ import annotations

import asyncio
import time

import pytest

import qwen_vit_jax as qvj
from benchmarks.workloads import traffic as st

pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'qwen_vit_jax[serve]')")

SIDE = (112, 112)  # px: an 8 x 8 grid of patches
MAX_QUEUE = 8  # items


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_load") / "server.log"
    flags = ["--workers", 1, "--max-queue", MAX_QUEUE, "--max-batch-patches", 64, "--declare", "8x8"]
    with st.Server(tiny_dirs[1], *flags, log=log) as s:
        yield s


def images(n: int, seed: int) -> list[bytes]:
    return [st.jpeg(*SIDE, seed=seed + i) for i in range(n)]


def answers_one(server) -> None:
    """The server is alive and answers a fresh image."""
    import httpx

    assert server.alive()
    r = httpx.post(server.url + st.ROUTE, content=st.body(images(1, seed=10_000 + time.monotonic_ns() % 1000)))
    assert r.status_code == 200, r.text


def test_overload_gives_429s_and_answers_every_accepted_request(server):
    # 40 requests of 4 images at once, against a queue of 8 items: most are refused at the door
    bodies = [st.body(images(4, seed=100 + 4 * i)) for i in range(40)]
    # fresh connections: a reused one the server is closing would be the client's race, not a lost request
    results, _ = asyncio.run(st.open_loop(server.url, bodies, rate=2000.0, seed=0, timeout=120, keepalive=False))
    counts = st.statuses(results)
    assert set(counts) <= {200, 429}, counts  # no request lost (0), failed (5xx) or timed out
    assert counts.get(429, 0) >= 10 and counts.get(200, 0) >= 1, counts
    assert all(r.items == 4 for r in results if r.status == 200)
    assert all(r.retry_after and int(r.retry_after) >= 1 for r in results if r.status == 429)
    m = st.metrics(server.url)
    assert m["qvj_queue_items"] == 0  # every admitted item answered: nothing left holding memory
    assert m["qvj_requests_total{status=429}"] == counts[429]
    answers_one(server)


def test_memory_stays_flat_under_overload(server):
    """Rounds of overload like the test above, on images of their own: the server's resident memory
    (at rest after each round, less what its in-memory LRU holds) does not grow round after round."""

    def at_rest() -> float:  # MB: the least of a few samples (the allocator's peaks pass)
        time.sleep(0.3)
        lru = st.metrics(server.url)["qvj_cache_bytes"] / 2**20
        return min(server.rss_mb() for _ in range(5)) - lru

    rest = []
    for k in range(5):
        bodies = [st.body(images(4, seed=10_000 * (k + 1) + 4 * i)) for i in range(40)]
        results, _ = asyncio.run(st.open_loop(server.url, bodies, rate=2000.0, seed=k, timeout=120, keepalive=False))
        assert set(st.statuses(results)) <= {200, 429}
        rest.append(at_rest())
    print(f"\nRSS at rest less the LRU, MB: {[round(r) for r in rest]}")
    assert rest[-1] - rest[1] < 24, rest  # round 0 may still allocate for good (first overload)


def test_a_thousand_malformed_bodies_all_get_4xx(server):
    cases = st.malformed(1000, seed=1, good=images(1, seed=0)[0])
    results = asyncio.run(st.fuzz(server.url, cases, concurrency=8))
    wrong = {(what, r.status, r.error) for what, r in results if not 400 <= r.status < 500}
    assert not wrong, sorted(wrong)
    assert len({what for what, _ in cases}) >= 15  # every kind of wrongness was sent
    answers_one(server)


def test_a_killed_worker_fails_its_item_with_503_and_is_replaced(server):
    before = st.metrics(server.url)["qvj_workers_replaced_total"]
    old = set(server.worker_pids())
    killed = {}

    async def killer():
        await asyncio.sleep(0.5)
        killed["pid"], killed["at"] = st.kill_worker(server), time.monotonic()

    async def load():
        return await asyncio.gather(
            st.closed_loop(server.url, [st.body(b) for b in _singles(200)], 4), killer()
        )  # past the kill

    (results, _), _ = asyncio.run(load())
    counts = st.statuses(results)
    assert set(counts) <= {200, 503}, counts  # the dead worker's item: 503, never lost or hung
    assert killed["pid"] in old
    recovered = [r.sent + r.seconds - killed["at"] for r in results if r.status == 200 and r.sent > killed["at"]]
    assert recovered and min(recovered) < 30  # a fresh worker answers again
    assert st.metrics(server.url)["qvj_workers_replaced_total"] >= before + 1
    assert killed["pid"] not in server.worker_pids() and server.worker_pids()
    # the client retries a 503 (here: an item the next dead worker held, if it held one) to an answer
    st.kill_worker(server)
    with qvj.serve.Client(server.url, backoff=0.1) as client:
        e = client.embed(images(1, seed=20_000))
    assert e[0].shape[0] == 16  # an 8 x 8 grid, merged 2 x 2
    answers_one(server)


def _singles(n: int) -> list[list[bytes]]:
    return [[b] for b in images(n, seed=30_000)]
