"""Datasets as sources: every input of a run as a `Record`, found from what the user names.

    files and folders     an image or video file; a folder's images, videos, .tar and .parquet files
    webdataset shards     NAME.tar: samples grouped by `__key__` (the member path up to the first dot
                          of its base name), the image under jpg / jpeg / png / webp, a video under
                          mp4 / webm
    parquet files         NAME.parquet with an image column (`--image-column`, default "image") of raw
                          bytes or HF's {"bytes", "path"} struct; the key from `--key-column`, else
                          "NAME.parquet:ROW" (the row's position in its file)
    HF datasets           a folder written by `datasets`' save_to_disk (a Dataset or a DatasetDict:
                          every split), or `hf:NAME[:SPLIT]`, a dataset in the local HF cache (offline
                          only: nothing is downloaded); keys from `--key-column`, else "SPLIT:ROW"
    glob patterns         "shards/*.tar", "data/train-*.parquet" (sorted), and lists of all of these

A Record says where an input's bytes are (a file; a tar member's offset and size; a row of a parquet
or arrow file), never the bytes: the main process lists the run (headers and metadata only) and
each worker process reads its own records (`read_record`, pipeline.py). No jax here.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import tarfile
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

from qwen_vit_jax.data.inputs import IMAGE_SUFFIXES, VIDEO_SUFFIXES, EncodeError, find_inputs, is_video

TAR_IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")  # a webdataset sample's image, in this preference
TAR_VIDEO_FIELDS = ("mp4", "webm")
_WDS_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's base_plus_ext: key, extension


class Record(NamedTuple):
    """One input of a run. kind: "file" (path), "tar" (the member's data at `offset`, `size` bytes,
    its field `field`), "parquet" / "arrow" (row `offset` of the file's column `field`). shard: the
    file the record lives in (multi-process runs split by it)."""

    key: str
    kind: str
    path: str
    offset: int = 0
    size: int = 0
    field: str = ""

    @property
    def shard(self) -> str:
        return self.path

    @property
    def where(self) -> str:
        """The record for a message: a file's path; "SHARD key KEY" inside a dataset file."""
        return self.path if self.kind == "file" else f"{self.path} key {self.key}"

    @property
    def is_video(self) -> bool:
        if self.kind == "tar":
            return self.field in TAR_VIDEO_FIELDS
        return self.kind == "file" and is_video(self.path)


# ---- listing ---------------------------------------------------------------------------------------
def expand(
    inputs: Iterable[str],
    *,
    recursive: bool = False,
    image_column: str = "image",
    key_column: str | None = None,
) -> list[Record]:
    """Every input named by `inputs` (see the module docstring), in order: each argument's records
    in the order of its file (folders and globs sorted by name). Raises EncodeError for a name
    that is none of these, a shard that cannot be listed, or a missing column."""
    records: list[Record] = []
    for item in inputs:
        if item.startswith("hf:"):
            records += _hf_cache(item[3:], image_column, key_column)
            continue
        if glob.has_magic(item) and not os.path.exists(item):
            matches = sorted(glob.glob(item, recursive=recursive))
            if not matches:
                raise EncodeError(f"no file matches {item}")
        else:
            matches = [item]
        for path in matches:
            records += _expand_one(path, recursive, image_column, key_column)
    return records


def _expand_one(path: str, recursive: bool, image_column: str, key_column: str | None) -> list[Record]:
    if os.path.isdir(path) and _is_hf_dataset(path):
        return _hf_dir(path, image_column, key_column)
    if os.path.isdir(path):
        out = []
        for p in find_inputs([path], recursive, extra_suffixes=(".tar", ".parquet")):
            out += _expand_one(p, recursive, image_column, key_column)
        return out
    if not os.path.isfile(path):
        raise EncodeError(f"input not found: {path}")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".tar":
        return tar_records(path)
    if suffix == ".parquet":
        return parquet_records(path, image_column, key_column)
    return [Record(os.path.normpath(path), "file", os.path.normpath(path))]


def tar_records(path: str) -> list[Record]:
    """A webdataset shard's samples with an image or video field (others, e.g. caption-only
    samples, are no inputs), from its member headers alone."""
    try:
        with tarfile.open(path, "r:") as tar:  # uncompressed: members are read in place
            members = [m for m in tar.getmembers() if m.isfile()]
    except (tarfile.TarError, OSError) as e:
        raise EncodeError(f"cannot list {path} as a webdataset shard ({e}; shards must be uncompressed tar)") from None
    fields: dict[str, dict[str, tarfile.TarInfo]] = {}
    for m in members:
        match = _WDS_KEY.match(m.name)
        if match is None or os.path.basename(m.name).startswith("."):
            continue
        fields.setdefault(match[1], {})[match[2].lower()] = m
    out = []
    for key, f in fields.items():
        field = next((x for x in (*TAR_IMAGE_FIELDS, *TAR_VIDEO_FIELDS) if x in f), None)
        if field is not None:
            out.append(Record(key, "tar", path, f[field].offset_data, f[field].size, field))
    return out


def need_pyarrow(what: str) -> None:
    """EncodeError naming the extra when pyarrow (parquet, arrow files) is not installed."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise EncodeError(f"{what} needs pyarrow: pip install 'qwen_vit_jax[data]'") from None


def parquet_records(path: str, image_column: str, key_column: str | None) -> list[Record]:
    """A parquet file's rows (its metadata and the key column only are read)."""
    need_pyarrow(f"reading {path}")
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 (pyarrow's many error types: not a parquet file)
        raise EncodeError(f"cannot read {path} as parquet ({e})") from None
    names = pf.schema_arrow.names
    _check_columns(path, names, image_column, key_column)
    n = pf.metadata.num_rows
    keys = _keys(pf.read(columns=[key_column]).column(0).to_pylist() if key_column else None, n, os.path.basename(path))
    return [Record(k, "parquet", path, i, 0, image_column) for i, k in enumerate(keys)]


def _keys(values: list | None, n: int, prefix: str) -> list[str]:
    if values is None:
        return [f"{prefix}:{i}" for i in range(n)]
    return [str(v) for v in values]


def _check_columns(where: str, names: list[str], image_column: str, key_column: str | None) -> None:
    for flag, col in (("--image-column", image_column), ("--key-column", key_column)):
        if col is not None and col not in names:
            raise EncodeError(f"{where} has no column {col!r} ({flag}); its columns: {', '.join(names)}")


# ---- HF datasets -----------------------------------------------------------------------------------
def _is_hf_dataset(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))


def _hf_dir(path: str, image_column: str, key_column: str | None) -> list[Record]:
    """A save_to_disk folder: a Dataset (state.json lists its arrow files) or a DatasetDict (one
    such folder per split, dataset_dict.json lists them)."""
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f)["splits"]
        return [r for s in splits for r in _hf_split(os.path.join(path, s), s, image_column, key_column)]
    return _hf_split(path, os.path.basename(os.path.normpath(path)), image_column, key_column)


def _hf_split(path: str, split: str, image_column: str, key_column: str | None) -> list[Record]:
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    if state.get("_indices_data_files"):
        raise EncodeError(f"{path}: a dataset with an indices mapping (select, shuffle): flatten_indices() and save it")
    files = [os.path.join(path, d["filename"]) for d in state["_data_files"]]
    return _arrow_records(files, split, image_column, key_column)


def _hf_cache(spec: str, image_column: str, key_column: str | None) -> list[Record]:
    """`hf:NAME[:SPLIT]`: a dataset the local HF cache holds (or a local folder `datasets` reads),
    through `datasets` with the hub offline: its cached arrow files."""
    name, _, split = spec.partition(":")
    try:
        import datasets
    except ImportError:
        raise EncodeError("hf:NAME inputs need the datasets package: pip install 'qwen_vit_jax[data]'") from None
    try:
        with _offline(datasets):
            loaded = datasets.load_dataset(name, split=split or None)
    except Exception as e:  # noqa: BLE001 (datasets raises many kinds: not cached, no such split)
        raise EncodeError(f"hf:{spec}: not in the local HF cache (offline: nothing is downloaded) ({e})") from None
    parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(split or "train", loaded)]
    out = []
    for s, ds in parts:
        if ds._indices is not None:
            ds = ds.flatten_indices()
        out += _arrow_records([f["filename"] for f in ds.cache_files], s, image_column, key_column)
    return out


@contextlib.contextmanager
def _offline(datasets):
    """The hub offline for `datasets` and huggingface_hub: their flags are read at import, so the
    imported modules' copies are set too (and put back after)."""
    import huggingface_hub.constants as hub

    saved = [(m, k, getattr(m, k)) for m in (datasets.config, hub) for k in ("HF_HUB_OFFLINE",) if hasattr(m, k)]
    saved += [(datasets.config, "HF_DATASETS_OFFLINE", getattr(datasets.config, "HF_DATASETS_OFFLINE", False))]
    env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    try:
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        for m, k, _ in saved:
            setattr(m, k, True)
        yield
    finally:
        for m, k, v in saved:
            setattr(m, k, v)
        for k, v in env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _arrow_records(files: list[str], split: str, image_column: str, key_column: str | None) -> list[Record]:
    """Rows of HF datasets' arrow files (IPC stream format, memory-mapped), numbered across the
    split's files."""
    out, row = [], 0
    for path in files:
        table = _arrow_table(path)
        _check_columns(path, table.column_names, image_column, key_column)
        keys = table.column(key_column).to_pylist() if key_column else None
        for i in range(table.num_rows):
            key = str(keys[i]) if keys is not None else f"{split}:{row}"
            out.append(Record(key, "arrow", path, i, 0, image_column))
            row += 1
        del table
    return out


def _arrow_table(path: str):
    need_pyarrow(f"reading {path}")
    import pyarrow as pa

    with pa.memory_map(path) as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source).read_all()


# ---- reading a record (in the worker) --------------------------------------------------------------
class RecordReader:
    """Reads records' bytes, keeping the last parquet row group and arrow table of each file open
    (a worker reads its records in order). One per worker process."""

    def __init__(self):
        self._groups: dict[str, tuple] = {}  # parquet path -> (ParquetFile, cumulative row starts, cached group)
        self._tables: dict[str, object] = {}  # arrow path -> memory-mapped table

    def read(self, record: Record) -> bytes | str:
        """The record's bytes; for a file record its path (decoders open files themselves)."""
        if record.kind == "file":
            return record.path
        if record.kind == "tar":
            with open(record.path, "rb") as f:
                f.seek(record.offset)
                data = f.read(record.size)
            if len(data) != record.size:
                raise EncodeError(f"{record.where}: the shard ends inside the member (truncated)")
            return data
        value = self._parquet_value(record) if record.kind == "parquet" else self._arrow_value(record)
        return image_cell(value, record.where, record.field, os.path.dirname(record.path))

    def _parquet_value(self, record: Record):
        import bisect

        import pyarrow.parquet as pq

        entry = self._groups.get(record.path)
        if entry is None:
            pf = pq.ParquetFile(record.path)
            starts = [0]
            for g in range(pf.metadata.num_row_groups):
                starts.append(starts[-1] + pf.metadata.row_group(g).num_rows)
            entry = self._groups[record.path] = [pf, starts, -1, None]
        pf, starts, cached, column = entry
        g = bisect.bisect_right(starts, record.offset) - 1
        if g != cached:
            column = pf.read_row_group(g, columns=[record.field]).column(0)
            entry[2], entry[3] = g, column
        return column[record.offset - starts[g]].as_py()

    def _arrow_value(self, record: Record):
        table = self._tables.get(record.path)
        if table is None:
            table = self._tables[record.path] = _arrow_table(record.path)
        return table.column(record.field)[record.offset].as_py()


def image_cell(value, where: str, column: str, folder: str = "") -> bytes | str:
    """A cell of an image column: bytes, or HF's {"bytes", "path"} struct (bytes first; a path alone
    is read from disk: absolute, or relative to `folder`, the dataset file's), or a path."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes") is not None:
            return bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, str) and value:
        return value if os.path.isabs(value) or os.path.exists(value) else os.path.join(folder, value)
    raise EncodeError(
        f"{where}: column {column!r} holds {type(value).__name__}, not image bytes or HF's {{'bytes', 'path'}} struct"
    )


# ---- checks ----------------------------------------------------------------------------------------
def duplicate_keys(records: list[Record]) -> dict[str, int]:
    """Keys that occur more than once, with their counts."""
    counts = Counter(r.key for r in records)
    return {k: n for k, n in counts.items() if n > 1}


def suffixes() -> frozenset[str]:
    """What a folder is searched for."""
    return IMAGE_SUFFIXES | VIDEO_SUFFIXES | {".tar", ".parquet"}
