"""The service's cache keyed right (an item's bytes, its kind and every setting that changes its
embedding, in memory and on disk: data/cache.py's one recipe, shared with `encode --cache`), over
real HTTP on 127.0.0.1 (uvicorn in a thread); and its batch shapes warmed up before ready
(--warmup-batches), in process.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io

import httpx
import numpy as np
import pytest
from PIL import Image
from sample_images import make_image

from benchmarks.workloads import traffic as st
from qwen_vit_jax.serve.settings import Settings


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def encoded(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def post(url: str, *items: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"input": list(items), "encoding_format": "base64"}, timeout=120)


def answer(r: httpx.Response) -> tuple[list, bool, np.ndarray]:
    """(grid_thw, cached, embedding) of a one-item 200."""
    assert r.status_code == 200, r.text
    d = r.json()["data"][0]
    return d["grid_thw"], d["cached"], np.frombuffer(base64.b64decode(d["embedding"]), "<f4").reshape(d["shape"])


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    """A second tiny Qwen2.5-VL checkpoint: the same config as tiny_dirs', other random weights."""
    from qwen_vit_jax.tools.demo import TINY, write_random_hf_checkpoint
    from qwen_vit_jax.weights.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("other_ckpt")
    return convert_checkpoint(write_random_hf_checkpoint(TINY, root / "hf", seed=7), root / "converted")


@contextlib.contextmanager
def serve(ckpt, encoder, **kw):
    """The app on uvicorn in a thread of this process, ready: its URL."""
    settings = Settings(checkpoint=str(ckpt), port=st.free_port(), workers=0, max_wait_ms=1, **kw)
    with st.in_thread(settings, encoder) as (url, app):
        assert app.state.service.error is None, app.state.service.error
        yield url


def test_the_same_bytes_as_an_image_and_as_a_video(tiny_dirs, tiny_encoder, tmp_path):
    """A PNG sent as an image, then as a video: the video is not the image's cached answer (it is
    refused: ffmpeg's image demuxers are off the container allow-list). An animated GIF sent as a
    video, then as an image: two entries, each its own grid, in memory and on disk."""
    png = encoded(make_image(112, 168, seed=3), "PNG")
    frames = [make_image(112, 140, seed=10 + i) for i in range(4)]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=250, loop=0)
    cache = str(tmp_path / "cache")
    with serve(tiny_dirs[1], tiny_encoder, cache=cache) as url:
        grid, cached, _ = answer(post(url, {"image": b64(png)}))
        assert (grid, cached) == ([1, 8, 12], False)
        r = post(url, {"video": b64(png)})
        assert r.status_code == 415 and "not a supported video container (png image)" in r.text, r.text
        video = answer(post(url, {"video": b64(gif)}))
        image = answer(post(url, {"image": b64(gif)}))
        assert video[0][0] == 2 and image[0][0] == 1 and not video[1] and not image[1]
        again = [answer(post(url, {k: b64(gif)})) for k in ("video", "image")]
        assert [(g, c) for g, c, _ in again] == [(video[0], True), (image[0], True)]
        assert np.array_equal(again[0][2], video[2]) and np.array_equal(again[1][2], image[2])
    with serve(tiny_dirs[1], tiny_encoder, cache=cache) as url:  # a new server: the disk's entries
        disk = [answer(post(url, {k: b64(gif)})) for k in ("image", "video")]
        assert [(g, c) for g, c, _ in disk] == [(image[0], True), (video[0], True)]
        assert np.array_equal(disk[0][2], image[2]) and np.array_equal(disk[1][2], video[2])


def test_one_video_at_two_frame_rates(tiny_dirs, tiny_encoder, tmp_path):
    """fps 1, then fps 2, of the same bytes: two samplings, two entries; each again (and from disk on
    a new server) its own, equal to encode_video at that rate."""
    from benchmarks.workloads.clips import write_clip

    path = write_clip(tmp_path / "clip.mov", "png_odd_97x61_7fps_3s")
    raw = open(path, "rb").read()
    want = {fps: tiny_encoder.encode_video(path, fps=fps) for fps in (1, 2)}
    cache = str(tmp_path / "cache")
    with serve(tiny_dirs[1], tiny_encoder, cache=cache) as url:
        first = {fps: answer(post(url, {"video": b64(raw), "fps": fps})) for fps in (1, 2)}
        assert first[1][0] != first[2][0] and not first[1][1] and not first[2][1]
        for fps in (1, 2):
            np.testing.assert_allclose(first[fps][2], want[fps], rtol=0, atol=1e-5 * np.abs(want[fps]).max())
        grid, cached, emb = answer(post(url, {"video": b64(raw), "fps": 1}))
        assert (grid, cached) == (first[1][0], True) and np.array_equal(emb, first[1][2])
    with serve(tiny_dirs[1], tiny_encoder, cache=cache) as url:
        for fps in (2, 1):
            grid, cached, emb = answer(post(url, {"video": b64(raw), "fps": fps}))
            assert (grid, cached) == (first[fps][0], True) and np.array_equal(emb, first[fps][2])


def test_two_checkpoints_share_one_cache_dir(tiny_dirs, tiny_encoder, other_ckpt, tmp_path):
    """Two checkpoints' servers over one --cache DIR: each answers its own tower's embedding, and
    each finds its own entries on disk after a restart."""
    from qwen_vit_jax.runtime.encoder import VisionEncoder

    other = VisionEncoder.from_pretrained(other_ckpt)
    im = make_image(112, 168, seed=4)
    png, cache = encoded(im, "PNG"), str(tmp_path / "cache")
    for _ in range(2):  # the second time: both from the disk
        got = {}
        for ckpt, enc in ((tiny_dirs[1], tiny_encoder), (other_ckpt, other)):
            with serve(ckpt, enc, cache=cache) as url:
                got[ckpt] = answer(post(url, {"image": b64(png)}))
            want = enc.encode_images([im])[0]
            assert np.linalg.norm(got[ckpt][2] - want) <= 1e-6 * np.linalg.norm(want)
        assert not np.allclose(got[tiny_dirs[1]][2], got[other_ckpt][2])
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 2  # one entry per checkpoint


def test_keys_follow_the_preprocessing_the_workers_use(tiny_dirs, tiny_encoder):
    """Service.key is a function of its one `preprocessing` (what its workers prepare with): other
    pixel bounds, another kind or another fps give another key; the same settings the same key."""
    import dataclasses

    from qwen_vit_jax.serve.service import Input, Service

    svc = Service(Settings(checkpoint=str(tiny_dirs[1]), workers=0), metrics=None)
    svc.enc, svc.preprocessing = tiny_encoder, tiny_encoder.preprocessing
    image, video = Input("image", b"x", "d" * 64), Input("video", b"x", "d" * 64)
    keys = {svc.key(image), svc.key(video), svc.key(dataclasses.replace(video, fps=2.0))}
    assert len(keys) == 3 and all(k[1] == "d" * 64 for k in keys)
    assert svc.key(dataclasses.replace(video, fps=2)) == svc.key(dataclasses.replace(video, fps=2.0))
    svc.preprocessing = tiny_encoder.preprocessing.with_limits(max_pixels=56 * 56 * 4)  # e.g. a per-item bound
    assert svc.key(image) not in keys and svc.key(video) not in keys


# ---- warm before ready ----------------------------------------------------------------------------
def test_warmup_batches_compiles_the_declared_sizes_batch_shapes(tiny_dirs, caplog):
    """--warmup-batches: before /readyz the batch shapes of the declared size under the budget are
    compiled (logged: how many, how long); concurrent requests then compile nothing and share calls."""
    from qwen_vit_jax.runtime.encoder import VisionEncoder

    enc = VisionEncoder.from_pretrained(tiny_dirs[1])
    s = Settings(
        checkpoint=str(tiny_dirs[1]),
        workers=0,
        declare=((1, 8, 8),),
        max_batch_patches=256,
        max_wait_ms=500,
        warmup_batches=True,
    )
    s_cold = Settings(checkpoint="x", compile_cache="/tmp/c")
    assert s_cold.warmup_batches and not Settings(checkpoint="x").warmup_batches  # on with a compile cache

    async def go():
        async with st.served(s, enc) as (c, app):
            programs = app.state.metrics.registry.get_sample_value("qvj_programs")
            ims = [encoded(make_image(112, 112, seed=40 + i), "PNG") for i in range(4)]  # 8 x 8 patches each
            rs = await asyncio.gather(*[c.post("/v1/embeddings", json={"input": [{"image": b64(x)}]}) for x in ims])
            after = app.state.metrics.registry.get_sample_value("qvj_programs")
            return [r.status_code for r in rs], programs, after, app.state.service.batcher.batches

    with caplog.at_level("INFO", logger="qwen_vit_jax.serve"):
        codes, programs, after, calls = asyncio.run(go())
    assert codes == [200] * 4 and after == programs and calls < 4  # nothing compiled after ready
    # 8 x 8 items under 256 patches: batches of 2 .. 4 items, rows 128, 192, 256 (3 rungs), one class
    assert "warm-up: 3 batch shapes of the declared sizes 1x8x8" in caplog.text, caplog.text


def test_warm_batches_cover_every_rung_and_class():
    """runtime/batching.warm_batches: for each declared size at the head, one batch per rung of the
    batch-rows ladder from two items to the budget, of the sizes the head admits."""
    from qwen_vit_jax.plan import BucketPolicy, batch_rows, frame_class
    from qwen_vit_jax.runtime.batching import Grouping, warm_batches

    policy = BucketPolicy()
    sizes = [(1, 8, 8), (1, 16, 24), (1, 12, 16)]
    batches = warm_batches(sizes, Grouping(4096, batched=True), policy)
    shapes = {(batch_rows(sum(t * h * w for t, h, w in b), policy), frame_class(b[0][1] * b[0][2])) for b in batches}
    assert len(shapes) == len(batches)  # one batch per shape
    assert all(sum(t * h * w for t, h, w in b) <= 4096 and len(b) >= 2 for b in batches)
    # 8 x 8 (class 64) alone: rungs 128 .. 4096; 16 x 24 (class 384) admits 12 x 16 (192), not 8 x 8
    assert {r for r, c in shapes if c == 64} == {128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096}
    assert min(r for r, c in shapes if c == 384) == batch_rows(384 + 192, policy)
    assert all(b[0] != (1, 16, 24) or (1, 8, 8) not in b for b in batches)
    videos = warm_batches([(2, 8, 8), (1, 8, 8)], Grouping(256, batched=True), policy)
    assert all(len({g[0] > 1 for g in b}) == 1 for b in videos)  # images and videos never share a call
