"""Where the encode loop's rows go: an embeddings file (embeddings.py's safetensors / npz form,
held in memory and rewritten whole at each save, written from the rows where they are, never
joined) or a parquet file (parquet.py: written as it goes, memory flat in the dataset's size). Both
take rows in input order with each input's sha256, give back a row written earlier
(`fetch`: the content-hash dedupe copies a duplicate's embedding), save what is done
(`checkpoint`), and end whole (`finish`); `open_sink` checks a file being resumed against this run's
settings and lists the keys it holds (`done`) and its rows by sha256 (`seen`: a resumed run copies
those rows as a clean run would have, rather than encoding the same bytes again); a file to resume
that cannot be read is an error naming it and the two ways on (`--overwrite`, or moving it aside).

A full disk raises `files.DiskFull` with nothing half-written left: the safetensors / npz form
keeps OUT as its last save wrote it; the parquet form drops the part being written and keeps the
completed parts; `kept` says what is left for --resume.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from qwen_vit_jax.data import parquet
from qwen_vit_jax.data.embeddings import Embeddings, EmbeddingsError, check_suffix, read_embeddings, write_rows
from qwen_vit_jax.data.inputs import EncodeError
from qwen_vit_jax.data.stream import count
from qwen_vit_jax.files import DiskFull, disk_full
from qwen_vit_jax.weights.safetensors_io import Rows

RESUME_KEYS = ("checkpoint", "dtype", "preprocess", "video_preprocess")  # must match to add to a file
SAVE_EVERY_S = 600.0  # encode's default checkpoint interval (--save-every): a crash costs at most this

Row = tuple  # (grid int64 [3], embedding float32 [tokens, D], timestamps float64 [t])


def check_resumable(where, metadata: dict, meta: dict) -> None:
    """EncodeError naming the settings (and, within the preprocessing, the fields) that differ
    between a file to resume and this run."""
    for key in RESUME_KEYS:
        if key == "video_preprocess" and key not in metadata:
            continue  # written before videos were supported: it holds images only
        theirs, ours = metadata.get(key), meta[key]
        if theirs != ours:
            if isinstance(theirs, dict) and isinstance(ours, dict):
                fields = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
                said = ", ".join(f"{f} {theirs.get(f)!r} (this run: {ours.get(f)!r})" for f in fields)
                what = f"{key} differing in {said}"
            else:
                what = f"{key} {theirs!r} (this run: {ours!r})"
            raise EncodeError(
                f"--resume: {where} was written with {what}; mixing them in one file would be silently wrong"
            )


def damaged(path, reason: str, part: bool = False) -> EncodeError:
    """The error for a file to resume that cannot be read: it names the file and the two ways on."""
    ways = (
        "--overwrite starts the run over, or move the part aside (--resume then encodes its inputs again)"
        if part
        else "--overwrite replaces it, or move it aside to keep it"
    )
    return EncodeError(f"--resume: cannot read {path} ({reason}); {ways}")


class MemorySink:
    """The safetensors / npz form: rows kept in memory, OUT rewritten whole (old rows + this run's)
    at each checkpoint and at the end; the sha256 list in its metadata."""

    def __init__(self, target: pathlib.Path, meta: dict, dim: int, old: Embeddings | None):
        self.target, self.meta, self.dim, self.old = target, meta, dim, old
        # (key, row, sha256): one append per row, so that an interrupt never leaves a key without its row
        self.rows: list[tuple[str, Row, str | None]] = []
        self.old_digests = [] if old is None else old.metadata.get("sha256") or [None] * len(old)
        self.done = [] if old is None else list(old.names)
        self.seen = {d: ("old", i) for i, d in enumerate(self.old_digests) if d}
        self.saved = 0  # this run's rows in OUT (its last save)
        self.row_bytes: float | None = None  # OUT's bytes per row at the last save (tried)

    def add(self, key: str, row: Row, digest: str | None) -> int:
        self.rows.append((key, row, digest))
        return len(self.rows) - 1

    def fetch(self, ref) -> Row:
        if isinstance(ref, tuple):  # a row of the file being resumed
            i, old = ref[1], self.old
            t = int(np.sum(old.grid_thw[:i, 0]))
            return old.grid_thw[i], old[i], old.timestamps[t : t + int(old.grid_thw[i, 0])]
        return self.rows[ref][1]

    def checkpoint(self) -> None:
        if len(self.rows) > self.saved:  # else OUT already holds every row
            self.finish()

    def finish(self) -> None:
        """OUT rewritten whole: the old rows and every row of this run, written from where they are
        held (joined first, they would cost their size twice: a long video's row is gigabytes)."""
        keys, rows, digests = zip(*self.rows) if self.rows else ((), (), ())
        old = self.old or Embeddings(np.zeros((0, self.dim), np.float32), np.zeros((0, 3), np.int64), [0], [], {})
        grid = np.concatenate([old.grid_thw, np.asarray([r[0] for r in rows], np.int64).reshape(-1, 3)])
        lengths = [*np.diff(old.offsets), *[len(r[1]) for r in rows]]
        arrays = (
            Rows([old.embeddings, *[r[1] for r in rows]], (self.dim,), np.float32),
            grid,
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            np.concatenate([old.timestamps, *[r[2] for r in rows]]),
        )
        names = [*old.names, *keys]
        meta = {k: v for k, v in self.meta.items() if k != "sha256"} | {"sha256": [*self.old_digests, *digests]}
        size = sum(np.prod(a.shape) * a.dtype.itemsize for a in arrays) + len(json.dumps([names, meta]))
        self.row_bytes = size / max(len(names), 1)
        try:
            write_rows(self.target, *arrays, names, meta)  # atomic: a failed write leaves OUT as it was
        except Exception as e:  # noqa: BLE001 (a full disk: an OSError, or a writer library's own error type)
            if not disk_full(e):
                raise
            raise DiskFull(self.target, int(size), "writing it whole") from None
        self.saved = len(self.rows)

    def abandon(self) -> None:
        pass

    def to_finish(self, total: int) -> int | None:
        """About the bytes a run of `total` inputs needs to end: OUT whole (old rows and all of it)."""
        if self.row_bytes is None:
            return None
        return int(self.row_bytes * (len(self.old or ()) + total))

    def kept(self) -> str:
        """What a failed save leaves on disk, in words."""
        old = " and what it held" if self.old is not None else ""
        if self.saved:
            return f"{self.target} keeps the {count(self.saved, 'new input')} of its last save{old}"
        return f"{self.target} is as it was" if self.old is not None else "nothing was written"


class ParquetSink:
    """The parquet form: rows go to parts as they come (parquet.PartsWriter); `finish` merges the
    file being resumed, the parts of an earlier crashed run and this run's into OUT."""

    def __init__(self, target: pathlib.Path, meta: dict, dim: int, resume: bool):
        self.target, self.meta, self.dim = target, meta, dim
        self.old = target if resume and target.exists() else None
        self.done, self.seen = [], {}
        for f in [*([self.old] if self.old else []), *(parquet.part_files(target) if resume else [])]:
            try:
                metadata = parquet.read_metadata(f)
                keys, digests = parquet.read_keys_and_digests(f)
            except (ValueError, OSError, KeyError) as e:  # pyarrow's errors are ValueError / OSError
                raise damaged(f, f"damaged, or not a parquet embeddings file: {e}", part=f != self.old) from None
            check_resumable(f, metadata, meta)
            self.done += keys
            self.seen.update({d: (f, i) for i, d in enumerate(digests) if d and d not in self.seen})
        if not resume:  # parts of an earlier run belong to it: a fresh run starts from none
            for f in parquet.part_files(target):
                f.unlink()
        self.writer = parquet.PartsWriter(target, dim, meta)
        self.start = self.writer.rows_in_parts  # rows of this run are numbered from here in the parts
        self.count = 0

    def add(self, key: str, row: Row, digest: str | None) -> int:
        self.writer.add(key, *row, digest)
        self.count += 1
        return self.count - 1

    def fetch(self, ref) -> Row:
        if isinstance(ref, tuple):  # (file, row) of the file being resumed or an earlier run's part
            return parquet.read_row(*ref)
        if self.start + ref >= self.writer.rows_in_parts:  # still in the part being written
            self.writer.checkpoint()
        row = self.start + ref
        for f in parquet.part_files(self.target):
            n = parquet.num_rows(f)
            if row < n:
                return parquet.read_row(f, row)
            row -= n
        raise IndexError(f"row {ref} of this run is in no part of {self.target}")

    def checkpoint(self) -> None:
        self.writer.checkpoint()

    def finish(self) -> None:
        self.writer.finish(self.old)

    def abandon(self) -> None:
        self.writer.abandon()

    def to_finish(self, total: int) -> int | None:
        """About the bytes a run of `total` inputs still needs to end: the parts it has yet to write,
        then OUT merged from the old OUT and every part (beside the parts, which go after)."""
        w = self.writer
        if w.row_bytes is None:
            return None
        left = total - (w.rows_in_parts - self.start)  # this run's rows not in a part yet
        old = self.old.stat().st_size if self.old is not None else 0
        return int(2 * w.row_bytes * left + old + w.bytes_in_parts)  # the rows left twice: parts, then OUT

    def kept(self) -> str:
        """What a failed save leaves on disk, in words."""
        old = f"; {self.target} is as it was" if self.old is not None else ""
        if self.writer.rows_in_parts:  # this run's and an earlier interrupted run's
            return f"{self.writer.dir}/ keeps the {count(self.writer.rows_in_parts, 'input')} checkpointed{old}"
        return f"nothing was checkpointed{old}"


def open_sink(target: pathlib.Path, meta: dict, dim: int, resume: bool):
    """The sink writing `target` (by its suffix); with `resume`, the rows it holds (checked to come
    from the same checkpoint and settings) are kept and listed in `sink.done`."""
    if check_suffix(target) == ".parquet":
        return ParquetSink(target, meta, dim, resume)
    old = None
    if resume and target.exists():
        try:
            old = read_embeddings(target)
        except EmbeddingsError as e:
            raise damaged(target, str(e).removeprefix(f"{target}: ")) from None
        check_resumable(target, old.metadata, meta)
    return MemorySink(target, meta, dim, old)
