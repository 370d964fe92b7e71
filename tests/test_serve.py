"""The service (qwen_vit_jax.serve): answers equal encode_images, batching, the caches, the limits
(413 / 429 / 401), cancellation, timeouts, a dead worker replaced, and over real HTTP: a uvicorn
server in a thread (deepstack, the client's retries) and the CLI in a subprocess (SIGTERM drains).

Most tests drive the app in-process through httpx's ASGITransport, its lifespan run by hand (the
transport runs none). Tiny towers; images of two sizes, so the buckets compile once per session
(tests/conftest.py's persistent compilation cache serves the subprocess too).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from sample_images import make_image

from benchmarks.workloads import traffic as st
from qwen_vit_jax.serve.settings import Settings

SIZES = [(224, 224), (112, 168)]  # 16x16 and 8x12 patches


def png(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


def body(*images: bytes, **kw) -> dict:
    return {"input": [{"image": b64(x)} for x in images], **kw}


@pytest.fixture(scope="module")
def images():
    return [make_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]


@pytest.fixture(scope="module")
def pngs(images):
    return [png(im) for im in images]


def settings_for(ckpt, **kw) -> Settings:
    return Settings(checkpoint=str(ckpt), workers=kw.pop("workers", 0), **kw)


def compile_batch_shape(enc, ims) -> None:
    """Compile the program of a batch of these images (Batcher runs a batch's head alone while its
    shape compiles, so a test that counts batches compiles it first)."""
    from qwen_vit_jax.preprocess.images import image_preprocessor

    prep = image_preprocessor(enc.cfg.variant)
    enc.compile(enc.prepare_batch([prep([im], config=enc.preprocess, uint8=True) for im in ims]))


def metric(app, name: str, **labels) -> float:
    value = app.state.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


# ---- answers ------------------------------------------------------------------------------------
def test_served_equals_encode_images(tiny_dirs, tiny_encoder, images, pngs):
    """Two images in one request, both formats: encode_images' embeddings within 1e-6 relative."""
    want = tiny_encoder.encode_images(images)

    async def go():
        async with st.served(settings_for(tiny_dirs[1]), tiny_encoder) as (c, app):
            assert (await c.get("/healthz")).json() == {"status": "alive"}
            r = await c.post("/v1/embeddings", json=body(*pngs))
            assert r.status_code == 200, r.text
            data = r.json()["data"]
            r64 = await c.post("/v1/embeddings", json=body(*pngs, encoding_format="base64"))
            return data, r64.json()["data"], (await c.get("/metrics")).text

    data, data64, text = asyncio.run(go())
    assert [d["index"] for d in data] == [0, 1]
    for d, d64, w, raw in zip(data, data64, want, pngs):
        got = np.array(d["embedding"], np.float32)
        assert got.shape == w.shape and d["shape"] == list(w.shape)
        assert rel_err(got, w) <= 1e-6
        assert d["timestamps"] is None and d["sha256"] == hashlib.sha256(raw).hexdigest()
        got64 = np.frombuffer(base64.b64decode(d64["embedding"]), "<f4").reshape(d64["shape"])
        assert np.array_equal(got64, got)  # float lists round-trip float32 exactly
    assert [d["grid_thw"] for d in data] == [[1, 16, 16], [1, 8, 12]]
    assert 'qvj_requests_total{status="200"} 2.0' in text


def test_alone_in_declared_size_is_bit_identical(tiny_dirs, images, pngs):
    """A request that runs alone in a declared size gives encode_images' bits exactly."""
    from qwen_vit_jax.runtime.encoder import VisionEncoder

    enc = VisionEncoder.from_pretrained(tiny_dirs[1])

    async def go():
        async with st.served(settings_for(tiny_dirs[1], declare=((1, 16, 16),)), enc) as (c, _):
            return (await c.post("/v1/embeddings", json=body(pngs[0], encoding_format="base64"))).json()["data"][0]

    d = asyncio.run(go())
    got = np.frombuffer(base64.b64decode(d["embedding"]), "<f4").reshape(d["shape"])
    assert np.array_equal(got, enc.encode_images([images[0]])[0])


def test_safetensors_answer_is_an_embeddings_file(tiny_dirs, tiny_encoder, images, pngs, tmp_path):
    import qwen_vit_jax as qvj

    async def go():
        async with st.served(settings_for(tiny_dirs[1]), tiny_encoder) as (c, _):
            return await c.post("/v1/embeddings", json=body(*pngs), headers={"Accept": "application/vnd.safetensors"})

    r = asyncio.run(go())
    assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.safetensors"
    (tmp_path / "a.safetensors").write_bytes(r.content)
    e = qvj.read_embeddings(tmp_path / "a.safetensors")
    assert len(e) == 2 and e.grid_thw.tolist() == [[1, 16, 16], [1, 8, 12]]
    for i, w in enumerate(tiny_encoder.encode_images(images)):
        assert rel_err(e[i], w) <= 1e-6
    assert e.metadata["sha256"][0] == hashlib.sha256(pngs[0]).hexdigest()


def test_a_video_item_equals_encode_video(tiny_dirs, tiny_encoder, tmp_path):
    """A video's bytes with fps: encode_video's tokens and preprocess_video's timestamps."""
    import qwen_vit_jax as qvj
    from benchmarks.workloads.clips import write_clip

    path = write_clip(tmp_path / "clip.mov", "png_odd_97x61_7fps_3s")
    want = tiny_encoder.encode_video(path, fps=2)
    _, grid, stamps = qvj.preprocess_video(path, config=tiny_encoder.video_preprocess, fps=2)
    with open(path, "rb") as f:
        raw = f.read()

    async def go():
        async with st.served(settings_for(tiny_dirs[1]), tiny_encoder) as (c, _):
            return await c.post("/v1/embeddings", json={"input": [{"video": b64(raw), "fps": 2}]})

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    d = r.json()["data"][0]
    assert d["grid_thw"] == grid[0].tolist() and rel_err(np.array(d["embedding"], np.float32), want) <= 1e-6
    assert d["timestamps"] == (None if stamps is None else [float(t) for t in stamps])


# ---- batching and the caches --------------------------------------------------------------------
def test_concurrent_requests_share_one_batch(tiny_dirs, tiny_encoder, images, pngs):
    """Four concurrent requests (distinct images) land in one encode call; each answer is its own."""
    ims = [images[0], make_image(224, 224, seed=7), images[1], make_image(112, 168, seed=8)]
    raws = [png(im) for im in ims]
    want = tiny_encoder.encode_images(ims)

    async def go():
        s = settings_for(tiny_dirs[1], max_wait_ms=1500, cache_bytes=0)
        async with st.served(s, tiny_encoder) as (c, app):
            rs = await asyncio.gather(*[c.post("/v1/embeddings", json=body(x)) for x in raws])
            return rs, app.state.service.batcher.batches, metric(app, "qvj_batch_items_sum")

    compile_batch_shape(tiny_encoder, ims)  # else the batch's head runs alone while it compiles
    rs, batches, items = asyncio.run(go())
    assert (batches, items) == (1, 4)
    for r, w in zip(rs, want):
        assert r.status_code == 200, r.text
        assert rel_err(np.array(r.json()["data"][0]["embedding"], np.float32), w) <= 1e-6


def test_batches_are_cut_at_the_patch_budget(tiny_dirs, tiny_encoder, pngs):
    async def go():
        s = settings_for(tiny_dirs[1], max_wait_ms=1500, max_batch_patches=256, cache_bytes=0)
        async with st.served(s, tiny_encoder) as (c, app):
            ims = [png(make_image(224, 224, seed=20 + i)) for i in range(3)]  # 256 patches each
            rs = await asyncio.gather(*[c.post("/v1/embeddings", json=body(x)) for x in ims])
            return [r.status_code for r in rs], app.state.service.batcher.batches

    codes, batches = asyncio.run(go())
    assert codes == [200] * 3 and batches == 3  # a full budget leaves at once, without the wait


def test_a_new_batch_shape_compiles_off_the_device_thread(tiny_encoder):
    """Three items of a batch shape never compiled: the head runs alone (the device does not wait)
    while the compile thread compiles the shape; three more of the same sizes then share one call."""
    from qwen_vit_jax.preprocess.images import image_preprocessor
    from qwen_vit_jax.serve.batcher import Batcher, Job
    from qwen_vit_jax.serve.metrics import Metrics

    enc, m = tiny_encoder, Metrics()
    prep = image_preprocessor(enc.cfg.variant)
    ims = [make_image(392, 280 + 28 * (i % 3), seed=60 + i) for i in range(6)]  # 28 x 20..24 patches: one class
    items = [prep([im], config=enc.preprocess, uint8=True) for im in ims]
    batch = enc.prepare_batch(items[:3])
    assert not enc.ready(batch)
    b = Batcher(enc, budget=16384, max_wait_s=0.2, metrics=m)
    first = [b.submit(Job(px, g, np.zeros(0))) for px, g in items[:3]]
    for job in first:
        job.future.result(timeout=300)
    assert m.registry.get_sample_value("qvj_batch_items_bucket", {"le": "1.0"}) >= 1  # the head, alone
    deadline = time.monotonic() + 300
    while not enc.ready(batch):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    calls = m.registry.get_sample_value("qvj_batch_items_count")
    later = [b.submit(Job(px, g, np.zeros(0))) for px, g in items[3:]]
    for job, want in zip(first + later, enc.encode_images(ims)):
        assert rel_err(job.future.result(timeout=300).embedding, want) <= 1e-6
    b.close()
    assert m.registry.get_sample_value("qvj_batch_items_count") == calls + 1


def test_cache_hits_and_in_flight_dedup(tiny_dirs, tiny_encoder, pngs, tmp_path):
    """Identical items in flight together are encoded once; a repeat comes from memory; a new
    server with the same --cache DIR reads it from disk (the CLI's format)."""
    s = settings_for(tiny_dirs[1], max_wait_ms=500, cache=str(tmp_path / "cache"))

    async def first():
        async with st.served(s, tiny_encoder) as (c, app):
            rs = await asyncio.gather(*[c.post("/v1/embeddings", json=body(pngs[0])) for _ in range(3)])
            again = await c.post("/v1/embeddings", json=body(pngs[0]))
            m = {k: metric(app, "qvj_cache_total", result=k) for k in ("memory", "inflight", "miss", "disk")}
            return rs, again, m, app.state.service.batcher.batches

    rs, again, m, batches = asyncio.run(first())
    data = [r.json()["data"][0] for r in rs]
    assert batches == 1 and m == {"memory": 1, "inflight": 2, "miss": 1, "disk": 0}
    assert sorted(d["cached"] for d in data) == [False, True, True] and again.json()["data"][0]["cached"]
    assert all(d["embedding"] == data[0]["embedding"] for d in data)
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 1

    async def second():
        async with st.served(s, tiny_encoder) as (c, app):
            r = await c.post("/v1/embeddings", json=body(pngs[0]))
            return r, metric(app, "qvj_cache_total", result="disk"), app.state.service.batcher.batches

    r, disk, batches = asyncio.run(second())
    assert disk == 1 and batches == 0 and r.json()["data"][0]["cached"]
    assert r.json()["data"][0]["embedding"] == data[0]["embedding"]


# ---- limits, bad input, auth ----------------------------------------------------------------------
def test_limits_and_bad_input(tiny_dirs, tiny_encoder, pngs):
    big = png(make_image(300, 300))
    s = settings_for(tiny_dirs[1], max_body_bytes=200_000, max_items=3, max_image_pixels=250 * 250)
    bad = [
        ({"input": [{"image": b64(pngs[1])}] * 4}, 413, "4 items"),
        ({"input": [{"image": b64(pngs[1])}, {"image": b64(big)}]}, 413, "input[1]: the image is 300x300"),
        ({"input": [{"image": "http://example.com/cat.jpg"}]}, 400, "paths and URLs are not opened"),
        ({"input": [{"image": "/etc/passwd"}]}, 400, "input[0]"),
        ({"input": [{"image": "not base64!"}]}, 400, "not valid base64"),
        ({"input": [{"image": b64(b"GIF89a no")}]}, 400, "not an image"),
        ({"input": [{"image": b64(pngs[1]), "fps": 2}]}, 400, "fps"),
        ({"input": [{"video": b64(pngs[1]), "fps": -1}]}, 400, "fps must be"),
        ({"input": []}, 400, "non-empty list"),
        ({"input": [{"image": b64(pngs[1])}], "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": [{"image": b64(pngs[1])}], "colour": 1}, 400, "unknown fields"),
        ([1, 2], 400, "JSON object"),
    ]

    async def go():
        async with st.served(s, tiny_encoder) as (c, app):
            out = [await c.post("/v1/embeddings", json=b) for b, _, _ in bad]
            out.append(await c.post("/v1/embeddings", content=b"{" + b" " * 300_000 + b"}"))
            out.append(await c.post("/v1/embeddings", content=b"{not json"))
            return out, (await c.get("/healthz")).status_code

    out, alive = asyncio.run(go())
    want = [(code, text) for _, code, text in bad] + [(413, "bytes"), (400, "not JSON")]
    for r, (code, text) in zip(out, want):
        assert r.status_code == code, (r.status_code, r.text, text)
        assert text in r.json()["error"]["message"], (r.text, text)
    assert alive == 200


def test_a_bad_item_fails_only_its_own_request(tiny_dirs, tiny_encoder, images, pngs):
    """A PNG whose header reads but whose pixels do not: 400 naming it; a neighbour answered."""
    broken = pngs[1][: len(pngs[1]) // 2]
    want = tiny_encoder.encode_images([images[0]])[0]

    async def go():
        async with st.served(settings_for(tiny_dirs[1], max_wait_ms=300), tiny_encoder) as (c, app):
            return await asyncio.gather(
                c.post("/v1/embeddings", json=body(pngs[0])), c.post("/v1/embeddings", json=body(pngs[0], broken))
            )

    good, bad = asyncio.run(go())
    assert good.status_code == 200 and rel_err(np.array(good.json()["data"][0]["embedding"], np.float32), want) < 1e-6
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("input[1]: cannot read this image")


def test_full_queue_gets_429_with_retry_after(tiny_dirs, tiny_encoder, pngs):
    async def go():
        async with st.served(settings_for(tiny_dirs[1], max_queue=2, max_wait_ms=800), tiny_encoder) as (c, app):
            first = asyncio.ensure_future(c.post("/v1/embeddings", json=body(pngs[0], pngs[1])))
            while app.state.service.queued < 2:
                await asyncio.sleep(0.01)
            refused = await c.post("/v1/embeddings", json=body(png(make_image(64, 64))))
            return await first, refused, metric(app, "qvj_requests_total", status="429")

    first, refused, busy = asyncio.run(go())
    assert first.status_code == 200
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1 and busy == 1


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"keep_alive_s": 0}, "keep_alive_s"),
        ({"request_timeout_s": -1}, "request_timeout_s"),
        ({"max_queue": 0}, "max_queue"),
        ({"max_batch_patches": 0}, "max_batch_patches"),
        ({"declare": ((1, 0, 4),)}, "declare"),
    ],
)
def test_settings_reject_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        Settings(checkpoint="x", **kw)


def test_api_key(tiny_dirs, tiny_encoder, pngs, tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    with pytest.raises(ValueError, match="requires an API key"):
        Settings(checkpoint="x", host="0.0.0.0")
    Settings(checkpoint="x", host="0.0.0.0", api_key_file=str(key))  # allowed with a key

    async def go():
        async with st.served(settings_for(tiny_dirs[1], api_key_file=str(key)), tiny_encoder) as (c, _):
            return [
                (await c.post("/v1/embeddings", json=body(pngs[1]))).status_code,
                (
                    await c.post("/v1/embeddings", json=body(pngs[1]), headers={"Authorization": "Bearer nope"})
                ).status_code,
                (await c.get("/metrics")).status_code,
                (await c.get("/healthz")).status_code,
                (
                    await c.post("/v1/embeddings", json=body(pngs[1]), headers={"Authorization": "Bearer s3cret"})
                ).status_code,
            ]

    assert asyncio.run(go()) == [401, 401, 401, 200, 200]


# ---- cancellation, timeouts, workers ------------------------------------------------------------
def test_a_client_that_disconnects_cancels_its_queued_items(tiny_dirs, tiny_encoder, pngs):
    """The ASGI app driven by hand: the body, then http.disconnect while the item waits for its
    batch. The item is withdrawn: no device call, the queue empty again."""

    async def go():
        async with st.served(settings_for(tiny_dirs[1], max_wait_ms=60_000, cache_bytes=0), tiny_encoder) as (c, app):
            svc, sent, gone = app.state.service, [], asyncio.Event()
            payload = json.dumps(body(png(make_image(64, 96, seed=3)))).encode()
            messages = [{"type": "http.request", "body": payload, "more_body": False}]

            async def receive():
                if messages:
                    return messages.pop(0)
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)

            scope = {
                "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                "scheme": "http", "path": "/v1/embeddings", "raw_path": b"/v1/embeddings", "query_string": b"",
                "root_path": "", "headers": [(b"content-type", b"application/json")],
                "client": ("127.0.0.1", 1), "server": ("test", 80), "state": {},
            }  # fmt: skip
            call = asyncio.ensure_future(app(scope, receive, send))
            while svc.batcher is None or svc.batcher.waiting() < 1:
                await asyncio.sleep(0.01)
            gone.set()
            await asyncio.wait_for(call, 10)
            return (
                svc.batcher.waiting(),
                svc.batcher.batches,
                svc.queued,
                metric(app, "qvj_items_total", status="cancelled"),
            )

    assert asyncio.run(go()) == (0, 0, 0, 1)


def test_request_timeout_gets_504(tiny_dirs, tiny_encoder, pngs):
    async def go():
        s = settings_for(tiny_dirs[1], max_wait_ms=60_000, request_timeout_s=0.3, cache_bytes=0)
        async with st.served(s, tiny_encoder) as (c, app):
            r = await c.post("/v1/embeddings", json=body(pngs[1]))
            return r, app.state.service.queued, app.state.service.batcher.waiting()

    r, queued, waiting = asyncio.run(go())
    assert r.status_code == 504 and (queued, waiting) == (0, 0)


def test_a_dead_worker_is_replaced_and_its_item_gets_503(tiny_dirs, tiny_encoder, pngs):
    """An idle worker killed is replaced before an item meets it; one killed while it prepares an
    item fails that item alone (503) and is replaced; the next request is answered."""
    slow = png(make_image(3000, 3000, seed=5))  # long enough to prepare to be killed in the middle

    async def go():
        async with st.served(settings_for(tiny_dirs[1], workers=1, cache_bytes=0), tiny_encoder) as (c, app):
            pool = app.state.service.pool
            (first,) = pool.pids()
            os.kill(first, signal.SIGKILL)
            while pool.pids() in ([first], []):
                await asyncio.sleep(0.02)
            idle = await c.post("/v1/embeddings", json=body(pngs[1]))
            lost = asyncio.ensure_future(c.post("/v1/embeddings", json=body(slow)))
            while not pool.busy_pids():
                await asyncio.sleep(0.002)
            (second,) = pool.busy_pids()
            os.kill(second, signal.SIGKILL)
            lost = await lost
            after = await c.post("/v1/embeddings", json=body(pngs[1]))
            return idle, lost, after, {first, second, *pool.pids()}, metric(app, "qvj_workers_replaced_total")

    idle, lost, after, pids, replaced = asyncio.run(go())
    assert idle.status_code == 200
    assert lost.status_code == 503 and "died (SIGKILL)" in lost.json()["error"]["message"], lost.text
    assert lost.json()["error"]["message"].startswith("input[0]: ")
    assert after.status_code == 200 and replaced == 2 and len(pids) == 3


# ---- over real HTTP -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory):
    from qwen_vit_jax.tools.demo import TINY_QWEN3_VL, write_random_hf_checkpoint
    from qwen_vit_jax.weights.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("serve_q3")
    return convert_checkpoint(write_random_hf_checkpoint(TINY_QWEN3_VL, root / "hf", seed=1), root / "ckpt")


def test_real_http_deepstack_and_client_retries(qwen3_dirs, images):
    """uvicorn on 127.0.0.1: a tiny Qwen3-VL's tokens and deepstack features equal the encoder's;
    the client retries a full queue's 429 until it is answered."""
    import qwen_vit_jax as qvj
    from qwen_vit_jax.runtime.encoder import VisionEncoder

    enc = VisionEncoder.from_pretrained(qwen3_dirs)
    pv, thw = qvj.preprocess_images([images[1]], config=enc.preprocess, uint8=True)  # as encode_images sends it
    tokens, features = enc.encode(pv, thw, return_deepstack=True)
    s = Settings(checkpoint=str(qwen3_dirs), port=st.free_port(), workers=0, max_queue=1, max_wait_ms=50)
    with st.in_thread(s, enc) as (url, app), qvj.serve.Client(url, backoff=0.05) as client:
        assert app.state.service.error is None, app.state.service.error
        e, ds = client.embed([images[1]], return_deepstack=True)
        assert rel_err(e[0], tokens) <= 1e-6 and len(ds) == len(features) == 2
        assert all(rel_err(a, b) <= 1e-6 for a, b in zip(ds, features))
        assert e.grid_thw.tolist() == thw.tolist() and e.metadata["cached"] == [False]
        others = [make_image(112, 168, seed=30 + i) for i in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # one item queued at a time
            got = list(pool.map(lambda im: client.embed([im])[0], others))
        want = [enc.encode_images([im])[0] for im in others]
        assert all(rel_err(g, w) <= 1e-6 for g, w in zip(got, want))
        assert app.state.metrics.registry.get_sample_value("qvj_requests_total", {"status": "429"}) >= 1


def test_client_resends_after_a_lost_connection_not_after_a_timeout():
    """A connection lost before the answer (a reused keep-alive connection the server closed) is
    sent again; a timeout is raised, not resent."""
    import qwen_vit_jax as qvj

    emb, calls = np.arange(6, dtype="<f4").reshape(2, 3), []
    item = {"embedding": b64(emb.tobytes()), "shape": [2, 3], "grid_thw": [1, 4, 2], "timestamps": None}
    answer = {"data": [{**item, "sha256": "0" * 64, "cached": False}]}

    def flaky(request):
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ReadError("connection reset by peer", request=request)
        if len(calls) == 2:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, json=answer)

    with qvj.serve.Client("http://test", backoff=0.01, transport=httpx.MockTransport(flaky)) as client:
        np.testing.assert_array_equal(client.embed([b"bytes"])[0], emb)
    assert len(calls) == 3 and calls[0].content == calls[2].content

    def slow(request):
        calls.append(request)
        raise httpx.ReadTimeout("timed out", request=request)

    with qvj.serve.Client("http://test", backoff=0.01, transport=httpx.MockTransport(slow)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.embed([b"bytes"])
    assert len(calls) == 4


def test_cli_serves_and_drains_on_sigterm(tiny_dirs, pngs):
    """`qwen-vit-jax serve` in a subprocess: a request queued when SIGTERM arrives is answered, the
    server then exits 0."""
    port = st.free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "qwen_vit_jax.tools.cli", "serve", str(tiny_dirs[1]), "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--workers", "0", "--max-wait-ms", "1500", "--log-level", "warning"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            time.sleep(0.2)
        answer = {}
        t = threading.Thread(
            target=lambda: answer.update(r=httpx.post(f"{url}/v1/embeddings", json=body(pngs[1]), timeout=60))
        )
        t.start()
        time.sleep(0.5)  # the item waits for its batch (max wait 1.5 s)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0, proc.stdout.read()
        assert answer["r"].status_code == 200 and answer["r"].json()["data"][0]["grid_thw"] == [1, 8, 12]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_refuses_what_it_cannot_serve(tiny_dirs, tmp_path, capsys):
    """Exit 1 with one `error:` line: a non-loopback host without a key, a missing checkpoint, and a
    checkpoint that fails to load (the server stops instead of never turning ready)."""
    import shutil

    from qwen_vit_jax.tools.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dirs[1], bad)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:1000])
    port = str(st.free_port())
    cases = [
        (["serve", str(tiny_dirs[1]), "--host", "0.0.0.0"], "requires an API key"),
        (["serve", str(tmp_path / "missing"), "--port", port], "missing"),
        (["serve", str(bad), "--port", port, "--workers", "0", "--log-level", "error"], "cannot serve"),
    ]
    for argv, text in cases:
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "error: " in err and text in err, err
