"""Datasets at scale: every source kind (folders, webdataset shards, parquet files, HF datasets,
globs) encodes to what `encode_images` gives on the same images; the parquet output reads in pyarrow
alone; --resume after an interrupt or a crash gives every key once, bit for bit a clean run's;
duplicate keys; identical inputs encoded once; the content-hash cache (hits, corrupt entries); two
processes sharding shards and row ranges; Ray Data's stages on a local Ray."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from cli_runs import WITHOUT_TORCH, assert_clean_error, main, run_processes
from sample_images import make_image

from qwen_vit_jax.data import parquet
from qwen_vit_jax.data.embeddings import read_embeddings
from qwen_vit_jax.data.inputs import load_image
from qwen_vit_jax.data.sources import expand
from qwen_vit_jax.tools import encode as encode_cmd
from qwen_vit_jax.tools.demo import TINY

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SIZES = [(56, 84), (112, 84), (84, 140), (70, 70), (140, 56), (84, 84)]


def _blob(i: int) -> bytes:
    """Image i's file bytes: PNG for even i, JPEG for odd."""
    buf = io.BytesIO()
    im = make_image(*SIZES[i % len(SIZES)], seed=i)
    im.save(buf, "PNG") if i % 2 == 0 else im.save(buf, "JPEG", quality=92)
    return buf.getvalue()


BLOBS = [_blob(i) for i in range(len(SIZES))]


@pytest.fixture(scope="module")
def reference(tiny_encoder):
    """encode_images on the decoded BLOBS: what every source must give."""
    return tiny_encoder.encode_images([load_image(b) for b in BLOBS])


def close(a, ref) -> None:
    """Equal at the house's fp32 bar for the same computation: relative Frobenius error <= 1e-6
    (inputs packed into other calls may differ in the last bits)."""
    a = np.asarray(a, np.float32)
    assert a.shape == ref.shape and np.linalg.norm(a - ref) <= 1e-6 * np.linalg.norm(ref)


def check(out, keys, refs) -> None:
    e = read_embeddings(out)
    assert e.names == list(keys)
    for i, ref in enumerate(refs):
        close(e[i], ref)


def write_tar(path, samples) -> None:
    """A webdataset shard: samples = [(key, {ext: bytes})], members KEY.EXT in order."""
    with tarfile.open(path, "w") as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def write_parquet(path, blobs, struct: bool = False, ids=None, row_group_size: int = 2) -> None:
    col = [{"bytes": b, "path": None} for b in blobs] if struct else blobs
    cols = {"image": col, **({"id": ids} if ids is not None else {})}
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)


def encode(capsys, ckpt, *args):
    return main(capsys, "encode", ckpt, *map(str, args), "--workers", "0")


# ---- every source kind == encode_images ---------------------------------------------------------------
def test_folder_and_webdataset_shards(capsys, tiny_dirs, reference, tmp_path):
    _, ckpt = tiny_dirs
    folder = tmp_path / "photos"
    folder.mkdir()
    for i, b in enumerate(BLOBS):
        (folder / f"{i}.{'png' if i % 2 == 0 else 'jpg'}").write_bytes(b)
    out = tmp_path / "folder.parquet"
    rc, _, err = encode(capsys, ckpt, folder, "-o", out)
    assert rc == 0, err
    check(out, [str(folder / f"{i}.{'png' if i % 2 == 0 else 'jpg'}") for i in range(6)], reference)

    # Two shards (keys with a folder part, a caption-only sample that is no input, field spellings).
    ext = ["png", "jpeg", "png", "jpg", "png", "JPG"]
    write_tar(tmp_path / "s-0.tar", [(f"a/k{i}", {ext[i]: BLOBS[i], "txt": b"caption"}) for i in range(3)])
    write_tar(tmp_path / "s-1.tar", [("text-only", {"txt": b"x"})] + [(f"k{i}", {ext[i]: BLOBS[i]}) for i in (3, 4, 5)])
    keys = ["a/k0", "a/k1", "a/k2", "k3", "k4", "k5"]
    import webdataset as wds  # the reference reader: our keys are its __key__

    theirs = [s["__key__"] for s in wds.WebDataset([str(tmp_path / f"s-{i}.tar") for i in (0, 1)], shardshuffle=False)]
    assert [k for k in theirs if k != "text-only"] == keys
    out = tmp_path / "wds.safetensors"  # both output forms read every source
    rc, _, err = main(capsys, "encode", ckpt, tmp_path / "s-*.tar", "-o", out, "--workers", "1")  # read in a worker
    assert rc == 0, err
    check(out, keys, reference)


def test_parquet_files(capsys, tiny_dirs, reference, tmp_path):
    _, ckpt = tiny_dirs
    write_parquet(tmp_path / "raw.parquet", BLOBS[:3])
    write_parquet(tmp_path / "hf.parquet", BLOBS[3:], struct=True)  # HF's {"bytes", "path"} struct
    out = tmp_path / "out.parquet"
    rc, out_text, err = encode(capsys, ckpt, tmp_path / "raw.parquet", tmp_path / "hf.parquet", "-o", out)
    assert rc == 0, err
    check(out, [f"raw.parquet:{i}" for i in range(3)] + [f"hf.parquet:{i}" for i in range(3)], reference)
    assert "6 encoded, 0 reused" in out_text

    ids = [f"img-{i}" for i in range(6)]
    write_parquet(tmp_path / "ids.parquet", BLOBS, ids=ids, row_group_size=4)
    out2 = tmp_path / "ids.parquet.out.parquet"
    rc, _, err = encode(capsys, ckpt, tmp_path / "ids.parquet", "--key-column", "id", "-o", out2)
    assert rc == 0, err
    check(out2, ids, reference)

    rc, _, err = encode(capsys, ckpt, tmp_path / "raw.parquet", "--image-column", "jpg", "-o", tmp_path / "x.parquet")
    assert_clean_error(rc, err, "has no column 'jpg' (--image-column); its columns: image")


def test_hf_datasets(capsys, tiny_dirs, reference, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    _, ckpt = tiny_dirs
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    feats = datasets.Features({"image": datasets.Image(), "name": datasets.Value("string")})
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"image": BLOBS[:4], "name": list("abcd")}, features=feats),
        test=datasets.Dataset.from_dict({"image": BLOBS[4:], "name": list("ef")}, features=feats),
    )
    dd.save_to_disk(tmp_path / "saved")
    out = tmp_path / "saved.parquet"
    rc, _, err = encode(capsys, ckpt, tmp_path / "saved", "-o", out)
    assert rc == 0, err
    check(out, ["train:0", "train:1", "train:2", "train:3", "test:0", "test:1"], reference)
    rc, _, err = encode(capsys, ckpt, tmp_path / "saved" / "test", "--key-column", "name", "-o", tmp_path / "t.npz")
    assert rc == 0, err
    check(tmp_path / "t.npz", ["e", "f"], reference[4:])

    # hf:NAME: a dataset `datasets` finds offline (here a local folder of parquet files, cached on load)
    (tmp_path / "hub").mkdir()
    dd["train"].to_parquet(tmp_path / "hub" / "train.parquet")
    rc, _, err = encode(capsys, ckpt, f"hf:{tmp_path / 'hub'}:train", "-o", tmp_path / "hub.parquet")
    assert rc == 0, err
    check(tmp_path / "hub.parquet", [f"train:{i}" for i in range(4)], reference[:4])
    rc, _, err = encode(capsys, ckpt, "hf:no-such-org/no-such-dataset", "-o", tmp_path / "none.parquet")
    assert_clean_error(rc, err, "not in the local HF cache (offline: nothing is downloaded)")


def test_bad_record_named_by_shard_and_key(capsys, tiny_dirs, reference, tmp_path):
    _, ckpt = tiny_dirs
    write_tar(
        tmp_path / "s.tar",
        [("good0", {"png": BLOBS[0]}), ("broken", {"jpg": b"not a jpeg"}), ("good1", {"jpg": BLOBS[1]})],
    )
    out = tmp_path / "out.parquet"
    rc, _, err = encode(capsys, ckpt, tmp_path / "s.tar", "-o", out)
    assert_clean_error(rc, err, "cannot read broken: in ", "s.tar", "--keep-going")
    rc, _, err = encode(capsys, ckpt, tmp_path / "s.tar", "-o", out, "--resume", "--keep-going")
    assert rc == 1 and "warning: skipped broken: in " in err and "s.tar" in err
    check(out, ["good0", "good1"], reference[:2])


# ---- the parquet file -----------------------------------------------------------------------------------
def test_parquet_reads_in_pyarrow_alone(capsys, tiny_dirs, reference, tmp_path):
    _, ckpt = tiny_dirs
    write_parquet(tmp_path / "in.parquet", BLOBS)
    out = tmp_path / "out.parquet"
    assert encode(capsys, ckpt, tmp_path / "in.parquet", "-o", out)[0] == 0
    code = (
        "import sys, json; sys.modules['qwen_vit_jax'] = None\n"  # our package cannot be imported
        "import numpy as np, pyarrow.parquet as pq\n"
        f"t = pq.read_table({str(out)!r})\n"
        "meta = json.loads(t.schema.metadata[b'qwen_vit_jax'])\n"
        "rows = t.to_pylist()\n"
        "print(json.dumps({'meta': meta, 'keys': [r['key'] for r in rows], 'grid': [r['grid_thw'] for r in rows],"
        " 'emb': [np.asarray(r['embedding'], np.float32).tolist() for r in rows],"
        " 'times': [r['timestamps'] for r in rows], 'types': [str(f.type) for f in t.schema]}))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["meta"]["dtype"] == "float32" and doc["meta"]["format"] == "qwen_vit_jax.embeddings"
    assert doc["types"][:3] == [
        "string",
        "fixed_size_list<element: int64>[3]",
        f"list<element: fixed_size_list<element: float>[{TINY.out_dim}]>",
    ]
    assert doc["keys"] == [f"in.parquet:{i}" for i in range(6)] and doc["times"] == [None] * 6
    for emb, grid, ref in zip(doc["emb"], doc["grid"], reference):
        assert grid[0] == 1 and len(emb) == grid[1] * grid[2] // 4
        close(np.asarray(emb, np.float32), ref)


# ---- exactly once ------------------------------------------------------------------------------------------
class _Failing:
    """The tiny encoder, failing on its `at`-th call with `error`."""

    def __init__(self, enc, at: int, error):
        self.enc, self.at, self.error, self.calls = enc, at, error, 0

    def __getattr__(self, name):
        return getattr(self.enc, name)

    def encode(self, pixel_values, grid_thw):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.enc.encode(pixel_values, grid_thw)


@pytest.mark.parametrize("kind", ["tar", "parquet"])
def test_resume_after_interrupt_and_crash_equals_clean(capsys, tiny_dirs, tiny_encoder, tmp_path, monkeypatch, kind):
    """Ctrl-C, then a crash (an error nothing catches, after some parts were checkpointed), then
    --resume: every key once, in input order, the same bits as a clean run."""
    _, ckpt = tiny_dirs
    blobs = BLOBS * 3  # 18 inputs; the same bytes under different keys are encoded once (reused)
    if kind == "tar":
        write_tar(tmp_path / "a.tar", [(f"k{i:02d}", {"png": b}) for i, b in enumerate(blobs[:9])])
        write_tar(tmp_path / "b.tar", [(f"k{i:02d}", {"png": b}) for i, b in enumerate(blobs[9:], 9)])
        inputs = [tmp_path / "a.tar", tmp_path / "b.tar"]
    else:
        write_parquet(tmp_path / "in.parquet", blobs, ids=[f"k{i:02d}" for i in range(18)])
        inputs = [tmp_path / "in.parquet", "--key-column", "id"]
    clean = tmp_path / "clean.parquet"
    assert encode(capsys, ckpt, *inputs, "-o", clean, "--batch-patches", "100")[0] == 0
    out = tmp_path / "out.parquet"
    args = (*inputs, "-o", out, "--batch-patches", "100")  # two or three images per call

    monkeypatch.setattr(encode_cmd, "load_encoder", lambda *a: _Failing(tiny_encoder, 2, KeyboardInterrupt()))
    rc, _, err = encode(capsys, ckpt, *args)
    assert rc == 130 and "new input" in err and "written" in err, err
    first = read_embeddings(out).names
    assert 0 < len(first) < 18
    rc, _, err = encode(capsys, ckpt, *args)
    assert_clean_error(rc, err, "exists: --resume adds the missing inputs")

    monkeypatch.setattr(encode_cmd, "load_encoder", lambda *a: _Failing(tiny_encoder, 2, RuntimeError("crash")))
    with pytest.raises(RuntimeError, match="crash"):  # nothing finishes: OUT stays as it was, parts are left
        encode(capsys, ckpt, *args, "--resume", "--save-every", "0")  # a part checkpointed after every input
    capsys.readouterr()
    assert read_embeddings(out).names == first and parquet.part_files(out)
    rc, _, err = encode(capsys, ckpt, *args)
    assert_clean_error(rc, err, "exists: --resume")

    monkeypatch.undo()
    rc, text, err = encode(capsys, ckpt, *args, "--resume")
    assert rc == 0, err
    assert not parquet.parts_dir(out).exists()
    a, b = read_embeddings(clean), read_embeddings(out)
    assert b.names == a.names == [f"k{i:02d}" for i in range(18)]  # every key once, in input order
    np.testing.assert_array_equal(b.embeddings, a.embeddings)  # the same bits
    np.testing.assert_array_equal(b.grid_thw, a.grid_thw)
    rc, text, _ = encode(capsys, ckpt, *args, "--resume")
    assert rc == 0 and "nothing to do" in text


def test_duplicate_keys(capsys, tiny_dirs, reference, tmp_path):
    _, ckpt = tiny_dirs
    write_tar(tmp_path / "a.tar", [(f"k{i}", {"png": BLOBS[i]}) for i in range(3)])
    write_tar(tmp_path / "b.tar", [(f"k{i}", {"jpg": BLOBS[i + 3]}) for i in range(2)])
    out = tmp_path / "out.parquet"
    rc, _, err = encode(capsys, ckpt, tmp_path / "a.tar", tmp_path / "b.tar", "-o", out)
    assert_clean_error(rc, err, "2 keys occur more than once: 'k0' (2x), 'k1' (2x)", "--allow-duplicate-keys")
    assert not out.exists() and not parquet.parts_dir(out).exists()
    rc, _, err = encode(capsys, ckpt, tmp_path / "a.tar", tmp_path / "b.tar", "-o", out, "--allow-duplicate-keys")
    assert rc == 0, err
    check(out, ["k0", "k1", "k2", "k0", "k1"], reference[:5])
    rc, text, _ = encode(
        capsys, ckpt, tmp_path / "a.tar", tmp_path / "b.tar", "-o", out, "--allow-duplicate-keys", "--resume"
    )
    assert rc == 0 and "nothing to do" in text  # each key counted as often as it occurs


# ---- identical inputs and the cache --------------------------------------------------------------------------
def test_same_bytes_encoded_once_and_the_cache(capsys, tiny_dirs, reference, tmp_path):
    _, ckpt = tiny_dirs
    keys = ["a", "b", "a-again", "c", "b-again"]
    blobs = [BLOBS[0], BLOBS[1], BLOBS[0], BLOBS[2], BLOBS[1]]
    write_parquet(tmp_path / "in.parquet", blobs, ids=keys)
    refs = [reference[i] for i in (0, 1, 0, 2, 1)]
    args = (tmp_path / "in.parquet", "--key-column", "id", "--cache", tmp_path / "cache")
    rc, text, err = encode(capsys, ckpt, *args, "-o", tmp_path / "1.parquet")
    assert rc == 0, err
    assert "3 encoded, 2 reused (the same bytes earlier in this run), 0 from the cache" in text
    check(tmp_path / "1.parquet", keys, refs)
    rc, text, err = encode(capsys, ckpt, *args, "-o", tmp_path / "2.safetensors")
    assert rc == 0 and "0 encoded, 0 reused (the same bytes earlier in this run), 5 from the cache" in text, err
    check(tmp_path / "2.safetensors", keys, refs)

    entries = sorted((tmp_path / "cache").rglob("*.safetensors"))
    assert len(entries) == 3 and {e.parent.parent for e in entries} == {tmp_path / "cache"}  # one folder level
    raw = bytearray(entries[0].read_bytes())
    raw[-3] ^= 0xFF  # a flipped bit in an embedding: the checksum catches it
    entries[0].write_bytes(bytes(raw))
    entries[1].write_bytes(entries[1].read_bytes()[:40])  # a torn write
    rc, text, err = encode(capsys, ckpt, *args, "-o", tmp_path / "3.parquet")
    assert rc == 0 and "2 encoded" in text, err  # both recomputed, never returned
    check(tmp_path / "3.parquet", keys, refs)
    rc, text, err = encode(capsys, ckpt, *args, "-o", tmp_path / "4.parquet")
    assert rc == 0 and "5 from the cache" in text  # and rewritten whole

    rc, text, err = encode(capsys, ckpt, *args, "-o", tmp_path / "5.parquet", "--max-pixels", "5000")
    assert rc == 0 and "3 encoded" in text, err  # other preprocessing: other entries
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 6


# ---- several processes -----------------------------------------------------------------------------------------
def test_two_processes_shard_by_shard_and_by_rows(capsys, tiny_dirs, tmp_path):
    """Three shards over two processes (whole shards each), then one parquet file (row ranges)."""
    _, ckpt = tiny_dirs
    for s in range(3):
        write_tar(tmp_path / f"s{s}.tar", [(f"s{s}-{i}", {"png": BLOBS[(s + i) % 6]}) for i in range(2 + s)])
    ref = tmp_path / "ref.parquet"
    assert encode(capsys, ckpt, tmp_path / "s*.tar", "-o", ref)[0] == 0
    out = tmp_path / "out.parquet"
    results = run_processes(2, "encode", ckpt, tmp_path / "s*.tar", "-o", out, "--workers", "0")
    assert all(rc == 0 for rc, _ in results), results
    shard0, shard1 = (parquet.read_keys(tmp_path / f"out-0000{i}-of-00002.parquet") for i in (0, 1))
    assert {k.split("-")[0] for k in shard0}.isdisjoint({k.split("-")[0] for k in shard1})  # whole shards
    a, b = read_embeddings(ref), read_embeddings(out)
    assert b.names == a.names
    close(b.embeddings, a.embeddings)

    # (--resume of a lost process file: test_cli.test_encode_two_processes_equals_one, the same code)

    write_parquet(tmp_path / "one.parquet", BLOBS)
    out = tmp_path / "rows.parquet"
    results = run_processes(2, "encode", ckpt, tmp_path / "one.parquet", "-o", out, "--workers", "0")
    assert all(rc == 0 for rc, _ in results), results
    assert parquet.read_keys(tmp_path / "rows-00000-of-00002.parquet") == [f"one.parquet:{i}" for i in range(3)]
    assert read_embeddings(out).names == [f"one.parquet:{i}" for i in range(6)]


def test_sources_listing(tmp_path):
    write_tar(tmp_path / "s.tar", [("x", {"png": BLOBS[0]})])
    write_parquet(tmp_path / "p.parquet", BLOBS[:2])
    (tmp_path / "a.png").write_bytes(BLOBS[0])
    (tmp_path / "notes.txt").write_text("no input")
    recs = expand([str(tmp_path)])
    assert [(r.kind, r.key) for r in recs] == [
        ("file", str(tmp_path / "a.png")),
        ("parquet", "p.parquet:0"),
        ("parquet", "p.parquet:1"),
        ("tar", "x"),
    ]
    with pytest.raises(ValueError, match="no file matches"):
        expand([str(tmp_path / "*.nothing")])
    (tmp_path / "bad.tar").write_bytes(b"\0" * 10 + b"not a tar")
    with pytest.raises(ValueError, match="cannot list .*bad.tar as a webdataset shard"):
        expand([str(tmp_path / "bad.tar")])


# ---- Ray Data --------------------------------------------------------------------------------------------------
def test_ray_stages_equal_encode_images_and_the_cli(capsys, tiny_dirs, reference, tmp_path, ray_local):
    import qwen_vit_jax as qvj

    _, ckpt = tiny_dirs
    ids = [f"img-{i}" for i in range(6)]
    write_parquet(tmp_path / "in.parquet", BLOBS, ids=ids)
    cli_out = tmp_path / "cli.parquet"
    assert encode(capsys, ckpt, tmp_path / "in.parquet", "--key-column", "id", "-o", cli_out)[0] == 0

    # in this process: an Encoder on a numpy batch without the CPU stage, then on the stage's output
    enc = qvj.ray.Encoder(str(ckpt))
    batch = {"image": np.array(BLOBS, dtype=object), "id": np.array(ids)}
    direct = enc(batch)
    staged = enc(qvj.ray.preprocess(pa.table({"image": BLOBS, "id": ids}), checkpoint=str(ckpt)))
    for t in (direct, staged):
        assert t.column_names == ["image", "id", "grid_thw", "embedding"]
        for row, ref in zip(t.to_pylist(), reference):
            close(np.asarray(row["embedding"], np.float32), ref)

    ds = ray_local.data.read_parquet(str(tmp_path / "in.parquet"))
    ds = ds.map_batches(qvj.ray.preprocess, fn_kwargs={"checkpoint": str(ckpt)}, batch_format="pyarrow", batch_size=4)
    ds = ds.map_batches(
        qvj.ray.Encoder,
        fn_constructor_kwargs={"checkpoint": str(ckpt)},
        concurrency=1,
        batch_size=4,
        batch_format="pyarrow",
    )
    rows = {r["id"]: r for r in ds.take_all()}
    cli = read_embeddings(cli_out)
    assert sorted(rows) == ids
    for i, key in enumerate(ids):
        emb = np.asarray(rows[key]["embedding"], np.float32)
        close(emb, reference[i])
        close(emb, cli[cli.names.index(key)])
        assert list(rows[key]["grid_thw"]) == cli.grid_thw[i].tolist()
        assert rows[key]["image"] == BLOBS[i]  # the other columns stay


def test_cli_without_pyarrow_names_the_extra(tiny_dirs, tmp_path):
    _, ckpt = tiny_dirs
    code = WITHOUT_TORCH.replace(
        "sys.modules.update(torch=None, transformers=None)", "sys.modules.update(torch=None, pyarrow=None)"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, "encode", str(ckpt), str(tmp_path), "-o", str(tmp_path / "o.parquet")],
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert p.returncode == 1 and "needs pyarrow: pip install 'qwen_vit_jax[data]'" in p.stderr, p.stderr
