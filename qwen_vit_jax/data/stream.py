"""The encode loop's helpers: a background thread that prepares inputs ahead of the device, a
progress bar, and counts in words. No jax here.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


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


def count(n: int, noun: str) -> str:
    """ "1 input", "3 inputs"."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
