"""`qwen-vit-jax serve` against strangers, over real HTTP on 127.0.0.1: sockets that never send a
request head, bodies that stall, a 49-megapixel image, and what an answer must not carry (server
paths, Python reprs, the route listing without the key); the papercuts a client meets (base64 with
line breaks, a server without PyAV, OpenAI's usage fields and client, Retry-After on every 503, the
docs' curl example with a 5 MB photo).

One CLI server (a subprocess: what a user runs) serves most tests, with a short --header-timeout, a
small --max-connections, a key, a patch budget of 1024 and PyAV made unimportable; a uvicorn thread
in this process (the same protocol and config, `qvj.serve.uvicorn_config`) serves the tests that
need the server's insides (a worker killed mid-item) or no key (the docs' example).
(benchmarks/workloads/attacks.py holds the hostile sockets; `python -m benchmarks hostile` measures them.)
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from benchmarks.workloads import attacks as sa
from benchmarks.workloads import traffic as st

pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'qwen_vit_jax[serve]')")

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT = 2.0  # s
MAX_CONNECTIONS = 8
BUDGET = 1024  # patches per device call, and so per item


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory):
    """The CLI's server: a key, --header-timeout 2, --max-connections 8, budget 1024, 2 workers,
    and PyAV unimportable in it and its workers (a package `av` first on PYTHONPATH that raises)."""
    root = tmp_path_factory.mktemp("serve_hostile")
    (root / "key").write_text(KEY + "\n")
    (root / "noav" / "av").mkdir(parents=True)
    (root / "noav" / "av" / "__init__.py").write_text("raise ImportError('PyAV is not installed here (a test)')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "noav"), *sys.path]))
    flags = ["--workers", 2, "--max-batch-patches", BUDGET, "--header-timeout", HEADER_TIMEOUT]
    flags += ["--max-connections", MAX_CONNECTIONS, "--api-key-file", root / "key", "--timeout", 60]
    flags += ["--max-peer-bodies", MAX_CONNECTIONS]  # every test socket comes from 127.0.0.1
    with st.Server(tiny_dirs[1], *flags, log=root / "server.log", env=env) as s:
        yield s


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", headers=AUTH, timeout=10).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def post(url: str, body: dict | bytes, timeout: float = 60, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {**AUTH, "Content-Type": "application/json", **headers}
    return httpx.post(url + st.ROUTE, content=content, headers=h, timeout=timeout)


def image_body(*images: bytes, encode=st.b64, **kw) -> dict:
    return {"input": [{"image": encode(x)} for x in images], **kw}


# ---- no lockout ---------------------------------------------------------------------------------
def test_idle_and_slowloris_sockets_do_not_lock_out_a_client(server):
    """20 sockets that never complete a request head (10 silent, 10 trickling a byte every 0.25 s)
    against --max-connections 8: a real request is answered at once (it takes the slot of the
    oldest of them), and every one of them is closed within --header-timeout, trickling or not."""
    before = metrics(server.url)
    with sa.Sockets(server.port, silent=10, slow=10) as attack:
        time.sleep(0.5)  # all accepted and trickling
        t0 = time.monotonic()
        r = post(server.url, image_body(st.jpeg(112, 112, seed=1)), timeout=30)
        served = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert served < 10, served
        assert attack.wait_closed(HEADER_TIMEOUT + 10), attack.closed
        slow = [attack.closed[i][0] for i, k in enumerate(attack.kinds) if k == "slow"]
    assert max(slow) < HEADER_TIMEOUT + 5, slow  # closed while still trickling
    assert all(first.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503")) for _, first in attack.closed.values())
    after = metrics(server.url)
    closed = [f"qvj_connections_closed_total{{reason={r}}}" for r in ("header_timeout", "evicted")]
    assert sum(after.get(k, 0) - before.get(k, 0) for k in closed) == 20


def test_stalled_bodies_get_408_and_a_full_house_503_with_retry_after(server):
    """8 requests whose bodies stall hold every slot: a new request gets 503 with Retry-After (no
    slot holds an idle socket to give up); --header-timeout later each stalled one gets 408 and is
    closed, and requests are answered again."""
    with sa.Sockets(server.port, stalled=MAX_CONNECTIONS, headers=AUTH) as stalled:
        time.sleep(0.5)
        full = post(server.url, image_body(st.jpeg(112, 112, seed=2)), timeout=30)
        assert full.status_code == 503 and full.headers.get("retry-after") == "1", (full.status_code, full.headers)
        assert stalled.wait_closed(HEADER_TIMEOUT + 10), stalled.closed
    assert all(first.startswith(b"HTTP/1.1 408") for _, first in stalled.closed.values()), stalled.closed
    assert post(server.url, image_body(st.jpeg(112, 112, seed=2))).status_code == 200


# ---- a bounded cost per item --------------------------------------------------------------------
def test_a_49_megapixel_image_costs_one_budget_sized_call(server):
    """A 7000x7000 PNG on the released preprocessing (max_pixels 12,845,056: 65,536 patches) is
    resized down to the per-item bound (the patch budget, 1024) keeping its aspect, and a small
    request sent a second later waits for at most about that one call."""
    big = sa.big_png(7000)
    out = {}

    def send_big():
        t0 = time.monotonic()
        out["big"] = post(server.url, image_body(big), timeout=120)
        out["big_s"] = time.monotonic() - t0

    t = threading.Thread(target=send_big)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    small = post(server.url, image_body(st.jpeg(112, 112, seed=3)), timeout=120)
    small_s = time.monotonic() - t0
    t.join(150)
    assert out["big"].status_code == 200, out["big"].text
    _, h, w = out["big"].json()["data"][0]["grid_thw"]
    assert h == w and h * w <= BUDGET, (h, w)  # aspect kept, within the bound
    assert small.status_code == 200 and small_s < 20, small_s  # unbounded: ~50 s behind a 65,536-patch call
    assert metrics(server.url)["qvj_items_resized_total"] >= 1


# ---- nothing leaked -----------------------------------------------------------------------------
def test_nothing_leaks(server, tiny_dirs, tmp_path):
    """No server path in the safetensors answer's metadata, no Python repr in an error body, the
    route listing and /metrics behind the key (no /docs or /redoc pages), the probes open."""
    import qwen_vit_jax as qvj

    r = post(server.url, image_body(st.jpeg(112, 112, seed=4)), Accept="application/vnd.safetensors")
    assert r.status_code == 200
    (tmp_path / "answer.safetensors").write_bytes(r.content)
    meta = qvj.read_embeddings(tmp_path / "answer.safetensors").metadata
    assert meta["checkpoint"] == pathlib.Path(tiny_dirs[1]).name
    assert str(tiny_dirs[1]) not in r.content.decode("latin-1")
    garbage = post(server.url, image_body(b"\x00not an image at all"))
    assert garbage.status_code == 400 and garbage.json()["error"]["message"].startswith("input[0]: ")
    assert not re.search(r"<[^>]* at 0x|object at|0x[0-9a-f]{6,}", garbage.text), garbage.text
    for route, want, want_keyed in [
        ("/openapi.json", 401, 200),
        ("/docs", 404, 404),
        ("/redoc", 404, 404),
        ("/metrics", 401, 200),
        ("/healthz", 200, 200),
        ("/readyz", 200, 200),
    ]:
        assert httpx.get(server.url + route).status_code == want, route
        assert httpx.get(server.url + route, headers=AUTH).status_code == want_keyed, route
    assert "/v1/embeddings" in httpx.get(server.url + "/openapi.json", headers=AUTH).json()["paths"]


# ---- papercuts ----------------------------------------------------------------------------------
def test_base64_with_line_breaks_is_accepted(server):
    """MIME's base64 (lines of 76, as `base64` without -w0 and Python's encodebytes write it), in a
    plain item and a data: URL: the same answer as one line."""
    raw = st.jpeg(112, 168, seed=5)

    def mime(b: bytes) -> str:
        return base64.encodebytes(b).decode()

    def data_url(b: bytes) -> str:
        return "data:image/jpeg;base64," + mime(b)

    answers = [post(server.url, image_body(raw, encode=e, encoding_format="base64")) for e in (st.b64, mime, data_url)]
    assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
    assert len({r.json()["data"][0]["embedding"] for r in answers}) == 1


def test_the_serve_extra_carries_pyav():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.match(r"av\b", dep) for dep in extras["serve"]), extras["serve"]
    assert any(re.match(r"openai\b", dep) for dep in extras["test"]), extras["test"]


def test_a_server_without_pyav_answers_a_video_with_a_5xx_naming_the_extra(server, tmp_path):
    from benchmarks.workloads.clips import write_clip

    with open(write_clip(tmp_path / "clip.mp4", "png_odd_97x61_7fps_3s"), "rb") as f:
        clip = f.read()
    r = post(server.url, {"input": [{"video": st.b64(clip)}]})
    assert 500 <= r.status_code < 600 and r.status_code != 503, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert message.startswith("input[0]: ") and "qwen_vit_jax[serve]" in message, message


def test_usage_fields_and_the_official_openai_client(server):
    """`usage` has OpenAI's prompt_tokens and total_tokens; `openai`'s embeddings.create sends our
    items and reads the answer: a flat float list per item (its client decodes base64), our fields
    (grid_thw, shape, ...) in model_extra."""
    openai = pytest.importorskip("openai")
    raw = st.jpeg(112, 168, seed=6)  # 8 x 12 patches: 24 tokens
    r = post(server.url, image_body(raw, raw))
    assert r.status_code == 200
    assert r.json()["usage"] == {"prompt_tokens": 48, "total_tokens": 48}
    want = np.asarray(r.json()["data"][0]["embedding"], np.float32)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    answer = client.embeddings.create(model="qwen-vit", input=[{"image": st.b64(raw)}])
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == 24
    row = answer.data[0]
    assert np.array_equal(np.asarray(row.embedding, np.float32), want.ravel())
    assert row.model_extra["grid_thw"] == [1, 8, 12] and row.model_extra["shape"] == list(want.shape)


# ---- in-process servers: a killed worker, a failed load, the docs' example -----------------------
def test_every_503_carries_retry_after(tiny_dirs, tiny_encoder, tmp_path):
    """A dead worker's 503 (a worker killed while it prepares an item) and a failed load's 503s
    carry Retry-After; the failed load's answers do not show the server's path."""
    from qwen_vit_jax.serve.settings import Settings

    slow = st.jpeg(3000, 3000, seed=7)  # long enough to prepare to be killed in the middle
    s = Settings(checkpoint=str(tiny_dirs[1]), port=st.free_port(), workers=1, cache_bytes=0, max_batch_patches=BUDGET)
    with st.in_thread(s, tiny_encoder) as (url, app):
        pool = app.state.service.pool
        out = {}

        def send():
            out["r"] = httpx.post(url + st.ROUTE, content=st.body([slow]), timeout=60)

        t = threading.Thread(target=send)
        t.start()
        deadline = time.monotonic() + 30
        while not pool.busy_pids():
            assert time.monotonic() < deadline
            time.sleep(0.002)
        os.kill(pool.busy_pids()[0], signal.SIGKILL)
        t.join(60)
    lost = out["r"]
    assert lost.status_code == 503 and "died" in lost.json()["error"]["message"], lost.text
    assert lost.headers.get("retry-after") == "1"

    missing = tmp_path / "no-such-checkpoint"
    s = Settings(checkpoint=str(missing), port=st.free_port(), workers=0)
    with st.in_thread(s) as (url, app):
        ready = httpx.get(url + "/readyz")
        refused = httpx.post(url + st.ROUTE, content=st.body([st.jpeg(56, 56, seed=8)]))
    for r in (ready, refused):
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", (r.status_code, r.headers)
        assert str(tmp_path) not in r.text, r.text


def _doc_block(page: pathlib.Path, marker: str) -> str:
    """The ```bash block of `page` that contains `marker`."""
    blocks = re.findall(r"^```bash\n(.*?)^```", page.read_text(), re.S | re.M)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{page.name}: {len(found)} bash blocks contain {marker!r}"
    return found[0]


def test_the_docs_curl_example_sends_a_5_megabyte_photo(tiny_dirs, tiny_encoder, tmp_path):
    """docs/serve.md's first example (the lines after its `qwen-vit-jax serve`) against a server on
    127.0.0.1: a 5 MB photo is answered (a base64 body passed as one argument fails past ~128 KB)."""
    from PIL import Image

    from qwen_vit_jax.serve.settings import Settings

    rng = np.random.default_rng(9)
    photo = rng.integers(0, 256, (2000, 2400, 3), np.uint8)  # noise: a JPEG as large as a 12 MP photo's
    Image.fromarray(photo).save(tmp_path / "photo.jpg", quality=95)
    assert (tmp_path / "photo.jpg").stat().st_size >= 5_000_000
    block = _doc_block(ROOT / "docs" / "serve.md", "curl -s localhost:8000/v1/embeddings")
    lines = [ln for ln in block.splitlines() if not ln.startswith("qwen-vit-jax serve")]
    s = Settings(checkpoint=str(tiny_dirs[1]), port=st.free_port(), workers=1, max_batch_patches=BUDGET)
    script = "\n".join(lines).replace("localhost:8000", f"127.0.0.1:{s.port}")
    with st.in_thread(s, tiny_encoder):
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert '"ready":true' in done.stdout and '"embedding"' in done.stdout, (done.stdout[:500], done.stderr)


def test_the_item_bound_per_tower():
    """ItemBound on each resize rule: images land within the bound (GLM-4V counts an image as two
    frames in its budget), Qwen3-VL's whole-clip video budget is left alone, --max-frames only
    lowers, and `resize=False` keeps the checkpoint's preprocessing and refuses instead."""
    from qwen_vit_jax import families
    from qwen_vit_jax.preprocess.config import Preprocessing
    from qwen_vit_jax.serve.bounds import ItemBound

    for variant in (families.QWEN2_5_VL, families.QWEN3_VL, families.GLM4V, families.PADDLEOCR_VL):
        p = Preprocessing.defaults(variant)
        b = ItemBound.of(p, 1024, max_frames=8, resize=True)
        assert b.image_patches(7000, 7000) == 1024 and b.image_over(7000, 7000) is None, variant
        assert b.resized(7000, 7000) and not b.resized(56, 56), variant
        assert b.preprocessing.video.max_frames == 8 and b.preprocessing.video.min_frames <= 8
        if p.video.video_sampler == "qwen3-vl":
            assert b.preprocessing.video.max_pixels == p.video.max_pixels
        assert b.grid_over("video", (2, 32, 33)).startswith("each frame is 32x33 = 1,056 patches")
    p = Preprocessing.defaults(families.QWEN2_5_VL)
    assert ItemBound.of(p, 16384, max_frames=10_000, resize=True).preprocessing.video == p.video
    refuse = ItemBound.of(p, 1024, max_frames=None, resize=False)
    assert refuse.preprocessing == p and "at most 1,024 per item" in refuse.image_over(1400, 1400)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"header_timeout_s": 0}, "header_timeout_s"),
        ({"max_item_patches": 0}, "max_item_patches"),
        ({"max_frames": -1}, "max_frames"),
        ({"oversize": "crop"}, "oversize"),
    ],
)
def test_settings_reject_bad_limits(kw, match):
    from qwen_vit_jax.serve.settings import Settings

    with pytest.raises(ValueError, match=match):
        Settings(checkpoint="x", **kw)
