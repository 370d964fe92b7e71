"""What the service remembers: an item's `Result`, in an in-memory LRU bounded in bytes and, with
`--cache DIR`, in the content-hash cache on disk that `qwen-vit-jax encode --cache DIR` shares
(qwen_vit_jax.data.cache.ContentCache).

Keys are (settings fingerprint, sha256 of the item's bytes): data/cache.py's one recipe, the
fingerprint covering the checkpoint, the dtype, the item's kind and its kind's preprocessing as the
workers ran it (a video's fps from its request applied). The same bytes as an image and as a video,
or a video at two fps, are different entries, in memory and on disk, where an entry lives exactly
where `encode` puts it. Deepstack features live only in memory (the disk format holds the
embedding alone): a request for them misses an entry without them.

The disk cache fails soft (`DiskCache`): an entry that cannot be read or written (a full disk,
safetensors' own SafetensorError, a read-only directory, a file where a directory should be) is a
miss or a skipped write, counted in `qvj_cache_errors_total{op}` and logged as one line (the first
of each kind, then once a minute), never a failure of the request and never a traceback.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import numpy as np

log = logging.getLogger("qwen_vit_jax.serve")
WARN_EVERY_S = 60.0  # a failing disk is logged once a minute at most (each failure is counted)


@dataclasses.dataclass(frozen=True, eq=False)
class Result:
    """One item's answer: grid int64 [3], embedding float32 [tokens, D], timestamps float64 [t]
    (NaN for images), deepstack: one float32 [tokens, D] per deepstack layer, or None."""

    grid: np.ndarray
    embedding: np.ndarray
    timestamps: np.ndarray
    deepstack: list[np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        return int(self.embedding.nbytes + sum(d.nbytes for d in self.deepstack or []))


class MemoryLRU:
    """Results by key, least recently used dropped first once their bytes pass `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._d: collections.OrderedDict[tuple, Result] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple, deepstack: bool) -> Result | None:
        with self._lock:
            r = self._d.get(key)
            if r is None or (deepstack and r.deepstack is None):
                return None
            self._d.move_to_end(key)
            return r

    def put(self, key: tuple, r: Result) -> None:
        if r.nbytes > self.capacity:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
                if old.deepstack is not None and r.deepstack is None:  # keep the richer entry
                    r = old
            self._d[key] = r
            self._bytes += r.nbytes
            while self._bytes > self.capacity:
                _, dropped = self._d.popitem(last=False)
                self._bytes -= dropped.nbytes

    def __len__(self) -> int:
        return len(self._d)

    @property
    def nbytes(self) -> int:
        """The bytes of the results held (at most `capacity`)."""
        return self._bytes


class DiskCache:
    """`ContentCache` (data/cache.py) failing soft: get -> None and put -> nothing when the disk
    fails, each failure counted in `metrics.cache_errors{op}`. Thread-safe (the service reads and
    writes from threads)."""

    def __init__(self, cache, metrics):
        self.cache, self.metrics = cache, metrics
        self._warned: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def get(self, key: str, digest: str):
        try:
            return self.cache.get(key, digest)
        except Exception as e:  # noqa: BLE001 (whatever the disk or the reader raises: a miss)
            self._failed("read", e)
            return None

    def put(self, key: str, digest: str, grid, embedding, timestamps) -> None:
        try:
            self.cache.put(key, digest, grid, embedding, timestamps)
        except Exception as e:  # noqa: BLE001 (a full disk is SafetensorError, not OSError: any failure)
            self._failed("write", e)

    def _failed(self, op: str, e: Exception) -> None:
        self.metrics.cache_errors.labels(op).inc()
        now, kind = time.monotonic(), (op, type(e).__name__)
        with self._lock:
            if now - self._warned.get(kind, -WARN_EVERY_S) < WARN_EVERY_S:
                return
            self._warned[kind] = now
        log.warning("the disk cache failed to %s an entry (served all the same): %s: %s", op, type(e).__name__, e)
