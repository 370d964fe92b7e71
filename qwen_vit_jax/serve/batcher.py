"""Dynamic batching: prepared items of concurrent requests -> one device call per batch, on a device
thread of its own. The batcher keeps the queue, the wait, the futures and the compile thread; which
items share a call is runtime/batching.py's `Grouping`, how a batch is planned, compiled and run the
encoder's (`prepare_batch`, `ready`, `compile`, `run`).

    b = Batcher(enc, budget=16384, max_wait_s=0.005, metrics=m)
    job = b.submit(Job(patches, grid, deepstack=False))   # job.future -> cache.Result
    ...
    b.close()                                            # after what is queued

The models are HF's text-embeddings-inference router (a queue, a max wait, batches cut by a token
budget) and infinity's batch queue; ours cuts by patches. A batch is the oldest waiting item plus
the later items, in arrival order, that the grouping admits (one pixel form, frame classes close)
and that fit the patch budget. It leaves when the budget is full (the next such item would not fit)
or when its oldest item has waited `max_wait_s`; items that arrived while the previous batch ran
have waited already, so under load batches leave back to back and the device never idles while
items wait.

A batch is one `enc.prepare_batch` (planned once) + `enc.run`: several items run in a batch plan,
whose bucket follows the rung and the frame class, not the mix of sizes, so random batches compile
a bounded number of programs; an item's embedding is what `encode_images` gives within padding
invariance. An item alone runs as `encode` runs it: bit for bit what it gives alone (its declared
size's tight buckets too). An item larger than the budget runs alone.

The device does not wait for a new batch shape: its programs compile on a thread of its own while
the batch's longest leading part with compiled programs runs (`prepare_batch(compiled=True)`; else
its head alone, whose own program is compiled as `encode` would compile it), and the rest waits
for the next batch.

A batch whose call fails is retried item by item: the item that fails fails alone (the service
reports it as its own failure, errors.Internal: a 500 for its request), its neighbours are answered.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time

import numpy as np

from qwen_vit_jax.plan import Patches
from qwen_vit_jax.runtime.batching import Grouping, Shape, shape_of
from qwen_vit_jax.serve.cache import Result

log = logging.getLogger("qwen_vit_jax.serve")


@dataclasses.dataclass(eq=False)
class Job:
    """One prepared piece (an image's rows, or a group of a video's frames: service.py joins a
    video's pieces): uint8 `Patches` [N, S, p, p, C], grid int64 [1, 3], timestamps float64 [t],
    whether its request wants deepstack features. `future` gets its `Result`."""

    patches: Patches
    grid: np.ndarray
    timestamps: np.ndarray
    deepstack: bool = False
    waited: float = 0.0  # seconds it queued before this (for a worker): the queue stage counts both
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    enqueued: float = dataclasses.field(default_factory=time.perf_counter)

    @functools.cached_property  # read on every pass over the queue
    def shape(self) -> Shape:
        """What the grouping reads of it (runtime/batching.py)."""
        return shape_of(self.patches, self.grid)


class Batcher:
    """Jobs -> batches -> `enc.run`, on one device thread (see the module docstring)."""

    def __init__(self, enc, budget: int, max_wait_s: float, metrics=None):
        self.grouping = Grouping(budget, batched=True)  # a ValueError for a budget that is not positive
        self.enc, self.budget, self.max_wait_s, self.metrics = enc, budget, max_wait_s, metrics
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self.batches = 0  # device calls made
        # new batch shapes compile here, off the device thread (one at a time: the encoder's lock)
        self._compiles = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qvj-compile")
        self._compiling: set[tuple] = set()  # prepared.program_keys handed to it
        self._thread = threading.Thread(target=self._loop, name="qvj-device", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        with self._cond:
            if self._closing:
                raise RuntimeError("the batcher is closed")
            self._pending.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> bool:
        """Drop a job that has not left for the device yet (True), else False (it runs; its answer
        is still cached)."""
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:
                return False
        job.future.cancel()
        return True

    def waiting(self) -> int:
        with self._cond:
            return len(self._pending)

    def close(self, timeout: float | None = None) -> None:
        """Encode what is queued, then stop the device thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        self._compiles.shutdown(wait=False, cancel_futures=True)

    # ---- the device thread -------------------------------------------------------------------
    def _planned(self, batch: list[Job]):
        """(the jobs that leave now, their prepared call): the batch planned once if its programs
        are compiled; else (its programs queued for the compile thread) its longest leading part
        whose programs are, or its head alone. (batch, None) when planning fails: a bad item, which
        `_run` tries alone."""
        enc, items = self.enc, [(j.patches, j.grid) for j in batch]
        try:
            prepared = enc.prepare_batch(items)
            if len(batch) > 1 and not enc.ready(prepared):
                self._compile(prepared)
                prepared = enc.prepare_batch(items, compiled=True)
        except ValueError:
            return batch, None
        return batch[: len(prepared.items)], prepared

    def _compile(self, prepared) -> None:
        """Compile a batch's programs on the compile thread (once, however often asked)."""
        if prepared.program_keys not in self._compiling:
            self._compiling.add(prepared.program_keys)
            self._compiles.submit(self.enc.compile, prepared).add_done_callback(_log_failure)

    def _next_batch(self):
        with self._cond:
            while True:
                if not self._pending:
                    if self._closing:
                        return None
                    self._cond.wait()
                    continue
                batch, full = self.grouping.take(self._pending, lambda job: job.shape)
                wait = self._pending[0].enqueued + self.max_wait_s - time.perf_counter()
                if full or wait <= 0 or self._closing:
                    batch, prepared = self._planned(batch)
                    for job in batch:
                        self._pending.remove(job)
                    return batch, prepared
                self._cond.wait(wait)

    def _loop(self) -> None:
        while (taken := self._next_batch()) is not None:
            batch, prepared = taken
            running = [j for j in batch if j.future.set_running_or_notify_cancel()]
            if running:
                self._run(running, prepared if len(running) == len(batch) else None)

    def _run(self, batch: list[Job], prepared=None) -> None:
        m = self.metrics
        now = time.perf_counter()
        if m is not None:
            for job in batch:
                m.stage.labels("queue").observe(job.waited + now - job.enqueued)
        try:
            results = self._encode(batch, prepared)
        except Exception as e:  # noqa: BLE001 (any failure of the call: the items are tried alone)
            if len(batch) == 1:
                batch[0].future.set_exception(e)
                return
            for job in batch:
                try:
                    (r,) = self._encode([job])
                except Exception as e1:  # noqa: BLE001 (this item's own failure, handed to its request)
                    job.future.set_exception(e1)
                else:
                    job.future.set_result(r)
            return
        for job, r in zip(batch, results):
            job.future.set_result(r)

    def _encode(self, batch: list[Job], prepared=None) -> list[Result]:
        """One device call for the batch (planned now unless `prepared`), split per job."""
        enc, m = self.enc, self.metrics
        deepstack = any(j.deepstack for j in batch)
        t0 = time.perf_counter()
        if prepared is None:
            prepared = enc.prepare_batch([(j.patches, j.grid) for j in batch])
        out = enc.run(prepared, deepstack)  # an item alone: compiled now if new, as encode would
        tokens, features = out if deepstack else (out, None)
        self.batches += 1
        if m is not None:
            m.stage.labels("device").observe(time.perf_counter() - t0)
            rows, real = prepared.padded_rows, sum(len(j.patches) for j in batch)
            m.batch_items.observe(len(batch))
            m.batch_fill.observe(min(real / self.budget, 1.0))
            m.batch_padding.observe((rows - real) / rows if rows else 0.0)
        own = len(batch) > 1  # each item its own rows: a cached result must not hold the whole batch
        embs = [e.copy() if own else e for e in prepared.split(tokens)]
        per_layer = (
            [[x.copy() if own else x for x in prepared.split(f)] for f in features] if features is not None else None
        )
        return [
            Result(
                j.grid[0].copy(),
                e,
                j.timestamps,
                [layer[i] for layer in per_layer] if (j.deepstack and per_layer is not None) else None,
            )
            for i, (j, e) in enumerate(zip(batch, embs))
        ]


def _log_failure(future: concurrent.futures.Future) -> None:
    """A batch shape that failed to compile is logged; its batches keep running their heads alone."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("compiling a batch shape failed: %r", future.exception())
