"""The service's edges over real HTTP on 127.0.0.1 (uvicorn on a thread of this process, the CLI's
protocol and config): bounded request heads (431), streamed answers and clients that do not read
them, strict `model` / `user`, images sized from headers with a format allow-list (an ICO holding a
huge frame refused), a disk cache that fails soft with a layout that does not grow per fps,
pipelined requests never dropped by the keep-alive timer, body slots per client address, a request
that can never be admitted (413, not 429), settings that contradict each other and API keys refused
at start-up, a checkpoint's failure reported as the server's (500, not 400), and the command
line's one mapping of failures to exit statuses and flags.

One shared server (the tiny tower, --header-timeout 1, --max-connections 8, a --cache dir) serves
most tests; the few that need other settings start their own (cheap: the encoder is shared, the
preparation runs on a thread). Sockets are bounded in count and time (benchmarks/workloads/attacks.py).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import pathlib
import re
import shutil
import time

import httpx
import numpy as np
import pytest

from benchmarks.workloads import attacks as sa
from benchmarks.workloads import traffic as st

pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'qwen_vit_jax[serve]')")

HEADER_TIMEOUT = 1.0  # s: the shared server's head / pause / unread-answer deadline
# Small images are 112x168 (8x12 patches), as in test_serve.py: the session's tiny encoder has that
# program compiled already when the suite runs both.
MAX_CONNECTIONS = 8  # so the default body slots per address are 2
MAX_QUEUE = 40  # so the default --max-items is 40 too


@contextlib.contextmanager
def uvicorn_thread(encoder, **kw):
    """create_app(Settings(tiny, **kw)) on uvicorn in a thread as the CLI configures it: (url, app)."""
    import qwen_vit_jax as qvj

    with st.in_thread(qvj.serve.Settings(port=st.free_port(), **{"workers": 0, **kw}), encoder) as (url, app):
        assert app.state.service.error is None, app.state.service.error
        yield url, app


@pytest.fixture(scope="module")
def server(tiny_dirs, tiny_encoder, tmp_path_factory):
    """(url, port, cache dir) of the shared server."""
    cache = tmp_path_factory.mktemp("edges_cache")
    kw = {"header_timeout_s": HEADER_TIMEOUT, "max_connections": MAX_CONNECTIONS, "max_queue": MAX_QUEUE}
    with uvicorn_thread(tiny_encoder, checkpoint=str(tiny_dirs[1]), cache=str(cache), **kw) as (url, _):
        yield url, int(url.rsplit(":", 1)[1]), cache


def post(url: str, body: dict | bytes, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        url + st.ROUTE, content=content, headers={"Content-Type": "application/json", **headers}, timeout=60
    )


def images(*blobs: bytes, **kw) -> dict:
    return {"input": [{"image": st.b64(b)} for b in blobs], **kw}


def closed(url: str, reason: str) -> float:
    return st.metrics(url).get(f"qvj_connections_closed_total{{reason={reason}}}", 0.0)


# ---- bounded heads -------------------------------------------------------------------------------
def test_a_request_head_over_the_bound_gets_431_at_once(server):
    """A header streamed past --max-head-kb (64 KiB by default) gets 431 as soon as the bytes pass
    the bound, not after --header-timeout; a 60 KiB head with its body in the same reads is served."""
    url, port, _ = server
    before = closed(url, "head_too_large")
    first, seconds = sa.big_head(port, 200_000)
    assert first.startswith(b"HTTP/1.1 431"), first
    assert seconds < HEADER_TIMEOUT, seconds  # closed at the bound, not at the deadline
    body = json.dumps(images(st.jpeg(112, 168, seed=1))).encode()
    got, _ = sa.exchange(port, sa.http_request("POST", st.ROUTE, body, {"X-Pad": "a" * 60_000, "Connection": "close"}))
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    assert closed(url, "head_too_large") == before + 1


# ---- answers -------------------------------------------------------------------------------------
def test_answers_are_streamed_and_a_client_that_does_not_read_is_cut_off(server):
    """The answer comes in chunks (no Content-Length: it is never built whole); two clients that ask
    for a ~7 MB answer (more than the kernel's socket buffers hold) and never read it are cut off
    within --header-timeout of their buffers filling (send_timeout), and the server serves on."""
    url, port, _ = server
    raw = st.jpeg(448, 448, seed=2)  # 32x32 patches: 256 tokens x 128 floats
    r = post(url, images(raw, raw))
    assert r.status_code == 200 and r.headers.get("transfer-encoding") == "chunked", r.headers
    assert "content-length" not in r.headers
    assert r.json()["usage"]["prompt_tokens"] == 512

    before = closed(url, "send_timeout")
    # 20 items each: both are admitted together (MAX_QUEUE), however slowly the first is answered
    request = sa.http_request("POST", st.ROUTE, json.dumps(images(*[raw] * (MAX_QUEUE // 2))).encode())
    with sa.NonReaders(port, request, 2):  # (a third at once would meet the 2 body slots of the address)
        deadline = time.monotonic() + 60  # (the answer is encoded first: slow on a loaded box)
        while closed(url, "send_timeout") < before + 2:
            assert time.monotonic() < deadline, "a client that does not read was not cut off"
            time.sleep(0.1)
    assert post(url, images(st.jpeg(112, 168, seed=3))).status_code == 200


def test_a_streamed_answer_holds_every_float_exactly():
    """The pieces of the JSON answer, floats and base64, read back bit for bit (embeddings of 1 to
    7,000 rows: one piece or several)."""
    import asyncio

    from qwen_vit_jax.serve.answers import json_answer
    from qwen_vit_jax.serve.cache import Result
    from qwen_vit_jax.serve.service import Input

    rng = np.random.default_rng(0)
    nan = np.array([np.nan])
    results = [
        (Result(np.array([1, 2, 2]), rng.standard_normal((n, 96)).astype(np.float32), nan), False)
        for n in (1, 300, 7000)
    ]
    item = Input("image", b"", "ab")

    async def streamed(fmt):
        return b"".join([p async for p in json_answer([item] * 3, results, fmt, False)])

    for fmt in ("float", "base64"):
        doc = json.loads(asyncio.run(streamed(fmt)))
        for d, (res, _) in zip(doc["data"], results):
            got = (
                np.frombuffer(base64.b64decode(d["embedding"]), "<f4").reshape(d["shape"])
                if fmt == "base64"
                else np.asarray(d["embedding"], np.float32)
            )
            assert np.array_equal(got, res.embedding), fmt


# ---- strict fields -------------------------------------------------------------------------------
def test_model_and_user_are_short_strings(server):
    """`user` holding 200,000 empty lists, a 300-character `model`, a number: 400 naming the field;
    short strings are accepted; an unknown field holding a large list is refused by its name."""
    url, _, _ = server
    ok = {"image": st.b64(st.jpeg(112, 168, seed=4))}
    lists = b'{"input": [' + json.dumps(ok).encode() + b'], "user": [' + b"[]," * 200_000 + b"[]]}"
    cases = [
        (lists, "`user`"),
        ({"input": [ok], "model": "m" * 300}, "`model` holds 300 characters"),
        ({"input": [ok], "model": 3}, "`model`"),
        (b'{"input": [], "extra": [' + b"[]," * 200_000 + b"[]]}", "'extra'"),
    ]
    for body, text in cases:
        r = post(url, body)
        assert r.status_code == 400 and text in r.json()["error"]["message"], (r.status_code, r.text[:300])
    assert post(url, {"input": [ok], "model": "qwen-vit", "user": "u-1"}).status_code == 200


# ---- images checked without decoding -------------------------------------------------------------
def test_an_ico_holding_a_huge_frame_is_refused_unopened(server):
    """An ICO whose 16x16 directory entry holds a 3000x3000 PNG (Pillow decodes it to read its
    size) is refused as a format off the allow-list, at once; every accepted format claiming 8000 x
    9000 pixels in its header gets 413 from the header alone (a few bytes, nothing decoded)."""
    url, _, _ = server
    t0 = time.monotonic()
    r = post(url, images(sa.ico_holding(3000)))
    assert r.status_code == 415 and "ICO images are not accepted" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 5
    for fmt in ("PNG", "JPEG", "GIF", "BMP", "TIFF", "PPM", "WEBP"):
        r = post(url, images(sa.claiming(fmt, 8000, 9000)))
        assert r.status_code == 413 and "8000x9000" in r.json()["error"]["message"], (fmt, r.text)


# ---- the disk cache ------------------------------------------------------------------------------
def test_the_cache_layout_does_not_grow_a_folder_per_fps(server, tmp_path):
    """One clip at two frame rates: two entries, in the cache's 2-hex-digit folders (no folder per
    settings fingerprint, so none per fps value)."""
    pytest.importorskip("av")
    from benchmarks.workloads.clips import write_clip

    url, _, cache = server
    clip = pathlib.Path(write_clip(tmp_path / "clip.mov", "png_odd_97x61_7fps_3s")).read_bytes()
    for fps in (1, 2):
        r = post(url, {"input": [{"video": st.b64(clip), "fps": fps}]})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while len(list(cache.rglob("*.safetensors"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # entries are written after the answer
    folders = [p.name for p in cache.iterdir() if p.is_dir()]
    assert folders and all(re.fullmatch("[0-9a-f]{2}", f) for f in folders), folders


def test_a_cache_that_cannot_be_written_or_read_fails_soft(tiny_dirs, tiny_encoder, tmp_path, monkeypatch, caplog):
    """--cache naming a file (no directory can be made: the lookups miss, the writes fail) and a full
    disk (here a writer's own error type, SafetensorError, not an OSError): answered 200, each failure
    counted in qvj_cache_errors_total{op}, logged as a warning without a traceback."""
    safetensors = pytest.importorskip("safetensors")
    from qwen_vit_jax.weights import safetensors_io

    file = tmp_path / "not-a-dir"
    file.write_text("x")
    with uvicorn_thread(tiny_encoder, checkpoint=str(tiny_dirs[1]), cache=str(file)) as (url, _):
        assert [post(url, images(st.jpeg(112, 168, seed=5))).status_code for _ in range(2)] == [200, 200]
        deadline = time.monotonic() + 10
        while st.metrics(url).get("qvj_cache_errors_total{op=write}", 0) < 1:  # written after the answer
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def full(*a, **k):
        raise safetensors.SafetensorError("Error while serializing: IoError(No space left on device (os error 28))")

    monkeypatch.setattr(safetensors_io, "write_safetensors", full)
    caplog.set_level(logging.WARNING)
    with uvicorn_thread(tiny_encoder, checkpoint=str(tiny_dirs[1]), cache=str(tmp_path / "c")) as (url, _):
        assert [post(url, images(st.jpeg(112, 168, seed=s))).status_code for s in (6, 7)] == [200, 200]
        deadline = time.monotonic() + 10
        while st.metrics(url).get("qvj_cache_errors_total{op=write}", 0) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    warned = [r for r in caplog.records if "disk cache" in r.getMessage()]
    assert warned and all(r.exc_info is None and r.levelno == logging.WARNING for r in warned)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


# ---- connections ---------------------------------------------------------------------------------
def test_a_pipelined_request_is_not_dropped_by_the_keep_alive_timer(tiny_dirs, tiny_encoder):
    """A quick request and a slow one (its batch waits 1.5 s) sent back to back on one connection,
    --keep-alive 0.5: both are answered."""
    with uvicorn_thread(tiny_encoder, checkpoint=str(tiny_dirs[1]), keep_alive_s=0.5, max_wait_ms=1500) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps(images(st.jpeg(112, 168, seed=8))).encode()
        got, seconds = sa.exchange(port, sa.http_request("GET", "/healthz") + sa.http_request("POST", st.ROUTE, body))
    assert got.count(b"HTTP/1.1 200") == 2, (seconds, got[:300])
    assert b'"embedding"' in got


def test_slow_bodies_of_one_address_hold_a_bounded_number_of_slots(server):
    """Three requests from one address whose bodies stall, against 2 body slots per address
    (--max-connections 8 / 4): the third gets 429 with Retry-After at once, the others 408 at the
    body deadline; each close is counted."""
    url, port, _ = server
    before = {k: closed(url, k) for k in ("peer_bodies", "body_timeout")}
    with sa.Sockets(port, stalled=3) as stalled:
        assert stalled.wait_closed(HEADER_TIMEOUT + 10), stalled.closed
    firsts = sorted(first[:12] for _, first in stalled.closed.values())
    assert firsts == [b"HTTP/1.1 408", b"HTTP/1.1 408", b"HTTP/1.1 429"], stalled.closed
    refused = next(s for s, first in stalled.closed.values() if first.startswith(b"HTTP/1.1 429"))
    assert refused < HEADER_TIMEOUT, refused
    assert closed(url, "peer_bodies") == before["peer_bodies"] + 1
    assert closed(url, "body_timeout") == before["body_timeout"] + 2


# ---- limits that agree -----------------------------------------------------------------------------
def test_a_request_that_can_never_be_admitted_is_413_not_429(server):
    """--max-queue 40 with --max-items at its default: 41 items are 413 naming the bound, not a 429
    a client would retry forever on an idle server."""
    url, _, _ = server
    small = st.jpeg(28, 28, seed=9)
    r = post(url, images(*[small] * (MAX_QUEUE + 1)))
    assert r.status_code == 413 and "at most 40" in r.json()["error"]["message"], (r.status_code, r.text)
    assert "retry-after" not in r.headers


def test_contradicting_settings_are_refused_at_start_up_naming_both_flags(tmp_path, capsys):
    from qwen_vit_jax.tools.cli import main

    cases = [
        (["--max-items", "8", "--max-queue", "4"], ("--max-items 8", "--max-queue 4")),
        (["--max-item-patches", "4096", "--max-batch-patches", "1024"], ("--max-item-patches", "--max-batch-patches")),
        (["--max-peer-bodies", "9", "--max-connections", "8"], ("--max-peer-bodies", "--max-connections")),
    ]
    for flags, names in cases:
        assert main(["serve", str(tmp_path / "no-checkpoint"), *flags]) == 1
        err = capsys.readouterr().err
        assert all(n in err for n in names), err


def test_an_api_key_must_be_printable_ascii(tiny_dirs, tmp_path):
    """A key of non-ASCII characters would only match its latin-1 bytes: refused when the app is
    made, naming the character (never the key)."""
    import qwen_vit_jax as qvj

    for key, shown in (("clé-secrète", "U+00E9"), ("two words", "U+0020")):
        f = tmp_path / "key"
        f.write_text(key + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match=f"printable ASCII.*{re.escape(shown)}") as e:
            qvj.serve.create_app(qvj.serve.Settings(checkpoint=str(tiny_dirs[1]), api_key_file=str(f), workers=0))
        assert key not in str(e.value)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the checkpoint's pixel table
def test_a_checkpoint_that_fails_on_the_device_is_the_servers_500(tiny_dirs, tmp_path):
    """A checkpoint whose image_std is 1e-45 loads; its pixel table overflows and the device call's
    finiteness check fails: every client gets 500 (an internal error), never 400."""
    from qwen_vit_jax.runtime.encoder import VisionEncoder

    bad = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs[1], bad)
    pre = json.loads((bad / "preprocessor_config.json").read_text())
    pre["image_std"] = [1e-45] * 3
    (bad / "preprocessor_config.json").write_text(json.dumps(pre))
    enc = VisionEncoder.from_pretrained(bad)
    with uvicorn_thread(enc, checkpoint=str(bad)) as (url, _):
        r = post(url, images(st.jpeg(112, 168, seed=10)))
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", (r.status_code, r.text)
    assert "internal" in r.json()["error"]["message"] and str(tmp_path) not in r.text


# ---- the command line's one mapping ----------------------------------------------------------------
def test_the_cli_maps_each_failure_once_in_its_flags():
    """Exit statuses by kind, library keywords spelled as the command's flags, the bound an error is
    about named by its flag (serve's Settings flags included)."""
    from qwen_vit_jax import errors
    from qwen_vit_jax.tools.args import command_flags
    from qwen_vit_jax.tools.cli import report

    encode = command_flags("encode", ["keep_going", "resume", "fps", "max_frames"])
    serve = command_flags("serve", ["request_timeout_s", "cache_bytes", "max_items"])
    cases = [
        (errors.BadInput("cannot read x.png (keep_going=True skips unreadable inputs)", limit="keep_going"), encode,
         1, "cannot read x.png (--keep-going skips unreadable inputs)"),
        (errors.TooLarge("the clip has 900 frames; at most 768", limit="max_frames"), encode,
         1, "the clip has 900 frames; at most 768 (--max-frames)"),
        (ValueError("fps=2 is what Qwen's tools use; the same command with resume=True continues"), encode,
         1, "--fps 2 is what Qwen's tools use; the same command with --resume continues"),
        (errors.TooLarge("too many", limit="max_items"), serve, 1, "too many (--max-items)"),
        (errors.Internal("the device failed"), serve, 70, "the device failed"),
        (errors.Unavailable("not ready"), serve, 75, "not ready"),
        (KeyboardInterrupt("3 new inputs written to o; the same command with resume=True continues"), encode,
         130, "interrupted; 3 new inputs written to o; the same command with --resume continues"),
    ]  # fmt: skip
    for e, flags, status, message in cases:
        assert report(e, flags) == (status, message), e
    assert serve == {"request_timeout_s": "--timeout", "cache_bytes": "--cache-mb", "max_items": "--max-items"}
