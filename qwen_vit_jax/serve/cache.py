"""What the service remembers: an item's `Result`, in an in-memory LRU bounded in bytes and, with
`--cache DIR`, in the CLI's content-hash cache on disk (qwen_vit_jax.data.cache: the same entries
`qwen-vit-jax encode --cache DIR` reads and writes for this checkpoint, dtype and preprocessing).

Keys are (sha256 of the item's bytes, a video's fps or None). A video sampled at another fps is
another entry; on disk it lives under the fingerprint of that video configuration, exactly where
`encode --fps F` puts it. Deepstack features live only in memory (the disk format holds the
embedding alone): a request for them misses an entry without them.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np


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
    """The CLI's content-hash cache for one checkpoint, dtype and preprocessing; one
    `EmbeddingCache` per video sampling (fps) met."""

    def __init__(self, root: str, weights_fingerprint: str, dtype: str, preprocess, video_preprocess):
        self.root, self.weights, self.dtype = root, weights_fingerprint, dtype
        self.image = {**preprocess.to_dict(), "fast_decode": False}  # as `encode` keys it (no --fast-decode)
        self.video = video_preprocess
        self._caches: dict = {}
        self._lock = threading.Lock()

    def _cache(self, fps: float | None):
        from qwen_vit_jax.data.cache import EmbeddingCache, run_fingerprint

        with self._lock:
            c = self._caches.get(fps)
            if c is None:
                video = self.video
                if fps is not None:  # what `encode --fps F` records
                    video = dataclasses.replace(video, do_sample_frames=True, fps=float(fps), num_frames=None)
                fp = run_fingerprint(self.weights, self.dtype, self.image, video.to_dict())
                c = self._caches[fps] = EmbeddingCache(self.root, fp)
            return c

    def get(self, key: tuple) -> Result | None:
        digest, fps = key
        row = self._cache(fps).get(digest)
        if row is None:
            return None
        grid, emb, stamps = row
        return Result(grid, emb, stamps)

    def put(self, key: tuple, r: Result) -> None:
        digest, fps = key
        self._cache(fps).put(digest, r.grid, r.embedding, r.timestamps)
