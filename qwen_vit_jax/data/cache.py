"""The content-hash cache of `qwen-vit-jax encode --cache DIR`: an input whose bytes this checkpoint,
dtype and preprocessing have encoded before is read back instead of encoded.

    DIR/<run fingerprint[:24]>/<sha256[:2]>/<sha256>.safetensors

The run fingerprint is the sha256 of the checkpoint's files (every config and weights file of its
directory, by content), the dtype and both preprocessing settings: a fine-tuned or re-converted
checkpoint, another dtype or other pixel bounds never share entries. An entry holds the input's
`embedding` float32 [tokens, D], `grid_thw` [3] and `timestamps` [t], and in its header the sha256
of those three arrays' bytes: an entry that does not parse, or whose arrays do not hash to it
(a torn write, a flipped bit), is reported corrupt, removed and recomputed, never returned.
Entries are written atomically (a temporary sibling renamed into place), without an fsync each:
an entry a power cut tears fails its checksum and is recomputed. No jax here.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np

FORMAT, VERSION = "qwen_vit_jax.cache", 1
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


def run_fingerprint(checkpoint: str, dtype: str, preprocess: dict, video_preprocess: dict) -> str:
    doc = {"checkpoint": checkpoint, "dtype": dtype, "preprocess": preprocess, "video_preprocess": video_preprocess}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class EmbeddingCache:
    """Entries of one run fingerprint under `root`. hits / misses / corrupt count this process's
    lookups."""

    def __init__(self, root: str | os.PathLike, fingerprint: str):
        self.dir = pathlib.Path(root) / fingerprint[:24]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = self.corrupt = 0

    def _path(self, digest: str) -> pathlib.Path:
        return self.dir / digest[:2] / f"{digest}.safetensors"

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
            ok = ok and f.metadata.get("digest") == digest and arrays[0].shape == (3,) and arrays[1].ndim == 2
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
        path.parent.mkdir(exist_ok=True)
        meta = {"format": FORMAT, "version": str(VERSION), "digest": digest, "checksum": _checksum(*arrays)}
        with atomic_file(path, durable=False) as tmp:  # no fsync: a torn entry fails its checksum
            write_safetensors(tmp, dict(zip(("grid_thw", "embedding", "timestamps"), arrays)), meta)


def _checksum(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
