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
    """A one-line progress bar on stderr: done / total, rate, ETA; while a long item is read, its
    own count too ("312/600 frames", its rate and estimate). Redrawn in place on a terminal;
    elsewhere (a log, a pipe) a line at most every 10 s and a final one."""

    def __init__(self, total: int, unit: str = "images", stream=None):
        self.total, self.unit, self.done = total, unit, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = self.last = time.perf_counter()
        self.shown = None  # what was last drawn
        self.part = None  # (done, total, unit, started) of the item being read

    def update_to(self, done: int, part: tuple[int, int, str] | None = None) -> None:
        """Set the count of finished items to `done`; `part`: (done, total, unit) of the item being
        read (a video's frames), None when none is."""
        self.done = done
        now = time.perf_counter()
        if part is None:
            self.part = None
        elif self.part is None or part[0] < self.part[0]:  # a new item: its rate starts now
            self.part = (*part, now)
        else:
            self.part = (*part, self.part[3])
        finished = done >= self.total or (part is not None and part[0] >= part[1])
        due = now - self.last >= (0.1 if self.tty else 10.0) or finished
        if due and (done, part) != self.shown:
            self.last, self.shown = now, (done, part)
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.t0, 1e-9)
        line = f"[{_bar(self.done, self.total)}] {_count(self.done, self.total, self.unit, elapsed)}"
        line += f"  {elapsed:.0f}s elapsed"
        if self.part is not None:
            done, total, unit, started = self.part
            line += f"; {_count(done, total, unit, max(now - started, 1e-9))}"
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = round(width * (done / total if total else 1.0))
    return "#" * filled + "." * (width - filled)


def _count(done: int, total: int, unit: str, seconds: float) -> str:
    """ "312/600 frames  24.1 frames/s, ~12s left": a count, its rate and estimate."""
    rate = done / seconds
    eta = f", ~{(total - done) / rate:.0f}s left" if 0 < rate and done < total else ""
    return f"{done}/{total} {unit}  {rate:.1f} {unit}/s{eta}"


def count(n: int, noun: str) -> str:
    """ "1 input", "3 inputs"."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
