"""safetensors files without torch: a strict reader (header validated eagerly, tensors
memory-mapped lazily, BF16 through ml_dtypes) and an fsynced writer.

Layout: u64 little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the data; offsets are relative to
the data start and must tile it exactly (as the reference implementation requires). Any defect
(truncated file, absurd header length, header not JSON, offsets past the end or overlapping, a
duplicated name) is a `CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Iterable, Mapping

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A bad or inconsistent checkpoint. The message names the file and, where relevant, the tensor."""


_ST_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(bool),
}
_ST_NAMES = {dt: name for name, dt in _ST_DTYPES.items()}
_PARAM_DTYPES = ("F32", "F16", "BF16", "F64")  # what a parameter may be stored as
_MAX_HEADER = 100 << 20  # the reference implementation's limit


def _unique_keys(pairs):
    """json object_pairs_hook: a duplicated name would silently shadow a tensor."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        raise ValueError(f"duplicate key {next(k for k, _ in pairs if k in seen or seen.add(k))!r}")
    return d


class SafetensorsFile:
    """One safetensors file: header parsed and validated eagerly, tensor bytes memory-mapped lazily."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"safetensors file not found: {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0:
                self._bad(f"only {size} bytes: too short for a safetensors header")
            if not 2 <= n <= _MAX_HEADER or 8 + n > size:
                self._bad(f"header length {n} does not fit a {size}-byte file (truncated or not safetensors)")
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            self._bad(f"corrupt header: {e}")
        if not isinstance(header, dict):
            self._bad("corrupt header: not a JSON object")
        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            self._bad("corrupt header: __metadata__ must map str -> str")
        self.metadata: dict[str, str] = meta
        self.data_start, self.data_len = 8 + n, size - 8 - n
        # name -> (safetensors dtype, shape, begin, end)
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            ok = (
                isinstance(e, dict)
                and set(e) == {"dtype", "shape", "data_offsets"}
                and isinstance(e["dtype"], str)
                and isinstance(e["shape"], list)
                and all(type(d) is int and d >= 0 for d in e["shape"])
                and isinstance(e["data_offsets"], list)
                and len(e["data_offsets"]) == 2
                and all(type(o) is int for o in e["data_offsets"])
                and 0 <= e["data_offsets"][0] <= e["data_offsets"][1]
            )
            if not ok:
                self._bad(f"corrupt header entry {e!r}", name)
            begin, end = e["data_offsets"]
            shape = tuple(e["shape"])
            dt = _ST_DTYPES.get(e["dtype"])  # unknown dtypes only fail when read (e.g. in a text tensor)
            if dt is not None and end - begin != math.prod(shape) * dt.itemsize:
                self._bad(
                    f"data_offsets [{begin}, {end}) hold {end - begin} bytes, but {e['dtype']} "
                    f"{list(shape)} needs {math.prod(shape) * dt.itemsize}",
                    name,
                )
            self.entries[name] = (e["dtype"], shape, begin, end)
        pos = 0
        for name, (_, _, begin, end) in sorted(self.entries.items(), key=lambda kv: kv[1][2:]):
            if begin != pos:
                self._bad(f"data starts at byte {begin}, expected {pos} (gap or overlap)", name)
            if end > self.data_len:
                self._bad(
                    f"data [{begin}, {end}) runs past the end of the file's {self.data_len} data "
                    "bytes (truncated file?)",
                    name,
                )
            pos = end
        if pos != self.data_len:
            self._bad(f"{self.data_len - pos} bytes after the last tensor")
        self._mm = None

    def _bad(self, msg: str, name: str | None = None):
        raise CheckpointError(f"{self.path}: " + (f"tensor {name!r}: " if name else "") + msg)

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only array backed by the file mapping (no bytes read until used)."""
        if name not in self.entries:
            self._bad("no such tensor in this file", name)
        st, shape, begin, end = self.entries[name]
        if st not in _ST_DTYPES:
            self._bad(f"unsupported dtype {st!r}", name)
        dt = _ST_DTYPES[st]
        if begin == end:
            return np.zeros(shape, dt)
        if self._mm is None:
            self._mm = np.memmap(self.path, np.uint8, "r", offset=self.data_start, shape=(self.data_len,))
        return np.frombuffer(self._mm, dt, count=math.prod(shape), offset=begin).reshape(shape)


def read_safetensors(path: str | os.PathLike, keys: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Read `keys` (default: all) from a safetensors file as read-only, memory-mapped arrays.

    Raises FileNotFoundError for a missing file, CheckpointError (a ValueError) naming the file and
    tensor for a truncated/corrupt file, an unsupported dtype or a key the file lacks.
    """
    f = SafetensorsFile(path)
    return {k: f.get(k) for k in (f.entries if keys is None else keys)}


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` (sorted by name) to a safetensors file at `path`, fsynced."""
    header: dict = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map str -> str")
        header["__metadata__"] = dict(metadata)
    arrays, pos = [], 0
    for name in sorted(tensors):
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        a = np.asarray(tensors[name])
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if a.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors equivalent")
        a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
        header[name] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
        arrays.append(a)
        pos += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned, like the reference writer
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for a in arrays:
            f.write(a.reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())
