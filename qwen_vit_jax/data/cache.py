"""The content-hash cache of `qwen-vit-jax encode --cache DIR` and `qwen-vit-jax serve --cache DIR`:
an input whose bytes this checkpoint, dtype and preprocessing have encoded before is read back
instead of encoded.

    DIR/<entry[:2]>/<entry>.safetensors      entry = sha256 of "<settings fingerprint>:<sha256 of the bytes>"

At most 256 directories, however many settings meet (a service's requests each bring their own
video sampling: a folder per fps value would grow without bound). The key of an entry is its
bytes' sha256 plus a settings fingerprint (`fingerprint`, the one recipe both commands use): the
sha256 of the checkpoint's files (every config and weights file of its directory, by content),
the dtype, the item's kind (image or video) and that kind's preprocessing as the preparation
actually ran (pixel bounds, a video's sampling: fps / num_frames / max_frames, the tower
variant's resize rule; an image's --fast-decode). A fine-tuned or re-converted checkpoint,
another dtype, other pixel bounds or another sampling never share entries, and the same bytes
sent as an image and as a video are two entries. An entry holds the input's `embedding` float32
[tokens, D], `grid_thw` [3] and `timestamps` [t], and in its header its settings fingerprint,
its bytes' sha256 and the sha256 of those three arrays' bytes: an entry that does not parse, or
whose arrays do not hash to it (a torn write, a flipped bit), is reported corrupt, removed and
recomputed, never returned. Directories are made when an entry is first written to them.
Entries are written atomically (a temporary sibling renamed into place), without an fsync each:
an entry a power cut tears fails its checksum and is recomputed. No jax here.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np

FORMAT, VERSION = "qwen_vit_jax.cache", 2  # 2: one folder level for every setting
WEIGHT_SUFFIXES = (".safetensors", ".json", ".bin", ".pt", ".msgpack")


def checkpoint_fingerprint(directory: str | os.PathLike) -> str:
    """sha256 over the names and contents of the checkpoint directory's config and weights files
    (sorted by name; links followed)."""
    d = pathlib.Path(directory)
    h = hashlib.sha256()
    for f in sorted(p for p in d.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


KINDS = ("image", "video")


def fingerprint(weights: str, dtype: str, preprocessing, kind: str, fast_decode: bool = False) -> str:
    """The settings part of an entry's key: what an item's embedding depends on besides its bytes.

    Args:
      weights: the checkpoint's `checkpoint_fingerprint`.
      dtype: the compute dtype's name.
      preprocessing: the `Preprocessing` the item was prepared with (a request's fps / num_frames
        applied: `Preprocessing.with_limits`).
      kind: "image" or "video": which of its settings apply.
      fast_decode: images decoded at a reduced JPEG scale (`encode --fast-decode`).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    settings = preprocessing.image if kind == "image" else preprocessing.video
    doc = {
        "checkpoint": weights,
        "dtype": dtype,
        "kind": kind,
        "variant": preprocessing.variant,
        "preprocess": settings.to_dict(),
        "fast_decode": bool(fast_decode) and kind == "image",
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class EmbeddingCache:
    """Entries of one settings fingerprint under `root` (nothing is made on disk until a put).
    hits / misses / corrupt count this object's lookups."""

    def __init__(self, root: str | os.PathLike, fingerprint: str):
        self.dir, self.fingerprint = pathlib.Path(root), fingerprint
        self.hits = self.misses = self.corrupt = 0

    def _path(self, digest: str) -> pathlib.Path:
        entry = hashlib.sha256(f"{self.fingerprint}:{digest}".encode()).hexdigest()
        return self.dir / entry[:2] / f"{entry}.safetensors"

    def get(self, digest: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(grid [3], embedding [tokens, D], timestamps [t]) of `digest`, or None (not there, or
        corrupt: then removed)."""
        from qwen_vit_jax.weights.safetensors_io import SafetensorsFile

        path = self._path(digest)
        if not path.is_file():
            self.misses += 1
            return None
        try:
            f = SafetensorsFile(path)
            arrays = [np.array(f.get(k)) for k in ("grid_thw", "embedding", "timestamps")]
            ok = f.metadata.get("format") == FORMAT and f.metadata.get("checksum") == _checksum(*arrays)
            ok = ok and f.metadata.get("digest") == digest and f.metadata.get("settings") == self.fingerprint
            ok = ok and arrays[0].shape == (3,) and arrays[1].ndim == 2
        except Exception:  # noqa: BLE001 (a torn or garbled file: whatever the reader raises)
            ok = False
        if not ok:
            self.corrupt += 1
            self.misses += 1
            path.unlink(missing_ok=True)
            return None
        self.hits += 1
        return arrays[0], arrays[1], arrays[2]

    def put(self, digest: str, grid, embedding: np.ndarray, timestamps: np.ndarray) -> None:
        from qwen_vit_jax.files import atomic_file
        from qwen_vit_jax.weights.safetensors_io import write_safetensors

        arrays = (
            np.asarray(grid, np.int64).reshape(3),
            np.ascontiguousarray(embedding, np.float32),
            np.asarray(timestamps, np.float64),
        )
        path = self._path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "version": str(VERSION), "digest": digest, "settings": self.fingerprint}
        meta["checksum"] = _checksum(*arrays)
        with atomic_file(path, durable=False) as tmp:  # no fsync: a torn entry fails its checksum
            write_safetensors(tmp, dict(zip(("grid_thw", "embedding", "timestamps"), arrays)), meta)


def _checksum(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # its bytes, not a copy (a video's row)
    return h.hexdigest()


class ContentCache:
    """Every entry under `root` of one checkpoint and dtype. `key(kind, preprocessing)` is the
    settings fingerprint an item lives under (its kind and preprocessing: `fingerprint`); get / put
    take it with the bytes' sha256. Thread-safe (nothing is held between calls)."""

    def __init__(self, root: str | os.PathLike, weights: str, dtype: str, fast_decode: bool = False):
        self.root, self.weights, self.dtype, self.fast_decode = root, weights, dtype, fast_decode

    def key(self, kind: str, preprocessing) -> str:
        return fingerprint(self.weights, self.dtype, preprocessing, kind, self.fast_decode)

    def _cache(self, key: str) -> EmbeddingCache:
        return EmbeddingCache(self.root, key)

    def get(self, key: str, digest: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(grid [3], embedding [tokens, D], timestamps [t]) of the entry, or None."""
        return self._cache(key).get(digest)

    def put(self, key: str, digest: str, grid, embedding: np.ndarray, timestamps: np.ndarray) -> None:
        self._cache(key).put(digest, grid, embedding, timestamps)
