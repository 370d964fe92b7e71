"""The service behind the HTTP routes: load once, admit, look up, prepare, batch, answer.

    svc = Service(settings, metrics)
    svc.load()                                    # a thread: the encoder, declared sizes, workers
    results = await svc.embed(items, deepstack)   # [(Result, cached)] in order, or an errors.Error

An item's way: its key (its bytes' sha256, hashed with the request's parsing, and the settings
fingerprint of its kind and preprocessing, data/cache.py's recipe) -> the in-memory LRU -> an
identical item already in flight (encoded once, every waiter answered) -> the disk cache ->
a preparation worker (prepare.py) -> the batcher (batcher.py) -> the caches. One `preprocessing`
serves the workers and the keys: what an item is prepared with is what its key says. Admission counts
items: past `max_queue` items admitted and not answered a request is refused (`errors.Overloaded`)
before anything of it is done, so memory stays bounded under overload; a request that could never be
admitted (more items than `max_queue`) is `errors.TooLarge`, not a wait. A request that is cancelled
(its client gone, its timeout) withdraws its items: a queued item no other request waits for is
dropped before it reaches a worker or the device.

Failures are `qwen_vit_jax.errors`' kinds, raised where they are known; statuses.py alone turns
them into HTTP. A failure of the device call or of anything else of the server's own (a bad
checkpoint: its pixel table overflowing, a program that fails) is `errors.Internal`, never the
client's: its details go to the log. A disk cache that cannot be read or written is skipped
(cache.DiskCache: a warning and a count), never a failure of the item.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time

from qwen_vit_jax import errors
from qwen_vit_jax.serve.cache import DiskCache, MemoryLRU, Result
from qwen_vit_jax.serve.prepare import PreparePool, Task, WorkerDied
from qwen_vit_jax.serve.settings import Settings, flag

log = logging.getLogger("qwen_vit_jax.serve")


@dataclasses.dataclass(frozen=True)
class Item:
    """One input of a request: kind "image" or "video", its bytes, a video's fps (None: the
    checkpoint's sampling), the bytes' sha256."""

    kind: str
    payload: bytes
    digest: str
    fps: float | None = None


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
        self.vllm = None  # the StoreWriter of --vllm-store (vllm/store.py)
        self.memory = MemoryLRU(settings.cache_bytes)
        self.queued = 0  # items admitted and not answered (what max_queue bounds)
        self._inflight: dict[tuple, _Flight] = {}
        self._weights = ""  # the checkpoint's fingerprint, with --cache (its keys name the checkpoint)
        self._unpack = None  # a worker's dict -> Patches, grid, timestamps (data/pipeline.Unpack)
        self._closed = threading.Event()

    # ---- life ----------------------------------------------------------------------------------
    def load(self, encoder=None) -> None:
        """Load the checkpoint (or take `encoder`), compile and declare the declared sizes, start the
        workers and the device thread, open the disk cache; then `ready`."""
        s = self.settings
        try:
            enc = encoder if encoder is not None else _load_encoder(s)
            budget = s.max_batch_patches or enc.max_batch_patches
            if s.max_item_patches is not None and s.max_item_patches > budget:  # Settings checks an explicit one
                raise ValueError(
                    f"{flag('max_item_patches')} {s.max_item_patches} is more than the checkpoint's patch budget "
                    f"{budget} ({flag('max_batch_patches')}): an item could never fit one device call"
                )
            if s.declare:  # their tight buckets: an item of such a size alone runs as encode runs it
                enc.warmup([[list(g)] for g in s.declare], tight=True, uint8=True)
            if s.warmup_batches:
                self._warm(enc, budget)
            from qwen_vit_jax.data.pipeline import Unpack
            from qwen_vit_jax.serve.bounds import ItemBound

            bound = ItemBound.of(enc.preprocessing, s.max_item_patches or budget, s.max_frames, s.oversize == "resize")
            self.bound, self.preprocessing = bound, bound.preprocessing  # the workers' and the keys' settings
            self._unpack = Unpack(self.preprocessing.image, self.preprocessing.video)
            if s.cache:
                from qwen_vit_jax.data.cache import ContentCache, checkpoint_fingerprint
                from qwen_vit_jax.weights.sources import resolve_source

                self._weights = checkpoint_fingerprint(resolve_source(s.checkpoint).path)
                self.disk = DiskCache(ContentCache(s.cache, self._weights, enc.dtype), self.metrics)
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
            if s.vllm_store:
                from qwen_vit_jax.vllm.flags import writer

                self.vllm = writer(s.vllm_store, s.vllm_ids, s.vllm_model, enc.cfg)
            self.enc = enc
        except Exception as e:  # noqa: BLE001 (reported by /readyz and the log; the process stays up)
            self.error = f"{type(e).__name__}: {e}"
            log.error("loading %s failed: %s", s.checkpoint, self.error)
            raise
        self.ready = True
        log.info("ready: %s (%s, %s)", s.checkpoint, enc.cfg.variant, enc.dtype)

    def _warm(self, enc, budget: int) -> None:
        """Compile (or load from the compilation cache) the batch shapes the declared sizes form
        under the budget (runtime/batching.warm_batches), before ready; logs how many and how long.
        A batch never holds more than max_queue items (admission), which bounds its rows too."""
        from qwen_vit_jax.runtime.batching import Grouping, warm_batches

        s = self.settings
        if not s.declare:
            log.info("warm-up: no declared sizes (--declare): batch shapes compile as traffic meets them")
            return
        t0 = time.perf_counter()
        most = min(budget, s.max_queue * max(t * h * w for t, h, w in s.declare))
        batches = warm_batches(s.declare, Grouping(most, batched=True), enc.policy)
        before = enc.compile_count
        enc.warmup(batches, uint8=True, batched=True)
        log.info(
            "warm-up: %d batch shapes of the declared sizes %s (%d programs compiled or loaded) in %.1f s",
            len(batches),
            ",".join("x".join(map(str, g)) for g in s.declare),
            enc.compile_count - before,
            time.perf_counter() - t0,
        )

    def key(self, item: Item) -> tuple[str, str]:
        """An item's cache key: (the settings fingerprint of its kind and preprocessing, its sha256)."""
        return _fingerprint(self._weights, self.enc.dtype, self.preprocessing, item.kind, item.fps), item.digest

    def close(self) -> None:
        """Encode what is queued, then stop the device thread and the workers."""
        self.ready = False
        if self.batcher is not None:
            self.batcher.close()
        if self.pool is not None:
            self.pool.close()

    # ---- admission -----------------------------------------------------------------------------
    def check_room(self) -> None:
        """Overloaded while the queue is full (a request is then refused before its body is read)."""
        if self.queued >= self.settings.max_queue:
            after = self._retry_after()
            raise errors.Overloaded(f"the queue is full; retry after {after} s", retry_after=after, limit="max_queue")

    def _retry_after(self) -> int:
        return max(1, round(self.settings.max_wait_ms / 1000 + 1))

    def admit(self, n: int) -> None:
        """Count `n` items in; Overloaded while the queue is too full for them, TooLarge when it
        never could hold them (a wait would not help)."""
        s = self.settings
        if n > s.max_queue:
            raise errors.TooLarge(f"{n} items in one request; the queue holds {s.max_queue}", limit="max_queue")
        if self.queued + n > s.max_queue:
            after = self._retry_after()
            raise errors.Overloaded(f"the queue is full; retry after {after} s", retry_after=after, limit="max_queue")
        self.queued += n
        self.metrics.queue.set(self.queued)

    def release(self, n: int) -> None:
        self.queued -= n
        self.metrics.queue.set(self.queued)

    # ---- requests ------------------------------------------------------------------------------
    async def embed(self, items: list[Item], deepstack: bool) -> list[tuple[Result, bool]]:
        """Every item's (Result, cached), in order. The first item that fails raises its error
        (an errors.Error, its message naming it: `input[i]: ...`) and withdraws the others;
        cancelling withdraws them all."""
        deepstack = deepstack or (self.vllm is not None and self.vllm.needs_deepstack)  # the store holds them
        tasks = [asyncio.ensure_future(self._one(it, deepstack)) for it in items]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for i, t in enumerate(tasks):
                if t in done and t.exception() is not None:
                    e = t.exception()
                    if not isinstance(e, errors.Error):
                        log.error("input[%d] failed", i, exc_info=e)  # the details stay in the log
                        e = errors.Internal("an internal error (logged by the server)")
                    raise e.at(f"input[{i}]") from None
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, item: Item, deepstack: bool) -> tuple[Result, bool]:
        key = self.key(item)
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
            flight = self._inflight[fkey] = _Flight(asyncio.ensure_future(self._compute(item, key, deepstack)))
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

    async def _compute(self, item: Item, key: tuple[str, str], deepstack: bool) -> tuple[Result, bool]:
        m = self.metrics
        if self.disk is not None and not deepstack:
            row = await asyncio.to_thread(self.disk.get, *key)
            if row is not None:
                m.cache.labels("disk").inc()
                r = Result(*row)
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
            raise errors.Unavailable(f"{e}; not prepared, send it again") from None
        m.stage.labels("prepare").observe(d.get("seconds", 0.0))
        waited = max(time.perf_counter() - t0 - d.get("seconds", 0.0), 0.0)  # for a worker (and the trip)
        if d.get("missing"):  # the server lacks a decoder: its fault, not the client's
            raise errors.Internal(f"this server cannot read a {item.kind}: {d['error']}")
        if d.get("error"):
            raise errors.BadInput(f"cannot read this {item.kind}: {d['error']}")
        if (over := self.bound.grid_over(item.kind, d["grid"])) is not None:
            raise errors.TooLarge(over, limit="max_item_patches")
        from qwen_vit_jax.serve.batcher import Job

        job = Job(*self._unpack(d), deepstack, waited)
        self.batcher.submit(job)
        try:
            r = await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            self.batcher.cancel(job)
            raise
        except errors.Error:
            raise
        except Exception as e:  # noqa: BLE001 (the device call's failure: the server's, e.g. a checkpoint whose
            # pixel table overflows fails the finiteness check; never the client's 400)
            log.error("the device call failed for a %s (%s)", item.kind, item.digest[:12], exc_info=e)
            raise errors.Internal("the device call failed (an internal error, logged by the server)") from None
        self.memory.put(key, r)
        if self.disk is not None:  # fails soft (DiskCache): a warning and a count, never the answer's failure
            asyncio.get_running_loop().run_in_executor(None, self.disk.put, *key, r.grid, r.embedding, r.timestamps)
        return r, False


def _load_encoder(s: Settings):
    """VisionEncoder.from_pretrained on this process's devices (frames balanced across several)."""
    import jax

    from qwen_vit_jax.runtime.encoder import VisionEncoder

    return VisionEncoder.from_pretrained(
        s.checkpoint, dtype=s.dtype, compilation_cache_dir=s.compile_cache, devices=jax.local_devices()
    )


@functools.lru_cache(maxsize=256)
def _fingerprint(weights: str, dtype: str, preprocessing, kind: str, fps: float | None) -> str:
    """data/cache.py's settings fingerprint of an item of `kind` prepared with `preprocessing` and a
    request's fps (prepare.py applies it the same way: Preprocessing.with_limits)."""
    from qwen_vit_jax.data.cache import fingerprint

    if kind == "video" and fps is not None:
        preprocessing = preprocessing.with_limits(fps=fps)
    return fingerprint(weights, dtype, preprocessing, kind)
