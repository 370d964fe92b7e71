"""The service behind the HTTP routes: load once, admit, look up, prepare, batch, answer.

    svc = Service(settings, metrics)
    svc.load()                                    # a thread: the encoder, declared sizes, workers
    results = await svc.embed(items, deepstack)   # [(Result, cached)] in order, or an errors.Error

An item's way: its key (its bytes' sha256, hashed with the request's parsing, and the settings
fingerprint of its kind and preprocessing, data/cache.py's recipe) -> the in-memory LRU -> an
identical item already in flight (encoded once, every waiter answered) -> the disk cache ->
a preparation worker (prepare.py: its header, then its pieces; videos have workers of their own, so
an image never waits behind a video's decoding) -> the batcher (batcher.py), a
piece at a time -> the caches. A video's pieces (frame groups of at most the patch budget) enter
the batcher as they are decoded, one of an item there at a time (the next decoded meanwhile): a
long video holds a few groups of memory and takes its turn on the device group by group beside
other requests. One
`preprocessing` serves the workers and the keys: what an item is prepared with is what its key says.
Before a frame is decoded, a video's frames are bounded in pixels (max_image_pixels, as an image),
in patches (the per-item bound), in count (max_frames: a longer clip is sampled down to it) and its
patches in all (max_video_patches). Admission counts items: past `max_queue` items admitted and not
answered a request is refused (`errors.Overloaded`) before anything of it is done, so memory stays
bounded under overload; a request that could never be admitted (more items than `max_queue`) is
`errors.TooLarge`, not a wait. A request that is cancelled (its client gone, its timeout) withdraws
its items: a queued item no other request waits for is dropped before it reaches a worker or the
device.

Failures are `qwen_vit_jax.errors`' kinds, raised where they are known (a worker's failure comes
back as its kind: `data.items.failed`); statuses.py alone turns them into HTTP. A failure of the
device call or of anything else of the server's own (a bad checkpoint: its pixel table
overflowing, a program that fails) is `errors.Internal`, never the client's: its details go to the
log. A disk cache that cannot be read or written is skipped (cache.DiskCache: a warning and a
count), never a failure of the item.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time

import numpy as np

from qwen_vit_jax import errors
from qwen_vit_jax.serve.cache import DiskCache, MemoryLRU, Result
from qwen_vit_jax.serve.prepare import END, Job, Limits, WorkerDied, preparation_pool
from qwen_vit_jax.serve.settings import Settings, flag

# A video's pieces in the batcher at once: one, the next decoded meanwhile, so that an item that
# arrives while a long video runs waits for one piece's call, not two (benchmarks: long_video suite).
IN_FLIGHT = 1

log = logging.getLogger("qwen_vit_jax.serve")


@dataclasses.dataclass(frozen=True)
class Input:
    """One input of a request, as sent (data/items.py's `Item` is an input prepared): kind "image"
    or "video", its bytes, a video's fps (None: the checkpoint's sampling), the bytes' sha256."""

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
        self.enc = self.pool = self.video_pool = self.batcher = self.disk = self.bound = self.preprocessing = None
        self.vllm = None  # the StoreWriter of --vllm-store (vllm/store.py)
        self.memory = MemoryLRU(settings.cache_bytes)
        self.queued = 0  # items admitted and not answered (what max_queue bounds)
        self._inflight: dict[tuple, _Flight] = {}
        self._weights = ""  # the checkpoint's fingerprint, with --cache (its keys name the checkpoint)
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
            from qwen_vit_jax.serve.bounds import ItemBound

            bound = ItemBound.of(enc.preprocessing, s.max_item_patches or budget, s.max_frames, s.oversize == "resize")
            self.bound, self.preprocessing = bound, bound.preprocessing  # the workers' and the keys' settings
            video_patches = s.max_video_patches or VIDEO_CALLS * budget
            limits = Limits(frame_pixels=s.max_image_pixels, frame_patches=bound.patches, video_patches=video_patches)
            if s.cache:
                from qwen_vit_jax.data.cache import ContentCache, checkpoint_fingerprint
                from qwen_vit_jax.weights.sources import resolve_source

                self._weights = checkpoint_fingerprint(resolve_source(s.checkpoint).path)
                self.disk = DiskCache(ContentCache(s.cache, self._weights, enc.dtype), self.metrics)
            from qwen_vit_jax.serve.batcher import Batcher

            self.pool = preparation_pool(self.preprocessing, limits, budget, s.workers, self.metrics.replaced.inc)
            # videos in workers of their own: an image never waits behind a long video's decoding
            videos = max(s.workers // 2, 1) if s.workers else 0
            self.video_pool = preparation_pool(self.preprocessing, limits, budget, videos, self.metrics.replaced.inc)
            self.pool.wait_started()
            self.video_pool.wait_started()
            self.batcher = Batcher(enc, budget, s.max_wait_ms / 1000, self.metrics)
            self.metrics.waiting.labels("prepare").set_function(lambda: self.pool.waiting() + self.video_pool.waiting())
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

    def key(self, item: Input) -> tuple[str, str]:
        """An item's cache key: (the settings fingerprint of its kind and preprocessing, its sha256)."""
        return _fingerprint(self._weights, self.enc.dtype, self.preprocessing, item.kind, item.fps), item.digest

    def close(self) -> None:
        """Encode what is queued, then stop the device thread and the workers."""
        self.ready = False
        if self.batcher is not None:
            self.batcher.close()
        for pool in (self.pool, self.video_pool):
            if pool is not None:
                pool.close()

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
    async def embed(self, items: list[Input], deepstack: bool) -> list[tuple[Result, bool]]:
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

    async def _one(self, item: Input, deepstack: bool) -> tuple[Result, bool]:
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

    async def _compute(self, item: Input, key: tuple[str, str], deepstack: bool) -> tuple[Result, bool]:
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
        pool = self.video_pool if item.kind == "video" else self.pool
        task = pool.submit(Job("", item.payload, item.kind, item.fps, item.digest))
        jobs: list = []
        landed: list[asyncio.Future] = []  # one asyncio future per job, all gathered: no failure left unretrieved
        try:
            head = await _next(task)
            m.stage.labels("prepare").observe(head.seconds)
            if head.error is not None:
                raise _refused(item.kind, head)
            if (over := self.bound.grid_over(item.kind, head.grid[0])) is not None:
                raise errors.TooLarge(over, limit="max_item_patches")
            waited = max(time.perf_counter() - t0 - head.seconds, 0.0)  # for a worker (and the trip)
            cfg = self.preprocessing.video if item.kind == "video" else self.preprocessing.image
            if item.kind == "video" and item.fps is not None:  # what prepare applied: Preprocessing.with_limits
                cfg = self.preprocessing.with_limits(fps=item.fps).video
            while (piece := await _next(task, end=None)) is not None:
                if getattr(piece, "error", None) is not None:  # a video that fails after some pieces
                    raise _refused(item.kind, piece)
                jobs.append(self._submit(piece, cfg, head, deepstack, waited))
                landed.append(asyncio.wrap_future(jobs[-1].future))
                if len(jobs) >= IN_FLIGHT:  # the next piece is decoded while this one waits and runs
                    await asyncio.wait([landed[-IN_FLIGHT]])
            r = _whole(head, await asyncio.gather(*landed))
        except asyncio.CancelledError:
            task.cancel()
            for j in jobs:
                self.batcher.cancel(j)
            raise
        except WorkerDied as e:
            raise errors.Unavailable(f"{e}; not prepared, send it again") from None
        except errors.Error:
            raise
        except Exception as e:  # noqa: BLE001 (the device call's failure: the server's, e.g. a checkpoint whose
            # pixel table overflows fails the finiteness check; never the client's 400)
            log.error("the device call failed for a %s (%s)", item.kind, item.digest[:12], exc_info=e)
            raise errors.Internal("the device call failed (an internal error, logged by the server)") from None
        finally:
            task.cancel()  # whatever ended it: its worker stops at its next piece
        self.memory.put(key, r)
        if self.disk is not None:  # fails soft (DiskCache): a warning and a count, never the answer's failure
            asyncio.get_running_loop().run_in_executor(None, self.disk.put, *key, r.grid, r.embedding, r.timestamps)
        return r, False

    def _submit(self, piece, cfg, head, deepstack: bool, waited: float):
        """A piece to the batcher: a Job of its rows (uint8 `Patches`) and grid."""
        from qwen_vit_jax.data.items import patches_of
        from qwen_vit_jax.serve.batcher import Job as Piece

        t = piece.grid[0]
        stamps = head.timestamps[piece.first_frame // cfg.temporal_patch_size :][:t]
        job = Piece(patches_of(piece.rows, cfg), np.asarray([piece.grid], np.int64), stamps, deepstack, waited)
        return self.batcher.submit(job)


VIDEO_CALLS = 16  # without max_video_patches: a video of at most this many budget-sized device calls


async def _next(task, end=RuntimeError):
    """The task's next message (its header first, then its pieces); `end` after the last one (the
    default: a RuntimeError, for a header that never came)."""
    message = await asyncio.wrap_future(task.next())
    if message is not END:
        return message
    if end is RuntimeError:
        raise RuntimeError("the preparation ended without an answer")
    return end


def _refused(kind: str, failed) -> errors.Error:
    """The error of an item its worker could not prepare: its kind, the error's own words."""
    if failed.failure == "missing":  # the server lacks a decoder: its fault, not the client's
        return errors.Internal(f"this server cannot read a {kind}: PyAV is not installed: {SERVE_EXTRA} carries it")
    if failed.failure is None:  # another library's error (a decoder's own): named with its type
        return errors.BadInput(f"cannot read this {kind}: {failed.error}")
    kinds = {k.kind: k for k in (errors.BadInput, errors.TooLarge, errors.Unsupported)}
    return kinds.get(failed.failure, errors.BadInput)(failed.message)


SERVE_EXTRA = "pip install 'qwen_vit_jax[serve]'"


def _whole(head, parts: list[Result]) -> Result:
    """An item's Result from its pieces' (in order): the header's grid and timestamps, the tokens
    (and deepstack features) concatenated."""
    if len(parts) == 1:
        r = parts[0]
        return Result(head.grid[0].copy(), r.embedding, head.timestamps, r.deepstack)
    tokens = np.concatenate([r.embedding for r in parts])
    deep = None
    if parts[0].deepstack is not None:
        deep = [np.concatenate([r.deepstack[k] for r in parts]) for k in range(len(parts[0].deepstack))]
    return Result(head.grid[0].copy(), tokens, head.timestamps, deep)


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
