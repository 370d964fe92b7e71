"""The embeddings writers write rows from where they are held (a long video's row can be most of
memory): safetensors_io.write_safetensors (a tensor in parts, `Rows`), embeddings.write_rows (the
.npz members part by part, the parquet column a chunk per large row) and sinks.MemorySink. Their
files are the bytes of the joined arrays written the packages' way (safetensors.numpy.save_file with
the metadata sorted, np.savez, one parquet chunk), and writing holds no second copy of the rows."""

from __future__ import annotations

import io
import json
import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from qwen_vit_jax.data import embeddings, parquet, sinks
from qwen_vit_jax.weights.safetensors_io import Rows, write_safetensors

META = {
    "format": embeddings.FORMAT,
    "version": embeddings.VERSION,
    "checkpoint": "/ckpt",
    "dtype": "float32",
    "preprocess": {"min_pixels": 3136},
    "video_preprocess": {"fps": 2.0},
}
NAMES = ["a.png", 'b "quoted"\n.mp4', "c \u00e9\u2028\x1f.webp", "d"]


def package_file(path, tensors: dict, metadata: dict | None) -> bytes:
    """What the `safetensors` package writes for `tensors`, with the header's metadata put in sorted
    key order (the package's order is a per-process hash's; the file keeps its header length)."""
    arrays = {}
    for k, v in tensors.items():
        a = np.asarray(v)
        a = a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
        arrays[k] = a if a.flags.c_contiguous else a.copy(order="C")
    save_file(arrays, path, metadata=metadata)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    if metadata:
        head = json.loads(raw[8 : 8 + n])
        head["__metadata__"] = dict(sorted(head["__metadata__"].items()))
        new = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
        raw = raw[:8] + new + b" " * (n - len(new)) + raw[8 + n :]
    return raw


def rows(seed: int, big: int = 0) -> list[tuple[str, tuple, str | None]]:
    """(key, (grid, tokens [n, 8], timestamps), sha256) of four inputs; input 1 a video of `big`
    tokens when given (a row over parquet.JOIN_BYTES at D = 8 from 32,768 tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, name in enumerate(NAMES):
        grid = np.array([1 + i % 2, 2 * (i + 1), 4])
        if i == 1 and big:
            grid = np.array([big // 8, 4, 8])
        n = int(np.prod(grid)) // 4
        stamps = np.arange(grid[0]) * 0.5 if i % 2 else np.full(grid[0], np.nan)
        out.append(
            (name, (grid, rng.standard_normal((n, 8)).astype(np.float32), stamps), None if i == 3 else f"{i:064x}")
        )
    return out


def test_write_safetensors_is_the_packages_file(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "embeddings": rng.standard_normal((5, 3)).astype(np.float32),
        "grid_thw": np.arange(6).reshape(2, 3),
        "timestamps": np.full(2, np.nan),
        "z.bf16": np.ones(3, ml_dtypes.bfloat16),
        'n\u00e9"\n\x01': np.ones(2, np.uint8),
        "bool": np.array([True, False]),
        "scalar": np.float32(3.5),
        "empty": np.zeros((0, 4), np.float32),
        "transposed": rng.standard_normal((3, 4)).astype(np.float32).T,
        "bigendian": np.arange(4, dtype=">f4"),
        "i8": np.arange(3, dtype=np.int8),
        "f16": np.ones(2, np.float16),
        "i32": np.ones(1, np.int32),
    }
    names = json.dumps(NAMES)
    for metadata in (None, {"format": "pt"}, {k: str(i) for i, k in enumerate("zyxw")} | {"names": names}):
        for some in (tensors, {"a": np.ones(2)}):
            write_safetensors(tmp_path / "ours.safetensors", some, metadata)
            want = package_file(tmp_path / "package.safetensors", some, metadata)
            assert (tmp_path / "ours.safetensors").read_bytes() == want, (metadata, list(some))
    joined = rng.standard_normal((7, 3)).astype(np.float32)
    parts = Rows([joined[:2], joined[2:2], joined[2:].astype(np.float64)], (3,), np.float32)  # cast part by part
    write_safetensors(tmp_path / "ours.safetensors", {"x": parts, "y": np.arange(3)}, {"a": "b"})
    want = package_file(tmp_path / "package.safetensors", {"x": joined, "y": np.arange(3)}, {"a": "b"})
    assert (tmp_path / "ours.safetensors").read_bytes() == want
    with pytest.raises(ValueError, match="among rows"):
        Rows([joined, np.zeros((2, 4), np.float32)], (3,), np.float32)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".parquet"])
def test_rows_in_parts_write_the_joined_file(tmp_path, suffix, monkeypatch):
    """write_rows of an input per part (and a part of several inputs) == the joined arrays written
    the packages' way: save_file (sorted metadata), np.savez, and a one-chunk parquet table."""
    monkeypatch.setattr(time, "time", lambda: 1.7e9)  # a zip member's date is the time of writing
    given = rows(1, big=40000)
    parts = [r[1] for _, r, _ in given]
    parts = [np.concatenate(parts[:1] + parts[2:3]), parts[1], parts[3]]  # inputs 0, 2 in one part
    order = [0, 2, 1, 3]
    e = embeddings.Embeddings(
        np.concatenate([given[i][1][1] for i in order]),
        np.stack([given[i][1][0] for i in order]),
        np.concatenate([[0], np.cumsum([len(given[i][1][1]) for i in order])]).astype(np.int64),
        [given[i][0] for i in order],
        dict(META, sha256=[given[i][2] for i in order]),
        np.concatenate([given[i][1][2] for i in order]),
    )
    out = tmp_path / f"rows{suffix}"
    embeddings.write_rows(out, Rows(parts, (8,), np.float32), e.grid_thw, e.offsets, e.timestamps, e.names, e.metadata)
    if suffix == ".safetensors":
        meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in e.metadata.items()}
        arrays = {"embeddings": e.embeddings, "grid_thw": e.grid_thw, "offsets": e.offsets, "timestamps": e.timestamps}
        want = package_file(tmp_path / "package.safetensors", arrays, dict(meta, names=json.dumps(e.names)))
    elif suffix == ".npz":
        buf = io.BytesIO()
        np.savez(
            buf,
            embeddings=e.embeddings,
            grid_thw=e.grid_thw,
            offsets=e.offsets,
            timestamps=e.timestamps,
            names=np.array(e.names, dtype=str),
            metadata=np.array(json.dumps(e.metadata)),
        )
        want = buf.getvalue()
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        lengths = np.diff(e.offsets).astype(np.int32)
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(e.embeddings.reshape(-1)), 8)
        column = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)), tokens)
        meta = {k: v for k, v in e.metadata.items() if k != "sha256"}
        t = np.concatenate([[0], np.cumsum(e.grid_thw[:, 0])])
        stamps = [e.timestamps[a:b] for a, b in zip(t[:-1], t[1:])]
        table = parquet.rows_table(e.names, e.grid_thw, [e[i] for i in range(4)], stamps, 8, meta, e.metadata["sha256"])
        table = table.set_column(2, table.schema.field(2), column)
        assert table.column(2).num_chunks == 1 and parquet.embedding_array(parts, 8).num_chunks == 3
        pq.write_table(table, tmp_path / "package.parquet")
        want = (tmp_path / "package.parquet").read_bytes()
    assert out.read_bytes() == want
    got = embeddings.read_embeddings(out)
    np.testing.assert_array_equal(got.embeddings, e.embeddings)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_a_memory_sink_saves_without_a_second_copy(tmp_path, suffix):
    """Saving (a checkpoint, the end, a resumed file's old rows and new) allocates far less than the
    rows it holds: a 32 MB row is written from where it is, never joined with the others."""
    target = tmp_path / f"out{suffix}"
    sink = sinks.open_sink(target, META, 8, resume=False)
    for key, row, digest in rows(2, big=1 << 20):  # input 1: 1 Mi tokens x 8 floats, 32 MiB
        sink.add(key, row, digest)
    held = sum(r[1].nbytes for _, r, _ in sink.rows)
    tracemalloc.start()
    try:
        sink.checkpoint()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < held / 4, (peak, held)
    sink = sinks.open_sink(target, META, 8, resume=True)  # the old rows read back, then one more
    key, row, digest = rows(3)[0]
    sink.add("e", row, digest)
    tracemalloc.start()
    try:
        sink.finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < held / 4, (peak, held)
    got = embeddings.read_embeddings(target)
    assert got.names == [*NAMES, "e"] and got.metadata["sha256"] == [*[d for _, _, d in rows(2)], digest]
    np.testing.assert_array_equal(got[1], rows(2, big=1 << 20)[1][1][1])
