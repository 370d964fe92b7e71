"""Traffic for `qwen-vit-jax serve` on 127.0.0.1: a server subprocess, JPEG bodies, closed-loop
(saturation) and open-loop (Poisson) clients on asyncio + httpx, malformed bodies, the server's RSS
and its preparation workers.

Shared by the service's tests (small scale; `in_thread`: a server in the test's own process) and
the serve suites (the measured runs).
Every loop is bounded in count and in time, and every request goes to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import io
import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np

HOST = "127.0.0.1"
ROUTE = "/v1/embeddings"
UNANSWERED = 0  # the status of a request that got no HTTP answer (connection lost, client timeout)
# The CLI as `qwen-vit-jax` runs it, without torch (the server never needs it: a faster start).
CLI = (
    "import sys; sys.modules.update(torch=None, transformers=None); "
    "from qwen_vit_jax.tools.cli import main; sys.exit(main(sys.argv[1:]))"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# ---- the server --------------------------------------------------------------------------------
@contextlib.contextmanager
def in_thread(settings, encoder=None, wait_ready: bool = True):
    """create_app(settings) on uvicorn in a thread of this process, as the CLI configures it, until
    its service is ready or has failed (or only until it listens: wait_ready=False): (url, app)."""
    import uvicorn

    from qwen_vit_jax import serve

    app = serve.create_app(settings, encoder=encoder)
    server = uvicorn.Server(serve.uvicorn_config(app, settings, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 300
        service = app.state.service
        while not (server.started and (service.ready or service.error or not wait_ready)):
            assert time.monotonic() < deadline, "the server was not ready within 300 s"
            time.sleep(0.02)
        yield f"http://{HOST}:{settings.port}", app
    finally:
        server.should_exit = True
        t.join(60)


@contextlib.asynccontextmanager
async def served(settings, encoder=None, ready_s: float = 30.0):
    """create_app(settings) behind an httpx client of its ASGI app (no socket), its lifespan
    running, until ready (within ready_s): (client, app)."""
    import httpx

    from qwen_vit_jax import serve

    app = serve.create_app(settings, encoder=encoder)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            for _ in range(round(ready_s / 0.05)):
                if (await client.get("/readyz")).status_code == 200:
                    break
                assert app.state.service.error is None, app.state.service.error
                await asyncio.sleep(0.05)
            yield client, app


class Server:
    """`qwen-vit-jax serve CKPT --port P ARGS` in a subprocess, ready (GET /readyz 200) on entry,
    stopped with SIGTERM (then SIGKILL after `stop_timeout` s) on exit; its output goes to `log`. It
    runs in `cwd` (default ours), which `python -c` puts first on sys.path: the tree whose
    qwen_vit_jax it imports when that has one."""

    def __init__(
        self, checkpoint, *args, log=None, ready_timeout: float = 180, stop_timeout: float = 30, env=None, cwd=None
    ):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.args = [str(checkpoint), "--host", HOST, "--port", str(self.port), *map(str, args)]
        self.log, self.ready_timeout, self.stop_timeout, self.env, self.cwd = log, ready_timeout, stop_timeout, env, cwd
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None

    def __enter__(self) -> Server:
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 (closed in stop)
        self._out = out
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLI, "serve", *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
        )
        try:
            self.wait_ready(self.ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """The process runs and GET /healthz answers 200."""
        import httpx

        if self.proc.poll() is not None:
            return False
        try:
            return httpx.get(self.url + "/healthz", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float) -> float:
        """Seconds until GET /readyz answers 200 (a RuntimeError if the process exits first or `timeout` passes)."""
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) before it was ready; log: {self.log}")
            try:
                if httpx.get(self.url + "/readyz", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server was not ready after {timeout} s; log: {self.log}")

    def stop(self) -> int | None:
        """SIGTERM, wait for the drain, SIGKILL past `stop_timeout`; the exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                for pid in self.worker_pids():
                    _kill(pid)
                self.proc.kill()
                self.proc.wait(10)
        if self.proc is not None:
            self.exit_code = self.proc.returncode
        if getattr(self, "_out", subprocess.DEVNULL) is not subprocess.DEVNULL:
            self._out.close()
            self._out = subprocess.DEVNULL
        return self.exit_code

    def rss_mb(self) -> float:
        """Resident memory of the server and all its processes (workers included), MB."""
        import psutil

        try:
            p = psutil.Process(self.pid)
            procs = [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0
        for q in procs:
            try:
                total += q.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**20

    def worker_pids(self) -> list[int]:
        """The server's preparation worker processes: its descendants that are Python processes
        started by multiprocessing (spawned), except multiprocessing's resource tracker."""
        import psutil

        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        pids = []
        for c in children:
            try:
                cmd = " ".join(c.cmdline())
            except psutil.NoSuchProcess:
                continue
            if "resource_tracker" not in cmd and ("multiprocessing" in cmd or "spawn_main" in cmd):
                pids.append(c.pid)
        return pids


def _kill(pid: int, sig: int = 9) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_worker(server: Server) -> int:
    """kill -9 one of the server's preparation workers; its pid (a RuntimeError when it has none)."""
    pids = server.worker_pids()
    if not pids:
        raise RuntimeError(f"the server (pid {server.pid}) has no preparation worker process to kill")
    _kill(pids[0])
    return pids[0]


def metrics(url: str) -> dict[str, float]:
    """GET /metrics as {"name{label=value,...}": value} (Prometheus text, the samples of every family)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# ---- request bodies ----------------------------------------------------------------------------
def jpeg(height: int, width: int, seed: int, quality: int = 90) -> bytes:
    """A JPEG photo-like image: a gradient with noise, its own per seed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    a = np.stack([x / width, y / height, (x + y) / (width + height)], -1) * rng.uniform(80, 255, 3)
    a += rng.normal(0, 12, a.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def body(images: list[bytes], **extra) -> bytes:
    """The JSON body of a POST /v1/embeddings of `images` (file bytes)."""
    return json.dumps({"input": [{"image": b64(im)} for im in images], **extra}).encode()


# ---- clients -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    """One request: HTTP status (UNANSWERED: no answer), seconds from send to answer, send time
    (monotonic), items answered (of a 200) and of them from the cache, the error's name when
    unanswered, the Retry-After header."""

    status: int
    seconds: float
    sent: float
    cached: int = 0
    items: int = 0
    error: str | None = None
    retry_after: str | None = None


async def _send(client, url: str, content: bytes, headers=None, timeout: float = 60.0) -> Result:
    import httpx

    t0 = time.monotonic()
    try:
        r = await client.post(
            url + ROUTE, content=content, headers=headers or {"Content-Type": "application/json"}, timeout=timeout
        )
    except httpx.HTTPError as e:
        return Result(UNANSWERED, time.monotonic() - t0, t0, error=type(e).__name__)
    cached = items = 0
    if r.status_code == 200:
        data = r.json()["data"]
        items, cached = len(data), sum(bool(d.get("cached")) for d in data)
    return Result(r.status_code, time.monotonic() - t0, t0, cached, items, retry_after=r.headers.get("retry-after"))


def _limits(n: int, keepalive: bool = True):
    """At most `n` connections; `keepalive=False`: a fresh connection per request (no reuse of a
    connection the server is closing, a race on the client's side of HTTP/1.1 keep-alive)."""
    import httpx

    return httpx.Limits(max_connections=n, max_keepalive_connections=n if keepalive else 0)


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, timeout: float = 60.0, budget: float = 600.0):
    """Send every body once with `concurrency` clients, each sending its next body when the last
    is answered (saturation). -> (results in body order, wall seconds); stops sending past `budget` s."""
    import httpx

    results: list[Result | None] = [None] * len(bodies)
    queue = iter(range(len(bodies)))
    t0 = time.monotonic()

    async with httpx.AsyncClient(limits=_limits(concurrency)) as client:

        async def one():
            for i in queue:
                if time.monotonic() - t0 > budget:
                    return
                results[i] = await _send(client, url, bodies[i], timeout=timeout)

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return [r for r in results if r is not None], time.monotonic() - t0


async def open_loop(
    url: str,
    bodies: list[bytes],
    rate: float,
    seed: int = 0,
    timeout: float = 60.0,
    max_in_flight: int = 1024,
    keepalive: bool = True,
):
    """Send the bodies at Poisson arrivals of `rate` per second whatever the answers (open loop),
    at most `max_in_flight` unanswered at once. -> (results in body order, wall seconds)."""
    import httpx

    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_in_flight)
    t0 = time.monotonic()
    async with httpx.AsyncClient(limits=_limits(max_in_flight, keepalive)) as client:

        async def one(b):
            async with gate:
                return await _send(client, url, b, timeout=timeout)

        tasks, due = [], t0
        for b in bodies:
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(b)))
        results = await asyncio.gather(*tasks)
    return list(results), time.monotonic() - t0


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q)) if len(values) else float("nan")


def statuses(results: list[Result]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in results:
        out[r.status] = out.get(r.status, 0) + 1
    return dict(sorted(out.items()))


# ---- malformed bodies --------------------------------------------------------------------------
def _png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims `width` x `height` (a decompression bomb's header)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, "PNG")
    raw = bytearray(buf.getvalue())
    ihdr = raw.index(b"IHDR")
    raw[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    raw[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(raw[ihdr : ihdr + 17])))
    return bytes(raw)


def malformed(n: int, seed: int = 0, good: bytes | None = None) -> list[tuple[str, bytes]]:
    """`n` bodies of POST /v1/embeddings that are each wrong in one way -> [(what is wrong, body)].

    None is a valid request: not JSON, JSON of the wrong shape, items of the wrong kind, image values
    that are no image (random bytes, truncated or corrupt files, paths and URLs, which the server must
    never open), a bomb's header, bad options. `good` (a valid JPEG) sits beside a bad item, so one
    bad item fails its request whatever its neighbours. Deterministic for a seed."""
    rng = random.Random(seed)
    good = good or jpeg(56, 56, 0)
    ok = {"image": b64(good)}

    def noise(k):
        return bytes(rng.getrandbits(8) for _ in range(k))

    def text(k):
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789{}[]:,\"'\\ ") for _ in range(k))

    def js(obj) -> bytes:
        return json.dumps(obj).encode()

    def truncated():
        return b64(good[: rng.randrange(1, len(good) - 1)])

    def corrupt():
        # a JPEG with its scan data overwritten: the header reads, the decode fails
        raw = bytearray(good)
        start = raw.index(b"\xff\xda")
        for i in range(start + 2, len(raw) - 2):
            raw[i] = 0xFF
        return b64(bytes(raw))

    bad_images = [
        lambda: b64(noise(rng.randrange(1, 300))),
        truncated,
        corrupt,
        lambda: b64(b"GIF89a" + noise(20)),
        lambda: "data:image/jpeg;base64," + b64(noise(40)),
        lambda: "data:image/png;base64,!!" + text(10),
        lambda: "".join(rng.choice("!@#$%^&*()") for _ in range(rng.randrange(1, 40))),  # not base64
        lambda: "",
        lambda: rng.choice(["/etc/passwd", "file:///etc/passwd", "http://127.0.0.1:9/x.jpg", "~/photo.jpg"]),
        lambda: b64(_png_claiming(rng.randrange(40_000, 70_000), rng.randrange(40_000, 70_000))),
        lambda: rng.choice([None, 3, 2.5, True, [], {}, ["a"], {"b64": "x"}]),
    ]

    cases = [
        ("not JSON", lambda: noise(rng.randrange(0, 200))),
        ("JSON cut short", lambda: body([good])[: rng.randrange(1, 60)]),
        ("not JSON text", lambda: text(rng.randrange(1, 80)).encode()),
        ("JSON not an object", lambda: js(rng.choice([[], [1, 2], 3, "input", None, True]))),
        ("no input", lambda: js({rng.choice(["inputs", "images", "data", "Input"]): [ok]})),
        ("input not a list", lambda: js({"input": rng.choice([ok, "abc", 3, None, True, {"0": ok}])})),
        ("input empty", lambda: js({"input": []})),
        ("item not an object", lambda: js({"input": [ok, rng.choice([1, "x", None, [], [ok]])]})),
        ("item without image or video", lambda: js({"input": [ok, {rng.choice(["img", "audio", "text"]): "x"}]})),
        ("item with image and video", lambda: js({"input": [{"image": ok["image"], "video": ok["image"]}]})),
        ("image not an image", lambda: js({"input": [ok, {"image": rng.choice(bad_images)()}]})),
        ("video not a video", lambda: js({"input": [{"video": b64(noise(rng.randrange(1, 400))), "fps": 2}]})),
        ("bad fps", lambda: js({"input": [{"video": b64(noise(64)), "fps": rng.choice([-1, 0, "fast", [], 1e9])}]})),
        ("bad encoding_format", lambda: js({"input": [ok], "encoding_format": rng.choice(["xml", "float16", 3, []])})),
        ("bad return_deepstack", lambda: js({"input": [ok], "return_deepstack": rng.choice([[], {}, "maybe", 7])})),
        ("deep nesting", lambda: b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("NaN and huge numbers", lambda: b'{"input": [{"image": NaN}], "x": 1e999999}'),
        ("bad UTF-8", lambda: b'{"input": [{"image": "\xff\xfe\xfa"}]}'),
    ]
    out = []
    for i in range(n):
        what, make = cases[i % len(cases)]
        out.append((what, make()))
    return out


async def fuzz(url: str, cases: list[tuple[str, bytes]], concurrency: int = 8, timeout: float = 30.0):
    """POST every body once, `concurrency` at a time -> [(what, Result)] in order."""
    import httpx

    results: list = [None] * len(cases)
    queue = iter(range(len(cases)))
    async with httpx.AsyncClient(limits=_limits(concurrency)) as client:

        async def one():
            for i in queue:
                results[i] = (cases[i][0], await _send(client, url, cases[i][1], timeout=timeout))

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return results


# ---- what the serve suites share ---------------------------------------------------------------
# The seeds of each phase's images: disjoint ranges, so no phase meets another's images (the cache).
SEEDS = {"warmup": 0, "saturation": 100_000, "latency": 200_000, "cache": 300_000, "overload": 400_000, "kill": 500_000}
TIMEOUT = 120.0  # s, the clients' limit: past the server's own (--timeout 60, a 504), so no answer is cut off


def phase_images(phase: str, n: int, sizes: int = 5) -> list[bytes]:
    """`n` JPEGs of a phase, their sizes cycling through the first `sizes` of the service's 5
    (grids.SERVE_SIDES; one size: batches of one shape per item count, the fewest programs)."""
    from benchmarks.workloads.grids import SERVE_SIDES

    base = SEEDS[phase]
    return [jpeg(*SERVE_SIDES[i % sizes], seed=base + i) for i in range(n)]


def request(image: bytes) -> bytes:
    """One image's request body, answered in base64 float32 as qvj.serve.Client asks (float lists
    are OpenAI's default: exact too, but ~2x the bytes and a JSON parse per float on the client)."""
    return body([image], encoding_format="base64")


def bench_dir():
    """The serve suites' folder in the bench cache: servers' logs, the shared compilation cache."""
    from benchmarks import common

    return common.cache() / "serve"


def server_env(tree=None) -> dict:
    """A benchmark server's (and its offline runs') environment: `tree`'s package first on PYTHONPATH
    (default the working tree's), the serve suites' persistent compilation cache, no torch needed."""
    from benchmarks import common

    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(bench_dir() / "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return common.rev_env(tree or common.ROOT, env)


class RssSampler:
    """The server's RSS (MB, its workers included) and its in-memory LRU's bytes (qvj_cache_bytes, MB:
    bounded by --cache-mb, so growth within it is the cache filling, not a leak) every `period` s in a
    thread, while in a `with` block: samples of (seconds, rss, lru); `summary()` the first, peak and last RSS."""

    def __init__(self, server: Server, period: float = 0.25):
        self.server, self.period, self.samples = server, period, []
        self._stop = threading.Event()

    def __enter__(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        import httpx

        while not self._stop.is_set():
            try:
                lru = metrics(self.server.url).get("qvj_cache_bytes", 0.0) / 2**20
            except (httpx.HTTPError, ValueError):  # no slot for /metrics (the attack holds them): RSS alone
                lru = float("nan")
            self.samples.append((time.monotonic() - t0, self.server.rss_mb(), lru))
            self._stop.wait(self.period)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        """RSS MB at the first sample, the peak, and now."""
        now = self.server.rss_mb()
        rss = [mb for _, mb, _ in self.samples] or [now]
        return {"before_mb": rss[0], "peak_mb": max(*rss, now), "after_mb": now}
