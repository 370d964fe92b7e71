"""qwen_vit_jax.vllm: the store's file layout and atomicity, the identifiers, `encode` / `serve`
with --vllm-store, and the whole thing against vLLM itself.

Against vLLM (benchmarks/workloads/vllm_env.py builds its venv; `make test` does so first): per family (Qwen2.5-VL,
Qwen3-VL) a tiny checkpoint with tokenizer and processor (benchmarks/workloads/vllm_cases.py), our embeddings
(`mm_data`), a store written by our `encode` (sha256 identifiers, sent as multi_modal_uuids) and by
our service (vLLM's own identifiers of the images), then ONE vLLM engine (benchmarks/workloads/vllm_engine.py, a
consumer of that store) runs every case and writes its results; the tests here read them:

  * embeddings in the request give vLLM's greedy tokens with the pixels, logprobs within 1e-4, for
    three images and a video; a 1% spoiled embedding (or a Qwen2.5-VL video without its
    second_per_grid_ts) moves them past that bar, so the bar can fail;
  * the consumer loads each item from the store (its log says so) and answers as with the pixels;
  * `vllm_image_id` equals vLLM's MultiModalHasher for images of every mode (bytes and PIL images).

The images' sides are multiples of the patch unit, so vLLM's resize (torchvision) and ours (PIL)
leave the pixels alone and both towers see the same ones (docs/vllm.md: what differs otherwise).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import pathlib

import numpy as np
import pytest
from PIL import Image

from benchmarks.workloads import traffic as st
from benchmarks.workloads import vllm_cases as vc
from benchmarks.workloads import vllm_env
from qwen_vit_jax.errors import BadInput
from qwen_vit_jax.vllm import StoreWriter, read_store, store_path, vllm_layout, write_store
from qwen_vit_jax.vllm.ids import VLLM_TESTED, Ids, sha256_id, vllm_image_id

LOGPROB_TOL = 1e-4


# ---- the store, without vLLM ----------------------------------------------------------------------
def test_write_store_is_what_the_connector_reads(tmp_path):
    """One float32 tensor "ec_cache" in STORE/<id>/encoder_cache.safetensors, contiguous, as vLLM's
    ECExampleConnector loads it (safetensors.torch.load_file(...)["ec_cache"]); grid and timestamps
    in the header."""
    from safetensors import safe_open

    emb = np.random.default_rng(0).standard_normal((12, 8)).astype(np.float32)
    path = write_store(tmp_path, "abc", emb, grid_thw=[1, 4, 12], timestamps=[np.nan])
    assert path == tmp_path / "abc" / "encoder_cache.safetensors"
    with safe_open(str(path), framework="numpy") as f:
        assert list(f.keys()) == ["ec_cache"]
        got = f.get_tensor("ec_cache")
    assert got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, emb)
    back, meta = read_store(tmp_path, "abc")
    np.testing.assert_array_equal(back, emb)
    assert meta["grid_thw"] == [1, 4, 12] and meta["timestamps"] == [None]
    assert sorted(p.name for p in (tmp_path / "abc").iterdir()) == ["encoder_cache.safetensors"]
    half, _ = read_store(tmp_path, write_store(tmp_path, "h", emb, dtype="bfloat16").parent.name)
    assert half.dtype.name == "bfloat16"


def test_write_store_replaces_the_file_never_the_folder(tmp_path):
    """The consumer makes STORE/<id>/ itself (empty) for every item it checks: the writer keeps that
    folder and renames its file over the old one."""
    folder = tmp_path / "item"
    folder.mkdir()
    inode = folder.stat().st_ino
    write_store(tmp_path, "item", np.ones((2, 4), np.float32))
    write_store(tmp_path, "item", np.full((3, 4), 2, np.float32))
    assert folder.stat().st_ino == inode
    np.testing.assert_array_equal(read_store(tmp_path, "item")[0], np.full((3, 4), 2, np.float32))


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    """A write that fails half way (here: the safetensors writer, after writing part of its file)
    leaves the item as it was and no temporary behind: a consumer never reads a partial file."""
    import safetensors.numpy

    write_store(tmp_path, "x", np.ones((2, 4), np.float32))

    def torn(tensors, filename, metadata=None):
        pathlib.Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", torn)
    with pytest.raises(OSError, match="disk full"):
        write_store(tmp_path, "x", np.zeros((5, 4), np.float32))
    np.testing.assert_array_equal(read_store(tmp_path, "x")[0], np.ones((2, 4), np.float32))
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["encoder_cache.safetensors"]


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../x", "a\0b"])
def test_an_identifier_is_one_folder_name(tmp_path, bad):
    with pytest.raises(BadInput, match="one folder name"):
        store_path(tmp_path, bad)


def test_bad_embeddings_are_refused(tmp_path):
    with pytest.raises(BadInput, match="NaN"):
        write_store(tmp_path, "n", np.array([[np.nan, 0.0]], np.float32))
    with pytest.raises(BadInput, match="tokens, width"):
        write_store(tmp_path, "n", np.zeros(4, np.float32))
    with pytest.raises(BadInput, match="dtype"):
        write_store(tmp_path, "n", np.zeros((1, 4), np.float32), dtype="int8")
    assert not (tmp_path / "n" / "encoder_cache.safetensors").exists()


def test_vllm_layout_puts_deepstack_after_the_tokens():
    emb, ds = np.ones((3, 2)), [np.full((3, 2), 2.0), np.full((3, 2), 3.0)]
    np.testing.assert_array_equal(vllm_layout(emb, ds)[0], [1, 1, 2, 2, 3, 3])
    with pytest.raises(BadInput):
        vllm_layout(emb, [np.ones((4, 2))])


def test_identifier_rules():
    data = b"\x89PNG not really"
    assert Ids()("image", data) == sha256_id(data) == hashlib.sha256(data).hexdigest()
    assert Ids("vllm", "m")("video", data) == sha256_id(data)  # a video keeps its sha256
    with pytest.raises(BadInput, match="model"):
        Ids("vllm")
    with pytest.raises(BadInput):
        Ids("md5")


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


# ---- mm_data, encode and serve with --vllm-store (the demo's tiny Qwen2.5-VL tower) --------------
def test_mm_data_layout(tiny_encoder):
    """Qwen2.5-VL: images and a video in vLLM's dict form: embeddings equal encode_images', int64
    grids, the video's second_per_grid_ts from its frame rate; decoded frames without one refused."""
    import torch

    from qwen_vit_jax.vllm import mm_data

    rng = np.random.default_rng(0)
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((56, 84), (112, 56))]
    frames = rng.integers(0, 256, (6, 56, 56, 3), dtype=np.uint8)
    mm = mm_data(tiny_encoder, images=ims, videos=[frames], source_fps=3.0)
    assert sorted(mm) == ["image", "video"]
    img, vid = mm["image"], mm["video"]
    assert sorted(img) == ["image_embeds", "image_grid_thw"] and img["image_grid_thw"].dtype == torch.int64
    assert img["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4]]
    np.testing.assert_allclose(img["image_embeds"].numpy(), np.concatenate(tiny_encoder.encode_images(ims)), 1e-5, 1e-5)
    assert sorted(vid) == ["second_per_grid_ts", "video_embeds", "video_grid_thw"]
    assert vid["video_grid_thw"].tolist() == [[3, 4, 4]]
    assert vid["second_per_grid_ts"].dtype == torch.float32 and vid["second_per_grid_ts"].tolist() == [
        np.float32(2 / 3)
    ]
    assert mm_data(tiny_encoder, images=[png_bytes(ims[0])])["image"]["image_grid_thw"].tolist() == [[1, 4, 6]]
    with pytest.raises(BadInput, match="source_fps"):
        mm_data(tiny_encoder, videos=[frames])
    assert sorted(mm_data(tiny_encoder, images=ims[:1], videos=[], fps=2.0)) == ["image"]  # docs/api.md's contract


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_images")
    rng = np.random.default_rng(3)
    paths = []
    for i, (h, w) in enumerate(((56, 84), (84, 56))):
        paths.append(folder / f"im{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    return paths


def test_encode_writes_the_store(tiny_dirs, tiny_encoder, image_files, tmp_path, capsys):
    """`encode --vllm-store` alone (no -o) and beside -o: every input at its sha256, its embedding
    what -o holds and encode_images gives; vLLM's own ids with --vllm-ids vllm."""
    import qwen_vit_jax as qvj
    from qwen_vit_jax.tools.cli import main

    store = tmp_path / "store"
    files = [str(p) for p in image_files]
    assert main(["encode", str(tiny_dirs[1]), *files, "--vllm-store", str(store)]) == 0
    ids = [sha256_id(p.read_bytes()) for p in image_files]
    assert sorted(p.name for p in store.iterdir()) == sorted(ids)
    ref = tiny_encoder.encode_images([Image.open(p) for p in image_files])
    for ident, r in zip(ids, ref):
        emb, meta = read_store(store, ident)
        np.testing.assert_allclose(emb, r, rtol=1e-5, atol=1e-5)
        assert meta["grid_thw"][0] == 1
    out = tmp_path / "emb.safetensors"
    store2 = tmp_path / "store2"
    args = ["--vllm-store", str(store2), "--vllm-ids", "vllm", "--vllm-model", "Org/Model"]
    assert main(["encode", str(tiny_dirs[1]), *files, "-o", str(out), *args]) == 0
    e = qvj.read_embeddings(out)
    for i, p in enumerate(image_files):
        emb, _ = read_store(store2, vllm_image_id("Org/Model", p.read_bytes()))
        np.testing.assert_array_equal(emb, e[i])
    capsys.readouterr()
    assert main(["encode", str(tiny_dirs[1]), *files]) == 2  # neither: a usage error
    assert "-o/--output (or --vllm-store)" in capsys.readouterr().err
    assert main(["encode", str(tiny_dirs[1]), *files, "--vllm-store", str(store), "--vllm-ids", "vllm"]) == 1
    assert "--vllm-model" in capsys.readouterr().err


def test_serve_writes_the_store_before_answering(tiny_dirs, image_files, tmp_path):
    """Each answer item carries "vllm_id", and its file is in the store when the answer arrives; a
    store that cannot be written fails the request (500) instead of answering ids without files."""
    import httpx

    from qwen_vit_jax.serve.asgi import create_app
    from qwen_vit_jax.serve.settings import Settings

    store = tmp_path / "store"
    settings = Settings(checkpoint=str(tiny_dirs[1]), workers=0, vllm_store=str(store), vllm_ids="vllm", vllm_model="m")
    datas = [p.read_bytes() for p in image_files]

    async def go():
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                for _ in range(600):
                    if (await client.get("/readyz")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                body = {"input": [{"image": base64.b64encode(d).decode()} for d in datas]}
                r = await client.post("/v1/embeddings", json=body)
                assert r.status_code == 200, r.text
                present = {p.name for p in store.iterdir()}

                def full(*args, **kw):
                    raise OSError(28, "No space left on device")

                app.state.service.vllm.put = full  # a store that cannot be written: no answer claims it
                failed = await client.post("/v1/embeddings", json=body)
                return r.json()["data"], present, failed

    data, present, failed = asyncio.run(go())
    assert failed.status_code == 500 and "vLLM's store" in failed.json()["error"]["message"]
    assert [d["vllm_id"] for d in data] == [vllm_image_id("m", d) for d in datas]
    assert present == {d["vllm_id"] for d in data}
    for d in data:
        np.testing.assert_array_equal(read_store(store, d["vllm_id"])[0], np.asarray(d["embedding"], np.float32))


def test_settings_check_the_store_flags():
    from qwen_vit_jax.serve.settings import Settings

    with pytest.raises(ValueError, match="--vllm-model"):
        Settings(checkpoint="c", vllm_store="s", vllm_ids="vllm")
    with pytest.raises(ValueError, match="--vllm-store"):
        Settings(checkpoint="c", vllm_ids="vllm", vllm_model="m")


# ---- against vLLM itself ----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def vllm_python():
    """The vLLM venv's python (built when missing: `make test` builds it first). Skips only when the
    registry lacks a package it needs, naming it."""
    try:
        return vllm_env.ensure()
    except vllm_env.Unavailable as e:
        pytest.skip(f"the vLLM venv cannot be built, the registry lacks a package: {e}")


def hash_images(folder: pathlib.Path) -> list[str]:
    """Images of every mode vLLM's hash treats apart: RGB (PNG, JPEG), RGBA, a palette with and
    without transparency, grey, 16-bit grey, an EXIF-rotated JPEG, a GIF."""
    rng = np.random.default_rng(5)
    rgb = Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8))
    made = {
        "rgb.png": (rgb, {}),
        "rgb.jpg": (rgb, {}),
        "rgba.png": (rgb.convert("RGBA"), {}),
        "p.png": (rgb.convert("P"), {}),
        "p_alpha.png": (rgb.convert("P"), {"transparency": 3}),
        "l.png": (rgb.convert("L"), {}),
        "i16.png": (Image.fromarray(rng.integers(0, 60000, (20, 30), dtype=np.uint16)), {}),
        "p.gif": (rgb.convert("P"), {}),
    }
    paths = []
    for name, (im, kw) in made.items():
        paths.append(str(folder / name))
        im.save(paths[-1], **kw)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees
    paths.append(str(folder / "rotated.jpg"))
    rgb.save(paths[-1], exif=exif)
    return paths


@pytest.fixture(scope="module", params=list(vc.FAMILIES))
def engine(request, vllm_python, tmp_path_factory):
    """One family's run: our side's files, then one vLLM engine over all of them. (family, plan,
    results, what our side wrote)."""
    from qwen_vit_jax.runtime.encoder import VisionEncoder
    from qwen_vit_jax.tools.cli import main
    from qwen_vit_jax.vllm import mm_data

    family = request.param
    root = tmp_path_factory.mktemp(f"vllm_{family}")
    hf = vc.write_checkpoint(root / "hf", family)
    model = str(hf)  # what vLLM is started with, and so what its identifiers hash
    enc = VisionEncoder.from_pretrained(hf)
    images = vc.write_images(root, family)
    frames = vc.video_frames(family)
    np.save(root / "frames.npy", frames)
    fps = vc.FAMILIES[family]["fps"]
    store = root / "store"
    # the store, from our encode (sha256 identifiers; -o beside it) and from our service (vLLM's own)
    assert main(["encode", model, *map(str, images), "--vllm-store", str(store), "-o", str(root / "e.npz")]) == 0
    served = _serve(model, store, images)
    ours = {"encode": [sha256_id(p.read_bytes()) for p in images], "service": served, "out": root / "e.npz"}
    assert all(store_path(store, i).exists() for i in ours["encode"] + served)
    cases = []
    for i, path in enumerate(images):
        torch_save(mm_data(enc, images=[path]), root / f"image{i}.pt")
        image = dict(modality="image", prompt=vc.prompt("image"), file=str(path))
        cases += [
            dict(image, name=f"image{i}", how="pixels", uuid=f"pixels-{i}"),  # a uuid the store lacks
            dict(image, name=f"image{i}:embeds", how="embeds", mm=str(root / f"image{i}.pt")),
            dict(image, name=f"image{i}:encode-store", how="pixels", uuid=ours["encode"][i]),
            dict(image, name=f"image{i}:service-store", how="chat", text=vc.IMAGE_TEXT),
        ]
    cases.append(dict(cases[1], name="image0:embeds*1.01", scale=1.01))
    torch_save(mm_data(enc, videos=[frames], source_fps=fps), root / "video.pt")
    n = len(frames)
    meta = dict(total_num_frames=n, fps=fps, duration=n / fps, frames_indices=list(range(n)), video_backend="opencv")
    video = dict(modality="video", prompt=vc.prompt("video"))
    cases += [
        dict(
            video,
            name="video",
            how="pixels",
            frames=str(root / "frames.npy"),
            metadata=dict(meta, do_sample_frames=False),
            uuid="pixels-video",
        ),
        dict(video, name="video:embeds", how="embeds", mm=str(root / "video.pt")),
        dict(video, name="video:embeds*1.01", how="embeds", mm=str(root / "video.pt"), scale=1.01),
    ]
    if family == "qwen2_5_vl":
        cases.append(dict(cases[-2], name="video:embeds-no-seconds", drop=["second_per_grid_ts"]))
    if enc.cfg.deepstack_layers:
        cases.append(dict(cases[1], name="image0:embeds-no-deepstack", zero_from=enc.cfg.out_dim))
    plan = {
        "model": model,
        "store": str(store),
        "new_tokens": vc.NEW_TOKENS,
        "top_logprobs": vc.TOP_LOGPROBS,
        "engine": dict(
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            max_num_seqs=2,
            max_num_batched_tokens=512,
            limit_mm_per_prompt={"image": 1, "video": 1},
            enable_mm_embeds=True,
            seed=0,
        ),
        "cases": cases,
        "hash_images": hash_images(root),
    }
    results = vc.run_engine(vllm_python, plan, root)
    print(
        f"\nvLLM {results['vllm']} {family}: engine start {results['start_s']:.1f} s, run {results['wall_s']:.1f} s, "
        f"peak RSS {results['peak_rss_mb']:.0f} MB"
    )
    return family, plan, results, ours


def torch_save(mm: dict, path: pathlib.Path) -> None:
    import torch

    torch.save(mm, path)


def _serve(model: str, store: pathlib.Path, images) -> list[str]:
    """The images through our service with --vllm-store and vLLM's identifiers: the answers' ids."""
    from qwen_vit_jax.serve.settings import Settings

    settings = Settings(checkpoint=model, workers=0, vllm_store=str(store), vllm_ids="vllm", vllm_model=model)

    async def go():
        async with st.served(settings, ready_s=60) as (client, _):
            body = {"input": [{"image": base64.b64encode(p.read_bytes()).decode()} for p in images]}
            r = await client.post("/v1/embeddings", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return [d["vllm_id"] for d in r.json()["data"]]

    return asyncio.run(go())


def logprob_gap(a: dict, b: dict) -> float:
    """The largest difference of two answers' top logprobs, step by step over the steps both took
    (inf where a step's top tokens differ)."""
    gap = 0.0
    for x, y in zip(a["top"], b["top"]):
        if set(x) != set(y):
            return float("inf")
        gap = max(gap, max(abs(x[t] - y[t]) for t in x))
    return gap


def same_answer(results, name: str, reference: str) -> float:
    """The same greedy tokens as `reference`'s; the largest difference of their top logprobs."""
    a, b = results["cases"][name], results["cases"][reference]
    assert a["tokens"] == b["tokens"], f"{name}: tokens {a['tokens']} != {reference}'s {b['tokens']}"
    return logprob_gap(a, b)


def test_embeddings_in_the_request_equal_pixels(engine):
    family, plan, results, _ = engine
    for name in [f"image{i}" for i in range(3)] + ["video"]:
        diff = same_answer(results, f"{name}:embeds", name)
        assert diff <= LOGPROB_TOL, f"{family} {name}: logprobs differ by {diff:.3g}"


def test_a_wrong_embedding_shows(engine):
    """The bar can fail: 1% off embeddings, a Qwen2.5-VL video's time spacing left out or Qwen3-VL's
    deepstack features zeroed move the top logprobs past it (the tiny model's scaled LM head)."""
    family, plan, results, _ = engine
    spoiled = {"image0:embeds*1.01": "image0", "video:embeds*1.01": "video"}
    spoiled.update(
        {"video:embeds-no-seconds": "video"} if family == "qwen2_5_vl" else {"image0:embeds-no-deepstack": "image0"}
    )
    for name, ref in spoiled.items():
        moved = logprob_gap(results["cases"][name], results["cases"][ref])
        assert moved > 10 * LOGPROB_TOL, f"{family} {name}: the top logprobs moved only {moved:.3g}"


def test_a_consumer_reads_the_store_our_encode_wrote(engine):
    """Pixels with our sha256 identifiers as multi_modal_uuids: vLLM loads each item from the store
    (its log) and answers as it does with its own tower. (-o beside --vllm-store: the file's rows are
    the store's tokens, the deepstack features only in the store.)"""
    import qwen_vit_jax as qvj

    family, plan, results, ours = engine
    out = qvj.read_embeddings(ours["out"])  # -o beside the store: its rows are the store's first columns
    for i, ident in enumerate(ours["encode"]):
        emb, _ = read_store(plan["store"], ident)
        np.testing.assert_array_equal(out[i], emb[:, : out.embeddings.shape[1]])
        assert emb.shape[1] == out.embeddings.shape[1] * (1 + (family == "qwen3_vl") * 2)  # deepstack: 2 layers
        case = results["cases"][f"image{i}:encode-store"]
        assert case["loaded"] == [ident], f"{family} image{i}: vLLM loaded {case['loaded']}, not {ident}"
        assert same_answer(results, f"image{i}:encode-store", f"image{i}") <= LOGPROB_TOL
    assert all(not results["cases"][f"image{i}"]["loaded"] for i in range(3))  # its own tower's baseline


def test_a_consumer_finds_what_our_service_wrote_by_vllms_own_identifier(engine):
    """Plain pixels (a data: URL through LLM.chat, as an EPD proxy forwards them; no uuid): vLLM's
    own identifier is ours, so it loads our file."""
    family, plan, results, ours = engine
    for i, ident in enumerate(ours["service"]):
        case = results["cases"][f"image{i}:service-store"]
        assert case["loaded"] == [ident], f"{family} image{i}: vLLM loaded {case['loaded']}, not {ident}"
        assert same_answer(results, f"image{i}:service-store", f"image{i}") <= LOGPROB_TOL


def test_vllm_image_id_equals_vllms_hasher(engine):
    """Ours vs vLLM's MultiModalHasher of the pinned release, for images of every mode, from bytes
    (its server) and from PIL images (LLM.generate)."""
    family, plan, results, _ = engine
    assert results["vllm"] == VLLM_TESTED
    for path, theirs in results["hashes"].items():
        data = pathlib.Path(path).read_bytes()
        assert vllm_image_id(plan["model"], data) == theirs["bytes"], f"{os.path.basename(path)} (bytes)"
        with Image.open(path) as im:
            im.load()
            assert vllm_image_id(plan["model"], im) == theirs["pil"], f"{os.path.basename(path)} (PIL)"


def test_store_writer_matches_encode_rows(tiny_encoder, image_files, tmp_path):
    """StoreWriter.put (the writer both commands use) of an item's rows: the file read_store gives."""
    w = StoreWriter(tmp_path, Ids())
    data = image_files[0].read_bytes()
    emb = tiny_encoder.encode_images([Image.open(image_files[0])])[0]
    ident = w.put("image", data, None, emb, grid=[1, 4, 6], ts=[np.nan])
    assert ident == sha256_id(data)
    np.testing.assert_array_equal(read_store(tmp_path, ident)[0], emb)
    assert json.loads(json.dumps(read_store(tmp_path, ident)[1]["grid_thw"])) == [1, 4, 6]
