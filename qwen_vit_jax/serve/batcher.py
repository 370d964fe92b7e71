"""Dynamic batching: prepared items of concurrent requests -> one device call per batch, on a device
thread of its own.

    b = Batcher(enc, budget=16384, max_wait_s=0.005, metrics=m)
    job = b.submit(Job(patches, grid, deepstack=False))   # job.future -> cache.Result
    ...
    b.close()                                            # after what is queued

The models are HF's text-embeddings-inference router (a queue, a max wait, batches cut by a token
budget) and infinity's batch queue; ours cuts by patches. A batch is the oldest waiting item plus
the later items, in arrival order, of the same pixel form (same Patches table and frames per row)
that fit the patch budget and whose widest frames are of the head's frame class or up to 4x
smaller (plan.frame_class: the key window of a batch plan follows its largest frames, which much
smaller ones would pay for). It leaves when the budget is full (the next such item would not fit)
or when its oldest item has waited `max_wait_s`; items that arrived while the previous batch ran
have waited already, so under load batches leave back to back and the device never idles while
items wait.

A batch is one `enc.prepare(..., batched=True)` + `enc.run`: several items run in a batch plan,
whose bucket follows the rung and the frame class, not the mix of sizes, so random batches compile
a bounded number of programs (plan/choice.py); an item's embedding is what `encode_images` gives
within padding invariance. An item alone runs as `encode` runs it: bit for bit what it gives
alone (its declared size's tight buckets too). An item larger than the budget runs alone.

The device does not wait for a new batch shape: its program compiles on a thread of its own while
the batch's longest prefix with a compiled program runs (else its head alone, whose own program
is compiled as `encode` would compile it), and the rest waits for the next batch.

A batch whose call fails is retried item by item: the bad item fails alone (ValueError: a 400 for
its request), its neighbours are answered.
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

from qwen_vit_jax.plan import Patches, batch_rows, frame_class
from qwen_vit_jax.serve.cache import Result

log = logging.getLogger("qwen_vit_jax.serve")


@dataclasses.dataclass(eq=False)
class Job:
    """One prepared item: uint8 `Patches` [N, S, p, p, C], grid int64 [1, 3], timestamps float64 [t],
    whether its request wants deepstack features. `future` gets its `Result`."""

    patches: Patches
    grid: np.ndarray
    timestamps: np.ndarray
    deepstack: bool = False
    waited: float = 0.0  # seconds it queued before this (for a worker): the queue stage counts both
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    enqueued: float = dataclasses.field(default_factory=time.perf_counter)

    @functools.cached_property  # read on every pass over the queue
    def frame_class(self) -> int:
        """plan.frame_class of its widest frame: a batch plan's key window follows its largest one."""
        return frame_class(int((self.grid[:, 1] * self.grid[:, 2]).max()))

    @functools.cached_property
    def form(self) -> tuple:
        """What must agree within one call: the pixel table and the frames per row."""
        return (self.patches.table.tobytes(), self.patches.frames_per_patch, self.patches.temporal_patch_size)


class Batcher:
    """Jobs -> batches -> `enc.encode`, on one device thread (see the module docstring)."""

    def __init__(self, enc, budget: int, max_wait_s: float, metrics=None):
        if budget <= 0:
            raise ValueError(f"the patch budget must be positive, got {budget}")
        self.enc, self.budget, self.max_wait_s, self.metrics = enc, budget, max_wait_s, metrics
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self.batches = 0  # device calls made
        # new batch shapes compile here, off the device thread (one at a time: Programs' lock)
        self._compiles = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qvj-compile")
        self._compiling: set[tuple] = set()  # (bucket, frames) handed to it
        self._batch_plans = enc.mesh is None  # a mesh balances a batch's frames over its devices instead
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
    def _take(self) -> tuple[list[Job], bool]:
        """The batch the oldest job would leave in now, and whether it is full."""
        head = self._pending[0]
        form, top, batch, total = head.form, head.frame_class, [], 0
        for job in self._pending:
            if job.form != form or not top <= 4 * job.frame_class <= 4 * top:
                continue
            n = len(job.patches)
            if batch and total + n > self.budget:
                return batch, True
            batch.append(job)
            total += n
        return batch, total >= self.budget

    def _compiled(self, batch: list[Job]) -> list[Job]:
        """The batch if its program is compiled; else (its program queued for the compile thread)
        its longest prefix whose program is, or the head alone: the device does not wait for a new
        batch shape (an item alone waits for its own program, as encode would)."""
        enc, frames = self.enc, batch[0].patches.frames_per_patch
        sizes = np.cumsum([len(j.patches) for j in batch])
        if len(batch) < 2 or not self._batch_plans or sizes[-1] > enc.policy.max_patches:
            return batch  # planned as encode plans it
        widest = np.maximum.accumulate([j.frame_class for j in batch])
        seen = set()
        for k in range(len(batch), 1, -1):
            shape = (batch_rows(int(sizes[k - 1]), enc.policy), int(widest[k - 1]))
            if shape in seen:
                continue
            seen.add(shape)
            grid = np.concatenate([j.grid for j in batch[:k]])
            try:
                buckets = [p.bucket for p in enc.bucket_choice.batch_plans(grid)]
            except ValueError:  # a bad item: _run tries the items alone and fails it alone
                return batch
            if all(enc.programs.ready(b, frames) for b in buckets):
                return batch[:k]
            if k == len(batch):
                self._compile(buckets, frames)
        return batch[:1]

    def _compile(self, buckets: list, frames: int | None) -> None:
        """Compile these programs on the compile thread (once, however often asked)."""
        for b in buckets:
            if (b, frames) not in self._compiling:
                self._compiling.add((b, frames))
                self._compiles.submit(self.enc.programs.get, b, frames).add_done_callback(_log_failure)

    def _next_batch(self) -> list[Job] | None:
        with self._cond:
            while True:
                if not self._pending:
                    if self._closing:
                        return None
                    self._cond.wait()
                    continue
                batch, full = self._take()
                wait = self._pending[0].enqueued + self.max_wait_s - time.perf_counter()
                if full or wait <= 0 or self._closing:
                    batch = self._compiled(batch)
                    for job in batch:
                        self._pending.remove(job)
                    return batch
                self._cond.wait(wait)

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            batch = [j for j in batch if j.future.set_running_or_notify_cancel()]
            if batch:
                self._run(batch)

    def _run(self, batch: list[Job]) -> None:
        m = self.metrics
        now = time.perf_counter()
        if m is not None:
            for job in batch:
                m.stage.labels("queue").observe(job.waited + now - job.enqueued)
        try:
            results = self._encode(batch)
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

    def _encode(self, batch: list[Job]) -> list[Result]:
        """One `enc.encode` call for the batch, split per job."""
        enc, m = self.enc, self.metrics
        grid = np.concatenate([j.grid for j in batch])  # [k, 3]
        patches = Patches.concatenate([j.patches for j in batch])  # [sum N, S, p, p, C]
        deepstack = any(j.deepstack for j in batch)
        t0 = time.perf_counter()
        # A batch plan (several items): its bucket follows the rung and the widest frame's class,
        # not the mix of sizes, so random batches compile few programs; one item runs as in encode.
        prepared = enc.prepare(patches, grid, batched=True)
        buckets = prepared.buckets
        for b in buckets:  # compiled now if new (the call would compile it anyway)
            enc.programs.get(b, prepared.frames)
        out = enc.run(prepared, deepstack)
        tokens, features = out if deepstack else (out, None)
        self.batches += 1
        if m is not None:
            m.stage.labels("device").observe(time.perf_counter() - t0)
            rows = sum(b.patches for b in buckets)
            m.batch_items.observe(len(batch))
            m.batch_fill.observe(min(len(patches) / self.budget, 1.0))
            m.batch_padding.observe((rows - len(patches)) / rows if rows else 0.0)
        cuts = np.cumsum([len(j.patches) // enc.cfg.merge_unit for j in batch])[:-1]
        own = len(batch) > 1  # each item its own rows: a cached result must not hold the whole batch
        embs = [e.copy() if own else e for e in np.split(tokens, cuts)]
        per_layer = (
            [[x.copy() if own else x for x in np.split(f, cuts)] for f in features] if features is not None else None
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
