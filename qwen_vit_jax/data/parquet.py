"""The parquet form of the embeddings file (`qwen-vit-jax encode -o OUT.parquet`), read by pyarrow,
pandas or `datasets` alone:

  key         string                       the input's key (a path, a webdataset __key__, a row's key)
  grid_thw    fixed_size_list<int64, 3>    (t, h, w) patch grid
  embedding   list<fixed_size_list<float32, D>>   its merged tokens, one list of D floats per token
  timestamps  list<float64>                seconds of each temporal patch of a video; null for images
                                           and for videos whose model reads no time
  sha256      string                       the sha256 of the input's bytes (--resume and the
                                           in-run dedupe find identical inputs by it)
  schema metadata "qwen_vit_jax": JSON of format, version, checkpoint, dtype, preprocess,
                                  video_preprocess (as the safetensors form's header)

Written as it goes, never held in memory: `PartsWriter` appends rows to a part file in row groups;
every checkpoint closes the part (complete, fsynced, renamed into OUT.parquet.parts/) and starts the
next, so a crash loses at most the rows since the last checkpoint, and `--resume` reads the keys of
OUT and of its parts. `finish` merges the old OUT, the parts and nothing else, row group by row
group, into a temporary sibling renamed over OUT (atomic), then removes the parts (a run of one
part without an old OUT: that part is renamed over OUT, the same rows without a second copy). A full disk
(`files.DiskFull`) removes the part being written, or the merge's temporary file, before it is
raised: the completed parts and OUT stay as they were.

The rows go to pyarrow without a copy (`embedding_array`), but pyarrow's writer allocates several
times a row group's embedding bytes while it writes the group, and a row group holds whole rows:
one input is one parquet row, so a long video's row costs that many times its size (RESULTS.md,
Long videos; .safetensors and .npz write a row from where it is held).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

from qwen_vit_jax.files import DiskFull, atomic_file, disk_full, fsync, interrupts_deferred

META_KEY = b"qwen_vit_jax"
ROWS_PER_GROUP = 256  # inputs per row group at most: memory stays at one group's embeddings
GROUP_BYTES = 64 << 20  # and embedding bytes per row group at most (a group of 3B-tower rows, a long video's row)
# Dictionary pages only where values repeat: the embedding's floats never do, and dictionary-encoding
# them cost pyarrow's writer ~25x a row group's embedding bytes (4-5x without; a long video is one row).
WRITE_OPTIONS = {"use_dictionary": ["key", "sha256"]}
JOIN_BYTES = 1 << 20  # rows under this share one column chunk (joined); a larger one is a chunk of its own


def schema(dim: int, metadata: dict):
    import pyarrow as pa

    fields = [
        pa.field("key", pa.string(), nullable=False),
        pa.field("grid_thw", pa.list_(pa.int64(), 3), nullable=False),
        pa.field("embedding", pa.list_(pa.list_(pa.float32(), dim)), nullable=False),
        pa.field("timestamps", pa.list_(pa.float64())),
        pa.field("sha256", pa.string()),
    ]
    return pa.schema(fields, metadata={META_KEY: json.dumps(metadata).encode()})


def rows_table(keys, grids, embs, stamps, dim: int, metadata: dict, digests=None):
    """A pyarrow table of rows: keys [k] str, grids [k] (t, h, w), embs [k] float32 [tokens, D],
    stamps [k] float64 [t] (NaN: none), digests [k] str or None."""
    import pyarrow as pa

    seconds = [None if np.isnan(s).all() else np.asarray(s, np.float64).tolist() for s in stamps]
    times = pa.array(seconds, pa.list_(pa.float64()))
    digests = pa.array(list(digests) if digests is not None else [None] * len(keys), pa.string())
    columns = [pa.array(list(keys), pa.string()), grid_array(grids), embedding_array(embs, dim), times, digests]
    return pa.Table.from_arrays(columns, schema=schema(dim, metadata))


def embedding_array(embs, dim: int):
    """float32 [tokens, D] arrays -> the `embedding` column: list<fixed_size_list<float32, D>>, in
    chunks: consecutive rows under JOIN_BYTES joined into one, a larger row a chunk of its own made
    on its array's buffer (not copied: a long video's row is gigabytes). pyarrow writes the same
    bytes however a column is chunked."""
    import pyarrow as pa

    chunks, run = [], []
    for e in embs:
        e = np.asarray(e, np.float32)
        if e.nbytes < JOIN_BYTES:
            run.append(e)
            continue
        if run:
            chunks, run = [*chunks, _rows_array(run, dim)], []
        chunks.append(_rows_array([e], dim))
    if run or not chunks:
        chunks.append(_rows_array(run, dim))
    return pa.chunked_array(chunks, pa.list_(pa.list_(pa.float32(), dim)))


def _rows_array(embs: list[np.ndarray], dim: int):
    """Rows (float32 [tokens, D] each) as one list<fixed_size_list<float32, D>> array; one row's is
    its buffer (pa.array of a contiguous float32 array is zero-copy)."""
    import pyarrow as pa

    lengths = np.array([len(e) for e in embs], np.int32)
    flat = (
        embs[0].reshape(-1)
        if len(embs) == 1
        else np.concatenate([np.zeros(0, np.float32), *(e.reshape(-1) for e in embs)])
    )
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), dim)
    return pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)), tokens)


def grid_array(grids):
    """(t, h, w) rows -> the `grid_thw` column: fixed_size_list<int64, 3>."""
    import pyarrow as pa

    return pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(grids, np.int64).reshape(-1)), 3)


def parts_dir(out: str | os.PathLike) -> pathlib.Path:
    out = pathlib.Path(out)
    return out.with_name(out.name + ".parts")


def part_files(out: str | os.PathLike) -> list[pathlib.Path]:
    """The completed parts of an unfinished run writing `out`, in order."""
    d = parts_dir(out)
    return sorted(d.glob("part-*.parquet")) if d.is_dir() else []


def read_keys(path: str | os.PathLike) -> list[str]:
    """The keys of one parquet embeddings file (its key column only)."""
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["key"]).column(0).to_pylist()


def read_keys_and_digests(path: str | os.PathLike) -> tuple[list[str], list[str | None]]:
    """The key and sha256 columns of one parquet embeddings file, in one read (what --resume needs)."""
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["key", "sha256"])
    return t.column(0).to_pylist(), t.column(1).to_pylist()


def read_metadata(path: str | os.PathLike) -> dict:
    import pyarrow.parquet as pq

    raw = (pq.read_schema(path).metadata or {}).get(META_KEY)
    if raw is None:
        raise ValueError(f"{path}: no {META_KEY.decode()} metadata: not written by `qwen-vit-jax encode`")
    return json.loads(raw)


def read_arrays(path: str | os.PathLike):
    """(keys, grid_thw int64 [k, 3], embeddings float32 [T, D], offsets [k + 1], timestamps [sum t],
    metadata) of one parquet embeddings file."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    meta = read_metadata(path)
    keys = table.column("key").to_pylist()
    grid = np.asarray(table.column("grid_thw").combine_chunks().flatten(), np.int64).reshape(-1, 3)
    emb_col = table.column("embedding").combine_chunks()
    offsets = np.asarray(emb_col.offsets, np.int64)
    tokens = emb_col.flatten()
    dim = tokens.type.list_size
    embeddings = np.asarray(tokens.flatten(), np.float32).reshape(-1, dim)
    stamps = []
    for (t, _, _), s in zip(grid, table.column("timestamps").to_pylist()):
        stamps.append(np.full(int(t), np.nan) if s is None else np.asarray(s, np.float64))
    timestamps = np.concatenate([np.zeros(0), *stamps])
    meta = dict(meta, sha256=table.column("sha256").to_pylist())
    return keys, grid, embeddings, offsets - offsets[0], timestamps, meta


class PartsWriter:
    """Rows appended in input order to the parts of `out` (see the module docstring)."""

    def __init__(self, out: str | os.PathLike, dim: int, metadata: dict):
        self.out, self.dim, self.metadata = pathlib.Path(out), dim, metadata
        self.dir = parts_dir(out)
        self.dir.mkdir(exist_ok=True)
        for stale in self.dir.glob("*.tmp"):  # a part a crashed run was writing: never completed
            stale.unlink()
        self._next = len(part_files(out))
        self._writer = self._tmp = None
        self._pending: list[tuple] = []
        self._pending_bytes = 0  # embedding bytes in `_pending`
        self._tmp_rows = 0  # rows written to the part in progress
        self.rows_in_parts = sum(num_rows(p) for p in part_files(out))
        self.bytes_in_parts = sum(p.stat().st_size for p in part_files(out))
        self.row_bytes: float | None = None  # bytes per row of the last part (what a row to come will take)

    def add(self, key: str, grid, emb: np.ndarray, stamps: np.ndarray, digest: str | None = None) -> None:
        self._pending.append((key, np.asarray(grid).reshape(3), np.asarray(emb, np.float32), stamps, digest))
        self._pending_bytes += self._pending[-1][2].nbytes
        if len(self._pending) >= ROWS_PER_GROUP or self._pending_bytes >= GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        import pyarrow.parquet as pq

        keys, grids, embs, stamps, digests = zip(*self._pending)
        table = rows_table(keys, grids, embs, stamps, self.dim, self.metadata, digests)
        # written and taken off `_pending` together: an interrupt between the two would write them twice
        with interrupts_deferred(), self._or_disk_full(table.nbytes, len(self._pending)):
            if self._writer is None:
                fd, tmp = tempfile.mkstemp(prefix=f"part-{self._next:05d}.", suffix=".parquet.tmp", dir=self.dir)
                os.close(fd)
                self._tmp = pathlib.Path(tmp)
                self._writer = pq.ParquetWriter(self._tmp, table.schema, **WRITE_OPTIONS)
            self._writer.write_table(table, row_group_size=ROWS_PER_GROUP)
            self._tmp_rows += len(self._pending)
            self._pending, self._pending_bytes = [], 0

    def checkpoint(self) -> None:
        """Everything added so far lands in a completed part (a crash after this loses none of it)."""
        self._flush()
        if self._writer is None:
            return
        with interrupts_deferred():  # the part renamed and this writer's state moved on together
            with self._or_disk_full(0, 0):
                self._writer.close()
                with open(self._tmp, "rb") as f:
                    os.fsync(f.fileno())
            rows, size = num_rows(self._tmp), self._tmp.stat().st_size
            os.replace(self._tmp, self.dir / f"part-{self._next:05d}.parquet")
            self._next += 1
            self.rows_in_parts += rows
            self.bytes_in_parts += size
            self.row_bytes = size / max(rows, 1)
            self._writer = self._tmp = None
            self._tmp_rows = 0

    @contextlib.contextmanager
    def _or_disk_full(self, more: int, rows: int):
        """A full disk in the block drops the part being written (its rows were never checkpointed)
        and raises DiskFull: those rows and `rows` more needed its bytes so far plus `more`."""
        try:
            yield
        except Exception as e:
            if not disk_full(e):
                raise
            written = self._tmp.stat().st_size if self._tmp is not None and self._tmp.exists() else 0
            self.row_bytes = self.row_bytes or (written + more) / max(self._tmp_rows + rows, 1)
            self.abandon()
            raise DiskFull(self.out, written + more, "writing the rows since the last checkpoint") from None

    def finish(self, old: pathlib.Path | None) -> int:
        """Merge `old` (the file being resumed, or None) and every part into `out`, atomically; remove
        the parts. Returns the row count."""
        self.checkpoint()
        sources = [*([old] if old is not None else []), *part_files(self.out)]
        if old is None and len(sources) == 1:  # the one part is OUT as merge would write it: renamed in
            umask = os.umask(0o22)
            os.umask(umask)
            os.chmod(sources[0], 0o666 & ~umask)  # mkstemp made it 0600
            os.replace(sources[0], self.out)
            fsync(self.out.parent)
            shutil.rmtree(self.dir, ignore_errors=True)
            return num_rows(self.out)
        try:
            rows = merge(sources, self.out, self.dim, self.metadata)
        except Exception as e:
            if not disk_full(e):
                raise
            # the merge writes a copy of every source beside them (then removes the parts)
            need = sum(f.stat().st_size for f in sources)
            raise DiskFull(self.out, need, "merging the checkpointed parts into it") from None
        shutil.rmtree(self.dir, ignore_errors=True)
        return rows

    def abandon(self) -> None:
        """Drop the part being written (its rows were not checkpointed); the folder goes too when
        no completed part is in it."""
        try:
            if self._writer is not None:
                self._writer.close()
        except Exception as e:  # noqa: BLE001 (closing writes the footer: a full disk fails it; dropped anyway)
            if not disk_full(e):
                raise
        finally:
            if self._tmp is not None:
                self._tmp.unlink(missing_ok=True)
            self._writer = self._tmp = None
            self._pending, self._pending_bytes, self._tmp_rows = [], 0, 0
        if not part_files(self.out):
            shutil.rmtree(self.dir, ignore_errors=True)


def merge(sources: list[pathlib.Path], out: pathlib.Path, dim: int, metadata: dict) -> int:
    """`sources` one after another into `out` (atomically: files.atomic_file), row group by row
    group; the metadata is `metadata`. Returns the rows written."""
    import pyarrow.parquet as pq

    rows = 0
    target = schema(dim, metadata)
    with atomic_file(out) as tmp, pq.ParquetWriter(tmp, target, **WRITE_OPTIONS) as writer:
        for src in sources:
            pf = pq.ParquetFile(src)
            for g in range(pf.metadata.num_row_groups):
                table = pf.read_row_group(g).replace_schema_metadata(target.metadata)
                writer.write_table(table.cast(target), row_group_size=ROWS_PER_GROUP)
                rows += table.num_rows
        if rows == 0:
            writer.write_table(rows_table([], [], [], [], dim, metadata))
    return rows


def read_row(path: pathlib.Path, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grid [3], embedding [tokens, D], timestamps [t]) of one row of a parquet embeddings file."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row < n:
            t = pf.read_row_group(g).slice(row, 1)
            grid = np.asarray(t.column("grid_thw")[0].as_py(), np.int64)
            emb = np.asarray(t.column("embedding")[0].as_py(), np.float32)
            s = t.column("timestamps")[0].as_py()
            return (
                grid,
                emb.reshape(-1, pf.schema_arrow.field("embedding").type.value_type.list_size),
                (np.full(int(grid[0]), np.nan) if s is None else np.asarray(s, np.float64)),
            )
        row -= n
    raise IndexError(f"{path} has no row {row}")


def num_rows(path: pathlib.Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows
