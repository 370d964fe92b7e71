"""The service behind the HTTP routes: load once, admit, look up, prepare, batch, answer.

    svc = Service(settings, metrics)
    svc.load()                                    # a thread: the encoder, declared sizes, workers
    results = await svc.embed(items, deepstack)   # [(Result, cached)] in order, or Failure

An item's way: its bytes' sha256 (hashed with the request's parsing) -> the in-memory LRU -> an
identical item already in flight (encoded once, every waiter answered) -> the disk cache ->
a preparation worker (prepare.py) -> the batcher (batcher.py) -> the caches. Admission counts
items: past `max_queue` items admitted and not answered a request is refused (`Busy`, a 429) before
anything of it is done, so memory stays bounded under overload. A request that is cancelled (its
client gone, its timeout) withdraws its items: a queued item no other request waits for is dropped
before it reaches a worker or the device.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import numpy as np

from qwen_vit_jax.serve.cache import DiskCache, MemoryLRU, Result
from qwen_vit_jax.serve.prepare import PreparePool, Task, WorkerDied
from qwen_vit_jax.serve.settings import Settings

log = logging.getLogger("qwen_vit_jax.serve")


class Failure(Exception):
    """An item (or request) that cannot be answered: its HTTP status and a message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Busy(Exception):
    """The queue is full: a 429 with Retry-After `retry_after` seconds."""

    def __init__(self, retry_after: int = 1):
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


@dataclasses.dataclass(frozen=True)
class Item:
    """One input of a request: kind "image" or "video", its bytes, a video's fps (None: the
    checkpoint's sampling), the bytes' sha256."""

    kind: str
    payload: bytes
    digest: str
    fps: float | None = None

    @property
    def key(self) -> tuple:
        return (self.digest, self.fps if self.kind == "video" else None)


class _Flight:
    """An item being computed, and how many requests wait for it."""

    def __init__(self, task: asyncio.Task):
        self.task, self.refs = task, 1


class Service:
    """See the module docstring. `ready` once `load` has finished; `error` if it failed."""

    def __init__(self, settings: Settings, metrics):
        self.settings, self.metrics = settings, metrics
        self.ready, self.error = False, None
        self.enc = self.pool = self.batcher = self.disk = self.bound = self.preprocessing = None
        self.memory = MemoryLRU(settings.cache_bytes)
        self.queued = 0  # items admitted and not answered (what max_queue bounds)
        self._inflight: dict[tuple, _Flight] = {}
        self._tables: dict = {}
        self._closed = threading.Event()

    # ---- life ----------------------------------------------------------------------------------
    def load(self, encoder=None) -> None:
        """Load the checkpoint (or take `encoder`), compile and declare the declared sizes, start the
        workers and the device thread, open the disk cache; then `ready`."""
        s = self.settings
        try:
            enc = encoder if encoder is not None else _load_encoder(s)
            if s.declare:  # tight buckets on one device; several devices compile the mesh's rungs
                enc.warmup([[list(g)] for g in s.declare], tight=len(enc.devices) == 1, uint8=True)
            from qwen_vit_jax.preprocess.images import pixel_table
            from qwen_vit_jax.serve.bounds import ItemBound

            budget = s.max_batch_patches or enc.max_batch_patches
            bound = ItemBound.of(enc.preprocessing, s.max_item_patches or budget, s.max_frames, s.oversize == "resize")
            self.bound, self.preprocessing = bound, bound.preprocessing  # the workers' and the disk cache's
            self._tables = {
                "image": (pixel_table(enc.preprocess), enc.preprocess.temporal_patch_size),
                "video": (pixel_table(enc.video_preprocess), enc.video_preprocess.temporal_patch_size),
            }
            if s.cache:
                from qwen_vit_jax.data.cache import checkpoint_fingerprint
                from qwen_vit_jax.weights.sources import resolve_source

                weights = checkpoint_fingerprint(resolve_source(s.checkpoint).path)
                p = self.preprocessing
                self.disk = DiskCache(s.cache, weights, enc.dtype, p.image, p.video)
            from qwen_vit_jax.serve.batcher import Batcher

            p = self.preprocessing
            self.pool = PreparePool(p.image, p.video, p.variant, s.workers, on_replace=self.metrics.replaced.inc)
            self.pool.wait_started()
            self.batcher = Batcher(enc, budget, s.max_wait_ms / 1000, self.metrics)
            self.metrics.waiting.labels("prepare").set_function(self.pool.waiting)
            self.metrics.waiting.labels("batch").set_function(self.batcher.waiting)
            self.metrics.cache_bytes.set_function(lambda: self.memory.nbytes)
            self.metrics.programs.set_function(lambda: enc.compile_count)
            self.metrics.compile_seconds.set_function(lambda: sum(enc.compile_seconds.values()))
            self.enc = enc
        except Exception as e:  # noqa: BLE001 (reported by /readyz and the log; the process stays up)
            self.error = f"{type(e).__name__}: {e}"
            log.error("loading %s failed: %s", s.checkpoint, self.error)
            raise
        self.ready = True
        log.info("ready: %s (%s, %s)", s.checkpoint, enc.cfg.variant, enc.dtype)

    def close(self) -> None:
        """Encode what is queued, then stop the device thread and the workers."""
        self.ready = False
        if self.batcher is not None:
            self.batcher.close()
        if self.pool is not None:
            self.pool.close()

    # ---- admission -----------------------------------------------------------------------------
    def full(self) -> bool:
        return self.queued >= self.settings.max_queue

    def admit(self, n: int) -> None:
        if self.queued + n > self.settings.max_queue:
            raise Busy(retry_after=max(1, round(self.settings.max_wait_ms / 1000 + 1)))
        self.queued += n
        self.metrics.queue.set(self.queued)

    def release(self, n: int) -> None:
        self.queued -= n
        self.metrics.queue.set(self.queued)

    # ---- requests ------------------------------------------------------------------------------
    async def embed(self, items: list[Item], deepstack: bool) -> list[tuple[Result, bool]]:
        """Every item's (Result, cached), in order. The first item that fails raises Failure naming
        it (`input[i]: ...`) and withdraws the others; cancelling withdraws them all."""
        tasks = [asyncio.ensure_future(self._one(it, deepstack)) for it in items]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for i, t in enumerate(tasks):
                if t in done and t.exception() is not None:
                    e = t.exception()
                    if isinstance(e, Failure):
                        raise Failure(e.status, f"input[{i}]: {e.message}") from None
                    log.error("input[%d] failed", i, exc_info=e)  # the details stay in the log
                    raise Failure(500, f"input[{i}]: an internal error (logged by the server)") from e
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, item: Item, deepstack: bool) -> tuple[Result, bool]:
        key = item.key
        r = self.memory.get(key, deepstack)
        if r is not None:
            self.metrics.cache.labels("memory").inc()
            return r, True
        fkey = (*key, deepstack)
        flight = self._inflight.get(fkey)
        joined = flight is not None
        if joined:  # the same bytes in flight: wait for that one
            self.metrics.cache.labels("inflight").inc()
            flight.refs += 1
        else:
            flight = self._inflight[fkey] = _Flight(asyncio.ensure_future(self._compute(item, deepstack)))
            flight.task.add_done_callback(lambda _t, f=flight: self._land(fkey, f))
        try:
            r, cached = await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            flight.refs -= 1
            if flight.refs == 0:  # nobody else waits: drop it wherever it is
                self._land(fkey, flight)  # a later request for the same bytes starts afresh
                flight.task.cancel()
            raise
        return r, cached or joined

    def _land(self, fkey: tuple, flight: _Flight) -> None:
        """`flight` is no longer in flight (done, or dropped by its last waiter)."""
        if self._inflight.get(fkey) is flight:
            del self._inflight[fkey]

    async def _compute(self, item: Item, deepstack: bool) -> tuple[Result, bool]:
        m, key = self.metrics, item.key
        if self.disk is not None and not deepstack:
            r = await asyncio.to_thread(self.disk.get, key)
            if r is not None:
                m.cache.labels("disk").inc()
                self.memory.put(key, r)
                return r, True
        m.cache.labels("miss").inc()
        t0 = time.perf_counter()
        task = self.pool.submit(Task(item.kind, item.payload, item.fps))
        try:
            d = await asyncio.wrap_future(task.future)
        except asyncio.CancelledError:
            task.cancelled = True
            raise
        except WorkerDied as e:
            raise Failure(503, f"{e}; not prepared, send it again") from None
        m.stage.labels("prepare").observe(d.get("seconds", 0.0))
        waited = max(time.perf_counter() - t0 - d.get("seconds", 0.0), 0.0)  # for a worker (and the trip)
        if d.get("missing"):  # the server lacks a decoder: its fault, not the client's
            raise Failure(501, f"this server cannot read a {item.kind}: {d['error']}")
        if d.get("error"):
            raise Failure(400, f"cannot read this {item.kind}: {d['error']}")
        if (over := self.bound.grid_over(item.kind, d["grid"])) is not None:
            raise Failure(413, over)
        from qwen_vit_jax.plan.contract import Patches
        from qwen_vit_jax.serve.batcher import Job

        table, t = self._tables[item.kind]
        job = Job(
            Patches(np.asarray(d["data"]), table, t),
            np.array([d["grid"]], np.int64),
            np.array(d["timestamps"], np.float64),
            deepstack,
            waited,
        )
        self.batcher.submit(job)
        try:
            r = await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            self.batcher.cancel(job)
            raise
        except ValueError as e:
            raise Failure(400, str(e)) from None
        self.memory.put(key, r)
        if self.disk is not None:
            asyncio.get_running_loop().run_in_executor(None, self._disk_put, key, r)
        return r, False

    def _disk_put(self, key: tuple, r: Result) -> None:
        try:
            self.disk.put(key, r)
        except OSError as e:  # a full or read-only disk: served all the same, logged
            log.warning("cache write failed: %s", e)


def _load_encoder(s: Settings):
    """VisionEncoder.from_pretrained on this process's devices (frames balanced across several)."""
    import jax

    from qwen_vit_jax.runtime.encoder import VisionEncoder

    devices = jax.local_devices()
    return VisionEncoder.from_pretrained(
        s.checkpoint,
        dtype=s.dtype,
        compilation_cache_dir=s.compile_cache,
        devices=devices if len(devices) > 1 else None,
    )
