"""The embeddings file `qwen-vit-jax encode` writes, and its sharded form (one file per process).

    e = qvj.read_embeddings("emb.safetensors")   # one file, or the shards of a multi-process run
    e[i]                                          # input i's tokens [tokens_i, D]
    e.timestamps_of(i)                            # a video's seconds per temporal patch, or None
    qvj.write_embeddings("emb.npz", e)            # atomically

A run of N processes writes `emb-00000-of-0000N.safetensors` ... (one per process, each the
format below) and `emb.safetensors.index.json`, which lists them; `read_embeddings("emb.safetensors")`
finds the index when the file itself does not exist and returns the shards concatenated in shard
order, which is the single-process order of the inputs (processes take consecutive slices).
No jax here: reading embeddings needs numpy only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile
import zipfile

import numpy as np

from qwen_vit_jax.data.stream import count

FORMAT, VERSION = "qwen_vit_jax.embeddings", 1
INDEX_FORMAT = "qwen_vit_jax.embeddings.index"
SUFFIXES = (".safetensors", ".npz", ".parquet")

LAYOUT = """\
output layout (.safetensors, .npz or .parquet, chosen by OUT's extension), k inputs (images and
videos), T tokens in all; .safetensors and .npz:
  embeddings  float32 [T, D]   every input's merged tokens, inputs concatenated in input order
  grid_thw    int64   [k, 3]   (t, h, w) patch grid of each input (t = 1 for an image)
  offsets     int64   [k + 1]  input i is embeddings[offsets[i]:offsets[i+1]]
                               (t * (h / 2) * (w / 2) tokens, raster order over each merged frame)
  timestamps  float64 [sum t]  seconds of each temporal patch, inputs concatenated (input i's t
                               values follow the t values of the inputs before it); NaN for images
                               and for videos whose model reads no time (Qwen2-VL)
  names       the key of each input: a file's path as given on the command line (a folder
              joined with the file name), a webdataset sample's __key__, a row's key: .npz an
              array `names` [k] of str; .safetensors the JSON list in the header metadata under
              "names"
  metadata    format, version, checkpoint, dtype, image and video preprocessing settings
              (video: the frame sampling too), and "sha256": each input's content hash (the
              sha256 of its file's bytes; of its pixels for an in-memory image): .npz a JSON
              string `metadata`; .safetensors the header metadata
.parquet: a row per input, readable by pyarrow, pandas or datasets alone:
  key         string                             the input's key (as names above)
  grid_thw    fixed_size_list<int64, 3>          (t, h, w) patch grid
  embedding   list<fixed_size_list<float32, D>>  its merged tokens (bfloat16 runs: stored as float32)
  timestamps  list<float64>                      seconds of each temporal patch; null for images
  sha256      string                             the input's content hash (as in metadata above)
  the schema metadata's "qwen_vit_jax" key holds the metadata above as JSON
With several processes, process I of N writes OUT-stem-0000I-of-0000N.suffix in this layout and
process 0 then writes OUT.index.json listing the shards.
Read it back with numpy (np.load(OUT)), safetensors or pyarrow (pyarrow.parquet.read_table(OUT)),
or qwen_vit_jax.read_embeddings(OUT) (a single file or the sharded set, in input order).
"""


class EmbeddingsError(ValueError):
    """A file that is not an embeddings file (or sharded set) written by `qwen-vit-jax encode`."""


@dataclasses.dataclass
class Embeddings:
    """The contents of an embeddings file (see LAYOUT)."""

    embeddings: np.ndarray  # float32 [T, D]
    grid_thw: np.ndarray  # int64 [k, 3]
    offsets: np.ndarray  # int64 [k + 1]
    names: list[str]
    metadata: dict
    timestamps: np.ndarray | None = None  # float64 [sum t]; None: all NaN (a file of images only)

    def __post_init__(self):
        if self.timestamps is None and np.ndim(self.grid_thw) == 2:
            self.timestamps = np.full(int(np.sum(self.grid_thw[:, 0])), np.nan)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        """A summary: counts, shapes and the first names, never the arrays themselves."""
        names = ", ".join(repr(n) for n in self.names[:3]) + (", ..." if len(self.names) > 3 else "")
        shape = "x".join(map(str, np.shape(self.embeddings)))
        what = ", ".join(f"{k}={self.metadata[k]!r}" for k in ("checkpoint", "dtype") if k in self.metadata)
        dtype = np.asarray(self.embeddings).dtype
        return f"Embeddings({count(len(self), 'input')}, embeddings {shape} {dtype}, names [{names}]" + (
            f", {what})" if what else ")"
        )

    def __getitem__(self, i: int) -> np.ndarray:
        """Input i's tokens: [offsets[i+1] - offsets[i], D]."""
        return self.embeddings[self.offsets[i] : self.offsets[i + 1]]

    def timestamps_of(self, i: int) -> np.ndarray | None:
        """Input i's seconds per temporal patch, float64 [t_i]; None for an image or a video whose
        model reads no time."""
        start = int(np.sum(self.grid_thw[:i, 0]))
        ts = self.timestamps[start : start + int(self.grid_thw[i, 0])]
        return None if np.isnan(ts).all() else ts

    @classmethod
    def concatenate(cls, parts: list[Embeddings], metadata: dict) -> Embeddings:
        """`parts` one after another (offsets rebuilt), with `metadata` (and the parts' sha256
        lists joined, when every part has one)."""
        lengths = np.concatenate([np.diff(p.offsets) for p in parts])  # [k] tokens per image
        metadata = {k: v for k, v in metadata.items() if k != "sha256"}
        if all("sha256" in p.metadata for p in parts):
            metadata["sha256"] = [d for p in parts for d in p.metadata["sha256"]]
        return cls(
            np.concatenate([p.embeddings for p in parts]),
            np.concatenate([p.grid_thw for p in parts]),
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            [n for p in parts for n in p.names],
            metadata,
            np.concatenate([p.timestamps for p in parts]),
        )


def check_suffix(path: str | os.PathLike) -> str:
    """The suffix of an embeddings path (.safetensors, .npz or .parquet), else EmbeddingsError."""
    s = pathlib.Path(path).suffix.lower()
    if s not in SUFFIXES:
        raise EmbeddingsError(
            f"{path}: the output must end in .safetensors, .npz or .parquet, got {s or 'no extension'!r}"
        )
    return s


def shard_path(path: str | os.PathLike, index: int, count: int) -> pathlib.Path:
    """Process `index`'s file of a `count`-process run writing `path`: emb-00001-of-00002.safetensors."""
    path = pathlib.Path(path)
    if not 0 <= index < count:
        raise ValueError(f"shard {index} of {count}: the index must be in 0 .. {count - 1}")
    return path.with_name(f"{path.stem}-{index:05d}-of-{count:05d}{path.suffix}")


def index_path(path: str | os.PathLike) -> pathlib.Path:
    """The index of the sharded set written for `path`: emb.safetensors -> emb.safetensors.index.json."""
    path = pathlib.Path(path)
    return path.with_name(path.name + ".index.json")


def read_embeddings(path: str | os.PathLike) -> Embeddings:
    """Read what `qwen-vit-jax encode -o PATH` wrote: the file PATH, or when it does not exist,
    the sharded set of a multi-process run (PATH.index.json and its shards) in input order.
    Layout and consistency are checked (EmbeddingsError); a missing set is FileNotFoundError."""
    path = pathlib.Path(path)
    check_suffix(path)
    if path.is_file():
        return _read_file(path)
    index = index_path(path)
    if not index.is_file():
        raise FileNotFoundError(f"no such file: {path} (nor a sharded set's index {index.name})")
    try:
        doc = json.loads(index.read_text())
        ok = doc.get("format") == INDEX_FORMAT and doc.get("version") == VERSION
        shards = [(s["file"], int(s["images"]), int(s["tokens"])) for s in doc["shards"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise EmbeddingsError(f"{index}: not an embeddings index written by `qwen-vit-jax encode` ({e!r})") from None
    if not ok or not shards or any(pathlib.Path(f).name != f for f, _, _ in shards):
        raise EmbeddingsError(f"{index}: not a version-{VERSION} embeddings index written by `qwen-vit-jax encode`")
    parts = []
    for name, images, tokens in shards:
        e = _read_file(path.with_name(name))
        if (len(e), len(e.embeddings)) != (images, tokens):
            raise EmbeddingsError(
                f"{path.with_name(name)}: holds {len(e)} images / {len(e.embeddings)} tokens, "
                f"the index {index.name} says {images} / {tokens} (a shard rewritten later?)"
            )
        parts.append(e)
    for p, (name, _, _) in zip(parts[1:], shards[1:]):
        for key in ("checkpoint", "dtype", "preprocess", "video_preprocess"):
            if p.metadata.get(key) != parts[0].metadata.get(key):
                raise EmbeddingsError(
                    f"{name} was written with {key} {p.metadata.get(key)!r}, {shards[0][0]} with "
                    f"{parts[0].metadata.get(key)!r}: not one set"
                )
    return Embeddings.concatenate(parts, dict(parts[0].metadata, shards=len(parts)))


def _read_file(path: pathlib.Path) -> Embeddings:
    """One embeddings file (either format), its layout checked."""
    from qwen_vit_jax.weights.safetensors_io import SafetensorsFile

    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        if check_suffix(path) == ".parquet":
            from qwen_vit_jax.data import parquet

            names, grid, emb, offsets, stamps, meta = parquet.read_arrays(path)
            arrays = {"embeddings": emb, "grid_thw": grid, "offsets": offsets, "timestamps": stamps}
        elif check_suffix(path) == ".npz":
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            meta = json.loads(str(arrays.pop("metadata")))
            names = [str(n) for n in arrays.pop("names")]
        else:
            f = SafetensorsFile(path)
            arrays = {k: np.array(f.get(k)) for k in f.entries}  # copies: the file may be replaced later
            meta = dict(f.metadata)
            names = json.loads(meta.pop("names"))
            meta["version"], meta["preprocess"] = int(meta["version"]), json.loads(meta["preprocess"])
            for key in ("video_preprocess", "sha256"):
                if key in meta:
                    meta[key] = json.loads(meta[key])
        e = Embeddings(
            arrays["embeddings"], arrays["grid_thw"], arrays["offsets"], names, meta, arrays.get("timestamps")
        )
    except (KeyError, ValueError, TypeError, OSError, zipfile.BadZipFile, ImportError) as err:
        raise EmbeddingsError(f"{path}: not an embeddings file written by `qwen-vit-jax encode` ({err!r})") from None
    except Exception as err:  # noqa: BLE001 (pyarrow's own error types: a file that is not parquet)
        if type(err).__module__.startswith("pyarrow"):
            raise EmbeddingsError(f"{path}: not a parquet embeddings file ({err})") from None
        raise
    k = len(e.names)
    ok = (
        meta.get("format") == FORMAT
        and meta.get("version") == VERSION
        and e.embeddings.ndim == 2
        and e.grid_thw.shape == (k, 3)
        and e.offsets.shape == (k + 1,)
        and e.offsets[0] == 0
        and e.offsets[-1] == len(e.embeddings)
        and np.all(np.diff(e.offsets) >= 0)
        and e.timestamps.shape == (int(np.sum(e.grid_thw[:, 0])),)
    )
    if not ok:
        raise EmbeddingsError(
            f"{path}: not a version-{VERSION} embeddings file written by `qwen-vit-jax encode`, "
            "or its arrays are inconsistent"
        )
    return e


def write_embeddings(path: str | os.PathLike, e: Embeddings) -> None:
    """Write `e` to `path` (.safetensors, .npz or .parquet) atomically: a temporary sibling, fsynced,
    renamed."""
    from qwen_vit_jax.weights.safetensors_io import Rows

    emb = np.asarray(e.embeddings)
    write_rows(path, Rows([emb], emb.shape[1:], np.float32), e.grid_thw, e.offsets, e.timestamps, e.names, e.metadata)


def write_rows(path: str | os.PathLike, rows, grid_thw, offsets, timestamps, names: list[str], metadata: dict) -> None:
    """`write_embeddings` of the embeddings `rows` (a safetensors_io.Rows: float32 [n_i, D] parts
    joined along tokens, e.g. an encode run's rows one per input) with the other fields of an
    `Embeddings`: the same file, its parts written one after another, never joined in memory
    (.parquet: a part that holds several inputs is cut into views)."""
    from qwen_vit_jax.weights import safetensors_io

    path = pathlib.Path(path)
    suffix = check_suffix(path)
    grid_thw, offsets = np.asarray(grid_thw, np.int64), np.asarray(offsets, np.int64)
    timestamps = np.asarray(timestamps, np.float64)

    def write(tmp: str, fd: int) -> None:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            from qwen_vit_jax.data.parquet import rows_table

            os.close(fd)
            t = np.concatenate([[0], np.cumsum(grid_thw[:, 0])]).astype(int)
            stamps = [timestamps[t[i] : t[i + 1]] for i in range(len(names))]
            meta = {k: v for k, v in metadata.items() if k != "sha256"}  # a column in parquet
            embs = list(_inputs(rows, offsets))
            table = rows_table(names, grid_thw, embs, stamps, rows.rest[0], meta, metadata.get("sha256"))
            pq.write_table(table, tmp)
        elif suffix == ".npz":
            with os.fdopen(fd, "wb") as f:
                arrays = {"embeddings": rows, "grid_thw": grid_thw, "offsets": offsets, "timestamps": timestamps}
                savez(f, arrays | {"names": np.array(names, dtype=str), "metadata": np.array(json.dumps(metadata))})
                f.flush()
                os.fsync(f.fileno())
        else:
            os.close(fd)
            meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
            arrays = {"embeddings": rows, "grid_thw": grid_thw, "offsets": offsets, "timestamps": timestamps}
            safetensors_io.write_safetensors(tmp, arrays, dict(meta, names=json.dumps(names)))

    _atomic(path, write)


def _inputs(rows, offsets: np.ndarray):
    """Each input's tokens [offsets[i+1] - offsets[i], D] out of `rows`' parts: a view of the part
    that holds it (joined only for an input across parts)."""
    starts = np.concatenate([[0], np.cumsum([len(p) for p in rows.parts])]).astype(np.int64)
    for a, b in zip(offsets[:-1], offsets[1:]):
        k = int(np.searchsorted(starts, a, side="right")) - 1  # the part holding its first token
        if k < len(rows.parts) and b <= starts[k + 1]:
            yield np.asarray(rows.parts[k][a - starts[k] : b - starts[k]], np.float32)
        else:
            pieces = [p[max(a - s, 0) : max(b - s, 0)] for p, s in zip(rows.parts, starts[:-1])]
            yield np.concatenate([np.zeros((0, *rows.rest), np.float32), *pieces]).astype(np.float32)


def savez(f, arrays: dict) -> None:
    """np.savez(f, **arrays), byte for byte, where an array may be a safetensors_io.Rows: its parts
    written one after another into its member (np.savez would join them first). The members are
    stored (not compressed) and zip64, each a .npy file: numpy's header, then the data."""
    from qwen_vit_jax.weights.safetensors_io import Rows

    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, a in arrays.items():
            with z.open(name + ".npy", "w", force_zip64=True) as member:  # as numpy's _savez opens each
                if not isinstance(a, Rows):
                    np.lib.format.write_array(member, np.asanyarray(a))
                    continue
                header = {"descr": np.lib.format.dtype_to_descr(a.dtype), "fortran_order": False, "shape": a.shape}
                np.lib.format.write_array_header_1_0(member, header)  # what write_array writes for this shape
                for part in a.parts:
                    member.write(np.ascontiguousarray(part, a.dtype).reshape(-1).view(np.uint8))


def write_index(path: str | os.PathLike, count: int) -> pathlib.Path:
    """Write PATH.index.json for the `count` shards of PATH (all must exist and be readable;
    their image and token counts go into the index, so a shard rewritten later is noticed).
    Returns the index path."""
    path = pathlib.Path(path)
    shards = []
    for i in range(count):
        images, tokens = _counts(shard_path(path, i, count))
        shards.append({"file": shard_path(path, i, count).name, "images": images, "tokens": tokens})
    doc = {
        "format": INDEX_FORMAT,
        "version": VERSION,
        "images": sum(s["images"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "shards": shards,
    }

    def write(tmp: str, fd: int) -> None:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())

    _atomic(index_path(path), write)
    return index_path(path)


def read_names(path: str | os.PathLike) -> list[str]:
    """The image names of one embeddings file, without reading its embeddings (the header of a
    .safetensors file, the `names` member of a .npz)."""
    from qwen_vit_jax.weights.safetensors_io import SafetensorsFile

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        if check_suffix(path) == ".parquet":
            from qwen_vit_jax.data.parquet import read_keys

            return read_keys(path)
        if check_suffix(path) == ".npz":
            with np.load(path, allow_pickle=False) as z:
                return [str(n) for n in z["names"]]
        names = json.loads(SafetensorsFile(path).metadata["names"])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("names is not a list of str")
        return names
    except (KeyError, ValueError, TypeError, OSError, zipfile.BadZipFile) as err:
        raise EmbeddingsError(f"{path}: not an embeddings file written by `qwen-vit-jax encode` ({err!r})") from None


def _counts(path: pathlib.Path) -> tuple[int, int]:
    """(images, tokens) of an embeddings file, from its header / offsets only (a shard's embeddings
    can be gigabytes; read_embeddings checks the whole file later)."""
    from qwen_vit_jax.weights.safetensors_io import SafetensorsFile

    if not path.is_file():
        raise FileNotFoundError(
            f"shard not found: {path} (on several hosts, OUT must be on a file system all of them share)"
        )
    try:
        if check_suffix(path) == ".parquet":
            import pyarrow.parquet as pq

            from qwen_vit_jax.data.parquet import read_metadata

            grid = pq.read_table(path, columns=["grid_thw"]).column(0).combine_chunks().flatten()
            merge = read_metadata(path)["preprocess"]["merge_size"]  # tokens from the grids: no embedding read
            return len(grid) // 3, int(np.prod(np.asarray(grid, np.int64).reshape(-1, 3), axis=1).sum()) // merge**2
        if check_suffix(path) == ".npz":
            with np.load(path, allow_pickle=False) as z:
                offsets = z["offsets"]
            return len(offsets) - 1, int(offsets[-1])
        entries = SafetensorsFile(path).entries
        return entries["offsets"][1][0] - 1, entries["embeddings"][1][0]
    except (KeyError, ValueError, TypeError, OSError, IndexError, zipfile.BadZipFile) as err:
        raise EmbeddingsError(f"{path}: not an embeddings file written by `qwen-vit-jax encode` ({err!r})") from None


def _atomic(path: pathlib.Path, write) -> None:
    """write(tmp_path, fd) a temporary sibling of `path`, then rename it over `path`; on any
    failure (Ctrl-C included) the temporary file is removed and `path` is untouched."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        write(tmp, fd)
        umask = os.umask(0o22)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; the result is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run_metadata(checkpoint: str, dtype: str, preprocessing, **extra) -> dict:
    """An embeddings file's metadata, for `encode`'s files and the service's safetensors answers
    alike: the format and version, the checkpoint as the writer names it, the dtype, both
    preprocessing settings as the items were prepared (a `Preprocessing`; what --resume checks,
    sinks.RESUME_KEYS) and `extra` entries (the service: each item's sha256)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "checkpoint": checkpoint,
        "dtype": dtype,
        "preprocess": preprocessing.image.to_dict(),
        "video_preprocess": preprocessing.video.to_dict(),
        **extra,
    }
