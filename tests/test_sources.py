"""Direct loading: `load_model` / `VisionEncoder.from_pretrained` on a converted directory, an HF
checkpoint directory (converted in memory, text-only shards never opened, nothing written) and a
hub id in a local cache laid out like huggingface_hub's (HF_HUB_CACHE / HF_HOME, offline)."""

from __future__ import annotations

import json
import shutil
import socket

import jax
import numpy as np
import pytest
from hf_utils import COMMIT, make_hub_cache
from sample_images import make_image

import qwen_vit_jax as qvj
from qwen_vit_jax.weights.safetensors_io import read_safetensors, write_safetensors
from qwen_vit_jax.weights.sources import (
    CONVERTED,
    HF_DIR,
    HUB,
    hub_cache_dir,
    is_hub_id,
    resolve_hub_id,
    resolve_source,
)

GRID = np.array([[1, 8, 12], [2, 4, 4]])


def forward(model, px, grid):
    return np.concatenate(
        [plan.unpad(np.asarray(jax.jit(model)(plan.take(px), plan))) for plan in qvj.make_plans(grid, model.cfg)]
    )


def tree_listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def sharded_hf(tiny_dirs, tmp_path_factory):
    """The tiny checkpoint re-laid as a real hub checkpoint: text weights in a shard of their own
    (here garbage bytes, so opening it would fail), vision weights over two shards, an index."""
    hf, _ = tiny_dirs
    root = tmp_path_factory.mktemp("sharded") / "hf"
    root.mkdir()
    tensors = read_safetensors(hf / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00002-of-00003.safetensors": names[::2], "model-00003-of-00003.safetensors": names[1::2]}
    for shard, keys in halves.items():
        write_safetensors(root / shard, {k: tensors[k] for k in keys}, {"format": "pt"})
    (root / "model-00001-of-00003.safetensors").write_bytes(b"not a safetensors file: never to be opened")
    weight_map = {"model.language_model.embed_tokens.weight": "model-00001-of-00003.safetensors"}
    weight_map |= {k: shard for shard, keys in halves.items() for k in keys}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copyfile(hf / name, root / name)
    return root


def test_three_kinds_load_the_same_tower(tiny_dirs, sharded_hf, tmp_path, monkeypatch):
    hf, converted = tiny_dirs
    snap = make_hub_cache(tmp_path / "hub", sharded_hf)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_source(converted).kind == CONVERTED and resolve_source(hf).kind == HF_DIR
    src = resolve_source("Org/Tiny-VL")
    assert (src.kind, src.path) == (HUB, snap)

    cfg = qvj.load_model(converted).cfg
    px = np.random.default_rng(0).standard_normal((int(np.prod(GRID, 1).sum()), cfg.patch_dim), np.float32)
    ref = forward(qvj.load_model(converted), px, GRID)
    before = tree_listing(sharded_hf), tree_listing(tmp_path / "hub")

    def no_network(*a, **k):
        raise AssertionError("network access")

    monkeypatch.setattr(socket, "socket", no_network)
    for source in (hf, sharded_hf, "Org/Tiny-VL", f"Org/Tiny-VL@{COMMIT}"):
        out = forward(qvj.load_model(source), px, GRID)
        assert np.abs(out - ref).max() <= 1e-6 * np.abs(ref).max(), source
    assert (tree_listing(sharded_hf), tree_listing(tmp_path / "hub")) == before  # nothing written

    # The encoder too, with the checkpoint's preprocessor_config.json.
    images = [make_image(90, 130, seed=1)]
    want = qvj.VisionEncoder.from_pretrained(converted).encode_images(images)[0]
    for source in (sharded_hf, "Org/Tiny-VL"):
        enc = qvj.VisionEncoder.from_pretrained(source)
        assert enc.preprocess == qvj.VisionEncoder.from_pretrained(converted).preprocess
        got = enc.encode_images(images)[0]
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_hub_cache_location_and_revisions(sharded_hf, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    snap = make_hub_cache(tmp_path / "home" / "hub", sharded_hf, refs=("main", "v1.0"))
    assert resolve_hub_id("Org/Tiny-VL") == snap
    assert resolve_hub_id("Org/Tiny-VL@v1.0") == snap
    assert resolve_hub_id(f"Org/Tiny-VL@{COMMIT}") == snap
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere"
    try:  # the well-kept resolver agrees with ours on the layout, offline
        from huggingface_hub import snapshot_download
    except ImportError:
        return
    assert snapshot_download("Org/Tiny-VL", cache_dir=tmp_path / "home" / "hub", local_files_only=True) == str(snap)


def test_missing_sources_name_what_was_searched(sharded_hf, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError) as e:
        qvj.load_model("Qwen/Qwen2.5-VL-3B-Instruct")
    msg = str(e.value)
    assert "'Qwen/Qwen2.5-VL-3B-Instruct'" in msg and str(tmp_path / "hub") in msg
    assert "hf download Qwen/Qwen2.5-VL-3B-Instruct" in msg
    make_hub_cache(tmp_path / "hub", sharded_hf)
    with pytest.raises(FileNotFoundError, match=r"no revision 'v2'.*hf download Org/Tiny-VL --revision v2"):
        qvj.VisionEncoder.from_pretrained("Org/Tiny-VL@v2")
    with pytest.raises(FileNotFoundError, match="not a directory, and not an Org/Name hub id"):
        qvj.load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        qvj.load_model(tmp_path / "empty")
    assert is_hub_id("Qwen/Qwen2.5-VL-3B-Instruct") and is_hub_id("a/b@main")
    assert not any(map(is_hub_id, ["a", "a/b/c", "/a/b", "./a", "a/..", "a--b/c", "a/b@"]))


def test_cli_encode_bench_verify_take_all_three_sources(capsys, tiny_dirs, sharded_hf, tmp_path, monkeypatch):
    from qwen_vit_jax.tools import cli

    def main(*args):
        rc = cli.main([str(a) for a in args])
        out, err = capsys.readouterr()
        assert rc == 0, err
        return out

    make_hub_cache(tmp_path / "hub", sharded_hf)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    images = tmp_path / "images"
    images.mkdir()
    for i, (h, w) in enumerate([(60, 90), (112, 84)]):
        make_image(h, w, seed=i).save(images / f"{i}.png")
    embs = {}
    for name, source in (("converted", tiny_dirs[1]), ("hf", sharded_hf), ("hub", "Org/Tiny-VL")):
        main("encode", source, images, "-o", tmp_path / f"{name}.safetensors")
        embs[name] = qvj.read_embeddings(tmp_path / f"{name}.safetensors").embeddings
        assert main("bench", source, "--sizes", "8x8", "--repeats", "1").splitlines()[-1].split()[:2] == ["8x8", "64"]
    for name in ("hf", "hub"):
        assert np.abs(embs[name] - embs["converted"]).max() <= 1e-6 * np.abs(embs["converted"]).max()
    # verify: HF's tower from the hub id, ours loaded from it directly (no temporary conversion)
    out = main("verify", "Org/Tiny-VL")
    assert out.splitlines()[-1] == "PASS" and "converted" not in out
