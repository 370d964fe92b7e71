"""The embeddings file format and its sharded sets (embeddings.py), the input grouping
(batching.py) and the multi-process helpers that need no second process (multihost.py). The
two-process run itself is in tests/test_cli.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from sample_images import make_image

import qwen_vit_jax as qvj
from qwen_vit_jax.data import embeddings
from qwen_vit_jax.data.inputs import image_patches
from qwen_vit_jax.preprocess.config import PreprocessConfig
from qwen_vit_jax.preprocess.images import preprocess_images
from qwen_vit_jax.runtime import batching, multihost

META = {
    "format": embeddings.FORMAT,
    "version": embeddings.VERSION,
    "checkpoint": "/ckpt",
    "dtype": "float32",
    "preprocess": {"min_pixels": 3136},
}


def make(names: list[str], seed: int = 0, meta: dict = META) -> embeddings.Embeddings:
    rng = np.random.default_rng(seed)
    grid = np.array([[1, 2 * (i + 1), 4] for i in range(len(names))], np.int64).reshape(-1, 3)
    lengths = grid[:, 1] * grid[:, 2] // 4
    return embeddings.Embeddings(
        rng.standard_normal((int(lengths.sum()), 8)).astype(np.float32),
        grid,
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        names,
        dict(meta),
    )


def assert_same(a: embeddings.Embeddings, b: embeddings.Embeddings) -> None:
    assert a.names == b.names
    np.testing.assert_array_equal(a.grid_thw, b.grid_thw)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    np.testing.assert_array_equal(a.embeddings, b.embeddings)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_timestamps_round_trip(tmp_path, suffix):
    """A video's seconds per temporal patch come back by input; images (and files written before
    videos, which have no `timestamps` array) give None."""
    grid = np.array([[1, 2, 4], [3, 2, 2], [2, 2, 2]], np.int64)  # an image, two videos
    lengths = grid.prod(axis=1) // 4
    ts = np.array([np.nan, 0.25, 1.25, 2.25, np.nan, np.nan])  # the last video's model reads no time
    e = embeddings.Embeddings(
        np.ones((int(lengths.sum()), 8), np.float32),
        grid,
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        ["a.png", "b.mp4", "c.mp4"],
        dict(META, video_preprocess={"fps": 2.0}),
        ts,
    )
    qvj.write_embeddings(tmp_path / f"e{suffix}", e)
    got = qvj.read_embeddings(tmp_path / f"e{suffix}")
    assert got.timestamps_of(0) is None and got.timestamps_of(2) is None
    assert got.timestamps_of(1).tolist() == [0.25, 1.25, 2.25]
    assert got.metadata["video_preprocess"] == {"fps": 2.0}
    both = embeddings.Embeddings.concatenate([got, make(["d.png"])], META)
    assert both.timestamps_of(1).tolist() == [0.25, 1.25, 2.25] and both.timestamps_of(3) is None
    e.timestamps = ts[:5]  # one short: inconsistent
    qvj.write_embeddings(tmp_path / f"bad{suffix}", e)
    with pytest.raises(embeddings.EmbeddingsError, match="inconsistent"):
        qvj.read_embeddings(tmp_path / f"bad{suffix}")


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_round_trip_and_public_names(tmp_path, suffix):
    e = make(["a.png", "b.jpg", "c.webp"])
    qvj.write_embeddings(tmp_path / f"e{suffix}", e)
    got = qvj.read_embeddings(tmp_path / f"e{suffix}")
    assert_same(got, e)
    assert got.metadata == e.metadata and len(got) == 3
    assert embeddings.read_names(tmp_path / f"e{suffix}") == e.names
    np.testing.assert_array_equal(got[1], e.embeddings[e.offsets[1] : e.offsets[2]])


def test_repr_is_a_summary():
    e = qvj.Embeddings(
        np.zeros((100_000, 8), np.float32),
        np.array([[1, 400, 1000]] * 3),
        np.array([0, 1, 2, 100_000]),
        ["a.png", "b.png", "c.png"],
        {"checkpoint": "ckpt", "dtype": "float32"},
    )
    text = repr(e)
    assert len(text) < 200 and "3 inputs" in text and "100000x8" in text and "'a.png'" in text, text
    one = qvj.Embeddings(np.zeros((4, 8), np.float32), np.array([[1, 4, 4]]), np.array([0, 4]), ["a.png"], {})
    assert repr(one).startswith("Embeddings(1 input, embeddings 4x8 float32"), repr(one)  # singular


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_sharded_set(tmp_path, suffix):
    out = tmp_path / f"emb{suffix}"
    assert embeddings.shard_path(out, 1, 2).name == f"emb-00001-of-00002{suffix}"
    parts = [make(["a", "b"], 0), make([], 1), make(["c"], 2)]  # an empty shard: fewer inputs than processes
    for i, p in enumerate(parts):
        qvj.write_embeddings(embeddings.shard_path(out, i, 3), p)
    index = embeddings.write_index(out, 3)
    assert index.name == f"emb{suffix}.index.json"
    doc = json.loads(index.read_text())
    assert [s["images"] for s in doc["shards"]] == [2, 0, 1] and doc["images"] == 3
    got = qvj.read_embeddings(out)
    assert_same(got, embeddings.Embeddings.concatenate(parts, META))
    assert got.metadata["shards"] == 3 and got.names == ["a", "b", "c"]

    qvj.write_embeddings(out, parts[0])  # a single file of the same name wins over the index
    assert qvj.read_embeddings(out).names == ["a", "b"]
    out.unlink()

    qvj.write_embeddings(embeddings.shard_path(out, 2, 3), make(["c", "d"], 2))  # rewritten after the index
    with pytest.raises(embeddings.EmbeddingsError, match="index .* says 1 / 2"):
        qvj.read_embeddings(out)
    qvj.write_embeddings(embeddings.shard_path(out, 2, 3), make(["c"], 2, dict(META, dtype="bfloat16")))
    with pytest.raises(embeddings.EmbeddingsError, match="dtype"):
        qvj.read_embeddings(out)
    embeddings.shard_path(out, 1, 3).unlink()
    with pytest.raises(FileNotFoundError, match="00001-of-00003"):
        qvj.read_embeddings(out)
    with pytest.raises(FileNotFoundError, match="shard not found"):
        embeddings.write_index(out, 3)
    index.write_text(json.dumps(dict(doc, format="something else")))
    with pytest.raises(embeddings.EmbeddingsError, match="not a version-1 embeddings index"):
        qvj.read_embeddings(out)
    index.unlink()
    with pytest.raises(FileNotFoundError, match="nor a sharded set"):
        qvj.read_embeddings(out)
    with pytest.raises(embeddings.EmbeddingsError, match=".safetensors, .npz or .parquet"):
        qvj.read_embeddings(tmp_path / "emb.h5")


def test_not_an_embeddings_file(tmp_path):
    (tmp_path / "x.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(embeddings.EmbeddingsError, match="not an embeddings file"):
        qvj.read_embeddings(tmp_path / "x.npz")
    bad = make(["a", "b"])
    bad.offsets[-1] += 1
    qvj.write_embeddings(tmp_path / "y.npz", bad)
    with pytest.raises(embeddings.EmbeddingsError, match="inconsistent"):
        qvj.read_embeddings(tmp_path / "y.npz")


def test_one_grouping_rule():
    """runtime/batching.Grouping: packs in order by budget (a larger item alone) and pixel form; a
    queue's call passes over items of another form or (batch plans) a frame class over 4x apart."""
    from qwen_vit_jax.runtime.batching import Grouping, Shape

    def img(rows, widest=64, form=("a",)):
        return Shape(rows, form, widest)

    rows = [img(64), img(80), img(256), img(88), img(16), img(60)]
    assert [[s.rows for s in b] for b in Grouping(160).pack(rows, lambda s: s)] == [[64, 80], [256], [88, 16], [60]]
    assert list(Grouping(10).pack([], lambda s: s)) == []
    forms = [img(8), img(8, form=("b",)), img(8)]
    assert [len(b) for b in Grouping(100).pack(forms, lambda s: s)] == [1, 1, 1]  # another form: a new call
    queue = [img(64, 1024), img(64, 64), img(64, 256), img(64, 1024, ("b",)), img(64, 1024), img(64, 1024)]
    batch, full = Grouping(192, batched=True).take(queue, lambda s: s)
    assert batch == [queue[0], queue[2], queue[4]] and full  # 64 is 16x below 1024; the next one does not fit
    batch, full = Grouping(1000).take(queue, lambda s: s)
    assert batch == [q for q in queue if q.form == ("a",)] and not full  # ladder plans: any frame classes
    with pytest.raises(ValueError, match="positive"):
        Grouping(0)


def test_split_even():
    sizes = np.random.default_rng(0).integers(16, 4096, 300)
    for parts in (1, 2, 3, 7):
        ranges = batching.split_even(sizes, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(sizes)
        assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))  # consecutive, covering
        totals = [int(sizes[a:b].sum()) for a, b in ranges]
        assert max(totals) - sizes.sum() / parts <= sizes.max()  # off the mean by at most one item
    assert batching.split_even([5, 5], 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]  # empty slices allowed
    assert batching.split_even(sizes, 3) == batching.split_even(sizes.tolist(), 3)  # deterministic


def test_image_patches_from_headers(tmp_path):
    cfg = PreprocessConfig()
    for i, (h, w) in enumerate([(56, 84), (300, 450), (40, 40), (1000, 30)]):
        make_image(h, w, seed=i).save(tmp_path / f"{i}.png")
        expected = len(preprocess_images([make_image(h, w, seed=i)], config=cfg)[0])
        assert image_patches(str(tmp_path / f"{i}.png"), cfg) == expected
    rotated = make_image(56, 140)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: the decoded image is 140 x 56
    rotated.save(tmp_path / "r.jpg", exif=exif)
    assert image_patches(str(tmp_path / "r.jpg"), cfg) == 10 * 4
    (tmp_path / "bad.png").write_bytes(b"nope")
    assert image_patches(str(tmp_path / "bad.png"), cfg) == 0
    paths = [str(tmp_path / f"{i}.png") for i in range(4)]
    shares = [
        multihost.share(paths, multihost.Cluster(index=i, count=2), lambda p: image_patches(p, cfg)) for i in range(2)
    ]
    assert shares[0] + shares[1] == paths


@pytest.mark.parametrize(
    "args,needle",
    [
        (("h:1", 2, None, False), "missing --process-id"),
        (("h", 2, 0, False), "HOST:PORT"),
        (("h:99999", 2, 0, False), "HOST:PORT"),
        (("h:1", 0, 0, False), "--num-processes must be >= 1"),
        (("h:1", 2, 2, False), r"--process-id must be in 0 \.\. 1"),
        (("h:1", 2, 0, True), "drop --distributed"),
    ],
)
def test_initialize_rejects_bad_flags(args, needle):
    with pytest.raises(ValueError, match=needle):
        multihost.initialize(*args)
    assert multihost.initialize(None, None, None) == multihost.Cluster(index=0, count=1)
