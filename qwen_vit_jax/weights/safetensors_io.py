"""safetensors files through the `safetensors` package, behind `CheckpointError`.

The package reads (numpy framework, BF16 as ml_dtypes.bfloat16, one tensor at a time) and writes
(zero-copy from the arrays); its errors name neither the file nor the tensor, so `SafetensorsFile`
reads the JSON header itself as well (`read_header`: a few hundred bytes) and blames the tensor at
fault: one that runs past the end, overlaps another or does not fit its dtype and shape. The header
is also what the package does not check and we need: a duplicated tensor name (JSON lets the second
silently shadow the first) and each tensor's byte range, which export.py rewrites in place.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from qwen_vit_jax.files import fsync


class CheckpointError(ValueError):
    """A bad or inconsistent checkpoint. The message names the file and, where relevant, the tensor."""


ST_DTYPES = {
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
ST_NAMES = {dt: name for name, dt in ST_DTYPES.items()}
PARAM_DTYPES = ("F32", "F16", "BF16", "F64")  # what a parameter may be stored as
_MAX_HEADER = 100 << 20  # the format's limit


def unique_keys(pairs):
    """json object_pairs_hook: a duplicated name would silently shadow a tensor."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        raise ValueError(f"duplicate key {next(k for k, _ in pairs if k in seen or seen.add(k))!r}")
    return d


def read_header(path: pathlib.Path) -> tuple[dict, dict[str, str], int]:
    """(entries {name: (dtype, shape, begin, end)}, metadata, data start) of a safetensors file,
    from its header alone; CheckpointError for a header that is not one."""

    def bad(msg: str, name: str | None = None):
        raise CheckpointError(f"{path}: " + (f"tensor {name!r}: " if name else "") + msg)

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0:
            bad(f"only {size} bytes: too short for a safetensors header")
        if not 2 <= n <= _MAX_HEADER or 8 + n > size:
            bad(f"header length {n} does not fit a {size}-byte file (truncated or not safetensors)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        bad(f"corrupt header: {e}")
    if not isinstance(header, dict):
        bad("corrupt header: not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        bad("corrupt header: __metadata__ must map str -> str")
    entries = {}
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
            bad(f"corrupt header entry {e!r}", name)
        entries[name] = (e["dtype"], tuple(e["shape"]), *e["data_offsets"])
    return entries, meta, 8 + n


def _blame(entries: dict, data_len: int) -> tuple[str | None, str]:
    """The tensor the safetensors package refused a header for, and why: (name or None, reason)."""
    pos = 0
    for name, (st, shape, begin, end) in sorted(entries.items(), key=lambda kv: kv[1][2:]):
        dt = ST_DTYPES.get(st)
        if dt is not None and end - begin != math.prod(shape) * dt.itemsize:
            need = math.prod(shape) * dt.itemsize
            return name, f"data_offsets [{begin}, {end}) hold {end - begin} bytes, but {st} {list(shape)} needs {need}"
        if begin != pos:
            return name, f"data starts at byte {begin}, expected {pos} (gap or overlap)"
        if end > data_len:
            return (
                name,
                f"data [{begin}, {end}) runs past the end of the file's {data_len} data bytes (truncated file?)",
            )
        pos = end
    if pos != data_len:
        return None, f"{data_len - pos} bytes after the last tensor"
    return None, ""


class SafetensorsFile:
    """One safetensors file: the header checked on open, tensors read one at a time on `get`.

    entries: {name: (safetensors dtype, shape, begin, end)}, offsets from `data_start`.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"safetensors file not found: {self.path}")
        self.entries, self.metadata, self.data_start = read_header(self.path)
        try:
            self._file = safe_open(self.path, framework="numpy")
        except SafetensorError as e:
            name, why = _blame(self.entries, self.path.stat().st_size - self.data_start)
            self._bad(why or str(e), name)

    def _bad(self, msg: str, name: str | None = None):
        raise CheckpointError(f"{self.path}: " + (f"tensor {name!r}: " if name else "") + msg)

    def get(self, name: str) -> np.ndarray:
        """The tensor, read from the file (a fresh array)."""
        if name not in self.entries:
            self._bad("no such tensor in this file", name)
        st = self.entries[name][0]
        if st not in ST_DTYPES:
            self._bad(f"unsupported dtype {st!r}", name)
        try:
            return self._file.get_tensor(name)
        except SafetensorError as e:
            self._bad(str(e), name)


class LazyTensors(Mapping):
    """A file's tensors as a read-only mapping that reads each one when it is looked up: a consumer
    that takes one tensor at a time (the model filling its state) never holds the whole file."""

    def __init__(self, f: SafetensorsFile, keys: Iterable[str] | None = None):
        self.file = f
        self._keys = list(f.entries if keys is None else keys)
        for k in self._keys:
            if k not in f.entries:
                f._bad("no such tensor in this file", k)

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.file.entries:
            raise KeyError(key)
        return self.file.get(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's shape, from the header (nothing read)."""
        return self.file.entries[key][1]

    def dtype_name(self, key: str) -> str:
        """A tensor's safetensors dtype ("F32", "BF16", ...), from the header."""
        return self.file.entries[key][0]


def read_safetensors(path: str | os.PathLike, keys: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Read `keys` (default: all) from a safetensors file into arrays.

    Raises FileNotFoundError for a missing file, CheckpointError (a ValueError) naming the file and
    tensor for a truncated/corrupt file, an unsupported dtype or a key the file lacks.
    """
    f = SafetensorsFile(path)
    return {k: f.get(k) for k in (f.entries if keys is None else keys)}


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` to a safetensors file at `path` (the package's writer), fsynced."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata must map str -> str")
    arrays = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        a = np.asarray(value)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if a.dtype not in ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors equivalent")
        arrays[name] = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
    save_file(arrays, path, metadata=None if metadata is None else dict(metadata))
    if metadata:
        _sort_metadata(pathlib.Path(path))
    fsync(path)


def _sort_metadata(path: pathlib.Path) -> None:
    """Put the header's __metadata__ in sorted key order, in place. The package writes it in the
    order of a Rust HashMap, which is seeded per process: the same tensors and metadata would give
    other bytes in another process (an encode run resumed, or with more workers, must write the
    same file as a clean run). Only the header is rewritten, at its own length."""
    entries, meta, start = read_header(path)
    with open(path, "r+b") as f:
        f.seek(8)
        old = f.read(start - 8)
        head = {"__metadata__": dict(sorted(meta.items()))} | {
            k: {"dtype": st, "shape": list(shape), "data_offsets": [b, e]} for k, (st, shape, b, e) in entries.items()
        }
        new = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
        if len(new) <= len(old):  # (always, for what the package writes; else keep its order)
            f.seek(8)
            f.write(new + b" " * (len(old) - len(new)))
