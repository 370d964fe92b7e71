"""safetensors files through the `safetensors` package, behind `CheckpointError`.

The package reads (numpy framework, BF16 as ml_dtypes.bfloat16, one tensor at a time); its errors
name neither the file nor the tensor, so `SafetensorsFile` reads the JSON header itself as well
(`read_header`: a few hundred bytes) and blames the tensor at fault: one that runs past the end,
overlaps another or does not fit its dtype and shape. The header is also what the package does not
check and we need: a duplicated tensor name (JSON lets the second silently shadow the first) and
each tensor's byte range, which export.py rewrites in place. `write_safetensors` writes the
package's format itself: a tensor may come in parts (`Rows`), written one after another.
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
from safetensors.numpy import save


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
        self._keys = dict.fromkeys(f.entries if keys is None else keys)  # ordered, with O(1) membership
        for k in self._keys:
            if k not in f.entries:
                f._bad("no such tensor in this file", k)

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._keys:
            raise KeyError(key)
        return self.file.get(key)

    def __contains__(self, key: object) -> bool:  # from the header: Mapping's own would read the tensor
        return key in self._keys

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


class Rows:
    """A tensor given as arrays joined along their first axis (each [n_i, *rest]), stored as one
    tensor [sum n_i, *rest] of `dtype` by `write_safetensors` part after part, never joined in
    memory: the rows of an embeddings file, a long video's row in its pieces."""

    def __init__(self, parts: Iterable[np.ndarray], rest: tuple[int, ...], dtype):
        self.parts, self.rest, self.dtype = list(parts), tuple(rest), np.dtype(dtype)
        for a in self.parts:
            if np.shape(a)[1:] != self.rest:
                raise ValueError(f"a part of shape {np.shape(a)} among rows [*, {', '.join(map(str, self.rest))}]")

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(len(a) for a in self.parts), *self.rest)


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray | Rows], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` (arrays, or `Rows` written part by part) to a safetensors file at `path`,
    fsynced: the file the package writes for the same arrays, byte for byte (its tensor order, its
    header), but with the metadata in sorted key order, and written straight from the arrays.

    By hand because the package takes whole arrays only: a tensor in parts would be joined first,
    a copy of what may be most of memory (an encode run's rows). And the package orders metadata as
    a Rust HashMap, seeded per process; sorted, another process (a resumed encode run, or one with
    more workers) writes the same bytes."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata must map str -> str")
    specs = {}  # name -> (little-endian dtype, shape, parts)
    for name, value in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        if isinstance(value, Rows):
            parts, shape, given = value.parts, value.shape, value.dtype
        else:
            parts = [np.asarray(value)]
            shape, given = parts[0].shape, parts[0].dtype
        dtype = given.newbyteorder("<") if given.byteorder == ">" else given
        if dtype not in ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {given} has no safetensors equivalent")
        specs[name] = (dtype, shape, parts)
    head, pos = {} if metadata is None else {"__metadata__": dict(sorted(metadata.items()))}, 0
    order = _package_order({name: dtype for name, (dtype, _, _) in specs.items()})
    for name in order:
        dtype, shape, _ = specs[name]
        end = pos + math.prod(shape) * dtype.itemsize
        head[name], pos = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [pos, end]}, end
    raw = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)  # the package pads its header to a multiple of 8 bytes
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name in order:
            dtype, _, parts = specs[name]
            for part in parts:  # C order, little-endian: a view where the part already is, else a copy of it
                f.write(np.ascontiguousarray(part, dtype).reshape(-1).view(np.uint8))
        f.flush()
        os.fsync(f.fileno())


def _package_order(dtypes: Mapping[str, np.dtype]) -> list[str]:
    """The order the package lays tensors out in (by dtype, then by name: its rule, whose dtype
    order changes between its versions), asked of the package with empty tensors of those dtypes."""
    raw = save({name: np.zeros(0, dtype) for name, dtype in dtypes.items()})
    return [k for k in json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")]) if k != "__metadata__"]
