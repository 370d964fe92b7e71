"""Streaming inputs through the encoder: grouped into calls by patch budget, split across
processes by patch count, prepared ahead of the device in a background thread, and a progress
bar. Shared by `VisionEncoder.encode_images` and the CLI's `encode`. No jax here.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def pack(items: Iterable[T], budget: int, size: Callable[[T], int]) -> Iterator[list[T]]:
    """Consecutive items in lists whose sizes sum to at most `budget` (an item larger than the
    budget alone), in order. Lazy: an item is read only when the list before it is full."""
    if budget <= 0:
        raise ValueError(f"the patch budget must be positive, got {budget}")
    batch: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if batch and total + n > budget:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += n
    if batch:
        yield batch


def split_even(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Cut a sequence into `parts` consecutive [start, stop) ranges of nearly equal total size.

    Cut i sits at the item boundary whose prefix total is closest to i / parts of the whole (ties:
    the earlier boundary), so a range is off the mean by at most about one item. Consecutive on
    purpose: the ranges concatenated are the input order, so per-range outputs concatenate to the
    single-range output. Deterministic (every process computes the same ranges); a range may be
    empty when there are fewer items than parts.
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    cum = np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))])  # [n + 1] prefix totals
    cuts = [0]
    for i in range(1, parts):
        target = cum[-1] * i / parts
        j = int(np.searchsorted(cum, target))  # first boundary with prefix >= target
        if j > 0 and target - cum[j - 1] <= cum[j] - target:
            j -= 1
        cuts.append(max(j, cuts[-1]))
    cuts.append(len(cum) - 1)
    return list(zip(cuts[:-1], cuts[1:]))


def prefetch(it: Iterator[T], depth: int = 2) -> Iterator[T]:
    """Run `it` in a background thread, `depth` items ahead: image decoding and resizing (PIL and
    numpy release the GIL) overlap the device's work on the previous batch. Closing the returned
    generator (or an error in the consumer) stops the thread; an error in `it` is re-raised here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def work():
        try:
            for x in it:
                if not put((x, None)):
                    return
        except BaseException as e:  # noqa: BLE001 (re-raised in the consumer)
            put((None, e))
            return
        put((end, None))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while True:
            x, err = q.get()
            if err is not None:
                raise err
            if x is end:
                return
            yield x
    finally:
        stop.set()
        thread.join()


class Progress:
    """A one-line progress bar on stderr: done / total, rate, ETA. Redrawn in place on a terminal;
    elsewhere (a log, a pipe) a line at most every 10 s and a final one."""

    def __init__(self, total: int, unit: str = "images", stream=None):
        self.total, self.unit, self.done = total, unit, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = self.last = time.perf_counter()
        self.shown = -1  # the count last drawn

    def update_to(self, done: int) -> None:
        """Set the count of finished items to `done`."""
        self.done = done
        now = time.perf_counter()
        due = now - self.last >= (0.1 if self.tty else 10.0) or done >= self.total
        if due and done != self.shown:
            self.last, self.shown = now, done
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.t0, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * round(24 * frac) + "." * (24 - round(24 * frac))
        line = f"[{bar}] {self.done}/{self.total} {self.unit}  {rate:.1f} {self.unit}/s  {elapsed:.0f}s elapsed" + (
            f", ~{eta:.0f}s left" if self.done < self.total else ""
        )
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
