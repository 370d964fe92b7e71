"""The HTTP app: `create_app(settings)` -> a FastAPI app whose lifespan loads the model once.

    POST /v1/embeddings   {"input": [{"image": "<base64 | data: URL>"}, {"video": "<base64>", "fps": 2}],
                           "encoding_format": "float" | "base64", "return_deepstack": false}
                          -> {"object": "list", "data": [{"index", "embedding", "grid_thw", "timestamps",
                              "sha256", "cached"(, "shape", "deepstack")}],
                              "usage": {"prompt_tokens": T, "total_tokens": T}}
                          Accept: application/vnd.safetensors -> the embeddings file read_embeddings reads
    GET /healthz          alive (200 from the start)
    GET /readyz           200 once the model is loaded and the declared sizes compiled, else 503
    GET /metrics          Prometheus text (metrics.py)
    GET /openapi.json     the route listing (no /docs or /redoc pages)

Bytes only: an item is base64 (line breaks allowed, as MIME writes it) or a data: URL; nothing named
in a request is opened or fetched. Limits: a body over max_body_bytes, more than max_items items or
an image over max_image_pixels (from its header, before any decoding) get 413; an item over the
per-item bound is resized down to it or refused with 413 (bounds.py); a full queue 429 with
Retry-After; a request unanswered after request_timeout_s 504; every 503 carries Retry-After. With
an API key every route but the probes (/openapi.json and /metrics too) wants `Authorization: Bearer
KEY` (401 otherwise; compared in constant time). Errors come as {"error": {"message", "type",
"code"}}, the message naming the item (`input[i]: ...`) and never a server path or a Python
object's repr. Connection deadlines and the connection limit: connections.py.

The lifespan loads in a thread, so /healthz answers at once and /readyz tells when to send work;
on shutdown (uvicorn's own: SIGTERM stops accepting and waits for the requests in flight) it
encodes what is queued, then stops the device thread and the workers.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import io
import json
import logging
import os
import re
import tempfile
import time

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from qwen_vit_jax.serve.metrics import Metrics
from qwen_vit_jax.serve.service import Busy, Failure, Item, Service
from qwen_vit_jax.serve.settings import Settings

SAFETENSORS = "application/vnd.safetensors"
log = logging.getLogger("qwen_vit_jax.serve")


def create_app(settings: Settings, *, encoder=None) -> FastAPI:
    """The app for `settings`. `encoder`: an already loaded VisionEncoder to serve instead of loading
    settings.checkpoint (the Ray deployment's replicas, tests)."""
    metrics = Metrics()
    service = Service(settings, metrics)
    key = settings.api_key()  # read now: a missing or empty key file fails before serving

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.ensure_future(asyncio.to_thread(service.load, encoder))
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                await loading
            try:
                await asyncio.to_thread(service.close)
            except RuntimeError:  # the interpreter is exiting (no new threads): close here
                service.close()

    # /openapi.json is a route of ours below (behind the key); the HTML pages are off
    app = FastAPI(title="qwen_vit_jax encoder", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service, app.state.metrics, app.state.settings = service, metrics, settings

    def unauthorized(request: Request) -> Response | None:
        if key is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return None
        return _error(401, "a valid API key is required: Authorization: Bearer KEY", {"WWW-Authenticate": "Bearer"})

    @app.get("/healthz")
    async def healthz():
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz():
        if service.ready:
            return {"ready": True}
        body = {"ready": False, "error": LOAD_FAILED} if service.error else {"ready": False}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        return JSONResponse(app.openapi())

    @app.get("/metrics")
    async def prometheus(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        return Response(metrics.render(), media_type=Metrics.CONTENT_TYPE)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        t0 = time.perf_counter()
        response = await _embeddings(request, service, settings, unauthorized)
        metrics.requests.labels(str(response.status_code)).inc()
        metrics.request_seconds.observe(time.perf_counter() - t0)
        return response

    return app


async def _embeddings(request: Request, service: Service, s: Settings, unauthorized) -> Response:
    m = service.metrics
    if (denied := unauthorized(request)) is not None:
        return denied
    if not service.ready:
        return _error(503, f"not ready: {LOAD_FAILED}" if service.error else "not ready: the model is loading")
    if service.full():  # before reading the body: an overloaded server reads no more bodies
        return _busy(Busy())
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > s.max_body_bytes:
        return _error(413, f"the body has {int(length):,} bytes; at most {s.max_body_bytes:,}")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > s.max_body_bytes:
                return _error(413, f"the body is over {s.max_body_bytes:,} bytes")
    except ClientDisconnect:  # gone while sending: nothing was admitted
        return _error(499, "the client closed the connection")
    try:
        items, fmt, deepstack, resized = await asyncio.to_thread(_parse, bytes(body), s, service.bound)
    except Failure as e:
        m.items.labels("too_large" if e.status == 413 else "bad_input").inc()
        return _error(e.status, e.message)
    del body
    safetensors = SAFETENSORS in request.headers.get("accept", "")
    if safetensors and deepstack:
        return _error(400, "deepstack features come in JSON only; drop return_deepstack or the safetensors Accept")
    try:
        service.admit(len(items))
    except Busy as e:
        m.items.labels("busy").inc(len(items))
        return _busy(e)
    try:
        work = asyncio.ensure_future(service.embed(items, deepstack))
        gone = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({work, gone}, timeout=s.request_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            if gone in done:  # nobody to answer: its items are withdrawn
                m.items.labels("cancelled").inc(len(items))
                return _error(499, "the client closed the connection")
            m.items.labels("timeout").inc(len(items))
            return _error(504, f"not answered within {s.request_timeout_s:g} s")
        gone.cancel()
        try:
            results = work.result()
        except Failure as e:
            m.items.labels(_STATUS_LABEL.get(e.status, "error")).inc()
            return _error(e.status, e.message)
    finally:
        service.release(len(items))
    ids = None
    if service.vllm is not None:  # each item in vLLM's store before the answer says so
        try:
            ids = await asyncio.to_thread(service.vllm.put_results, items, [r for r, _ in results])
        except OSError as e:  # a full or read-only store: the server's fault, and no answer claims an item
            log.error("writing vLLM's store failed: %s", e)
            return _error(500, "the embeddings could not be written to vLLM's store (logged by the server)")
    for _, cached in results:
        m.items.labels("cached" if cached else "ok").inc()
    m.resized.inc(resized)
    t1 = time.perf_counter()
    if safetensors:
        content = await asyncio.to_thread(_safetensors, items, results, service, ids)
        response = Response(content, media_type=SAFETENSORS)
    else:
        content = await asyncio.to_thread(_json, items, results, fmt, deepstack, ids)
        response = Response(content, media_type="application/json")
    m.stage.labels("respond").observe(time.perf_counter() - t1)
    return response


_STATUS_LABEL = {400: "bad_input", 413: "too_large", 503: "unavailable", 504: "timeout"}
LOAD_FAILED = "loading the model failed (the server's log says why)"  # the error itself may name server paths


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the ASGI server's http.disconnect, after the body)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---- parsing ----------------------------------------------------------------------------------
def _parse(body: bytes, s: Settings, bound) -> tuple[list[Item], str, bool, int]:
    """The request body -> (items, encoding_format, return_deepstack, how many images the per-item
    `bound` resizes down); Failure 400 / 413 naming the field or item that is wrong."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested past the parser's depth
        raise Failure(400, f"the body is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise Failure(400, "the body must be a JSON object with an `input` list")
    unknown = set(doc) - {"input", "encoding_format", "return_deepstack", "model", "user"}
    if unknown:
        raise Failure(400, f"unknown fields {sorted(unknown)}; known: input, encoding_format, return_deepstack")
    inputs = doc.get("input")
    if not isinstance(inputs, list) or not inputs:
        raise Failure(400, '`input` must be a non-empty list of {"image": ...} / {"video": ...} objects')
    if len(inputs) > s.max_items:
        raise Failure(413, f"{len(inputs)} items in one request; at most {s.max_items}")
    fmt = doc.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise Failure(400, f'encoding_format must be "float" or "base64", got {fmt!r}')
    deepstack = doc.get("return_deepstack", False)
    if not isinstance(deepstack, bool):
        raise Failure(400, f"return_deepstack must be true or false, got {deepstack!r}")
    items, resized = zip(*(_item(i, x, s, bound) for i, x in enumerate(inputs)))
    return list(items), fmt, deepstack, sum(resized)


def _item(i: int, x, s: Settings, bound) -> tuple[Item, bool]:
    """One item, and whether the per-item bound resizes it down."""
    where = f"input[{i}]"
    if not isinstance(x, dict):
        raise Failure(400, f'{where}: an item is an object, {{"image": base64}} or {{"video": base64, "fps": F}}')
    kinds = [k for k in ("image", "video") if k in x]
    if len(kinds) != 1:
        raise Failure(400, f'{where}: give exactly one of "image" and "video"')
    kind = kinds[0]
    extra = set(x) - {kind, "fps"}
    if extra or ("fps" in x and kind != "video"):
        raise Failure(400, f"{where}: unknown fields {sorted(extra or {'fps'})} for an {kind} item")
    fps = x.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 120):
        raise Failure(400, f"{where}: fps must be a number in (0, 120], got {fps!r}")
    payload = _bytes(where, x[kind])
    resized = _check_image(where, payload, s, bound) if kind == "image" else False
    digest = hashlib.sha256(payload).hexdigest()
    return Item(kind, payload, digest, None if fps is None else float(fps)), resized


def _bytes(where: str, value) -> bytes:
    """base64 (standard alphabet; whitespace such as MIME's line breaks ignored) or a data: URL's
    base64 part -> bytes. Nothing else: a path or a URL is refused, never opened."""
    if not isinstance(value, str) or not value:
        raise Failure(400, f"{where}: the bytes must be a non-empty base64 string or a data: URL")
    if _SPACE.search(value):  # `base64` without -w0, Python's encodebytes: lines of 76
        value = _SPACE.sub("", value)
    if value.startswith("data:"):
        head, sep, value = value.partition(",")
        if not sep or not head.endswith(";base64"):
            raise Failure(400, f"{where}: a data: URL must be base64 (data:<type>;base64,...)")
    elif "://" in value[:16] or value.startswith(("/", "~", ".")) and not _looks_base64(value):
        raise Failure(400, f"{where}: only bytes are accepted (base64 or a data: URL); paths and URLs are not opened")
    try:
        payload = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise Failure(400, f"{where}: not valid base64 ({e})") from None
    if not payload:
        raise Failure(400, f"{where}: empty bytes")
    return payload


_SPACE = re.compile(r"[ \t\r\n]+")


def _looks_base64(value: str) -> bool:
    return len(value) % 4 == 0 and all(c.isalnum() or c in "+/=" for c in value[:64])


def _check_image(where: str, payload: bytes, s: Settings, bound) -> bool:
    """The image's size from its header (no decoding): 413 past max_image_pixels or (refused, not
    resized) past the per-item bound, 400 when PIL cannot read the header. Whether the bound resizes
    it down."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(payload)) as im:
            w, h = im.size
    except Image.DecompressionBombError as e:
        raise Failure(413, f"{where}: {e}") from None
    except Image.UnidentifiedImageError:  # its message is the stream's repr
        raise Failure(400, f"{where}: not an image PIL can read (an unknown format)") from None
    except Exception as e:  # noqa: BLE001 (whatever a garbled header makes PIL raise)
        raise Failure(400, f"{where}: not an image PIL can read ({type(e).__name__}: {e})") from None
    if w * h > s.max_image_pixels:
        raise Failure(413, f"{where}: the image is {w}x{h} = {w * h:,} pixels; at most {s.max_image_pixels:,}")
    try:
        over = bound.image_over(w, h)
    except ValueError as e:  # a size no resize rule takes (aspect ratio over 200)
        raise Failure(400, f"{where}: {e}") from None
    if over is not None:
        raise Failure(413, f"{where}: {over}")
    return bound.resized(w, h)


# ---- answers ----------------------------------------------------------------------------------
def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """The error answer; a 503 says when to retry."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 413: "request_too_large"}.get(status)
    kind = kind or {429: "rate_limit_error", 503: "unavailable", 504: "timeout"}.get(status, "server_error")
    if status == 503:
        headers = {"Retry-After": "1", **(headers or {})}
    body = {"error": {"message": _public(message), "type": kind, "code": status}}
    return JSONResponse(body, status, headers=headers)


# what a message from a library may carry that a stranger must not see
_REPR = re.compile(r"<[^<>\n]* at 0x[0-9a-fA-F]+>")  # <_io.BytesIO object at 0x7f...>
_PATH = re.compile(r"(?<![\w./~-])/(?:[^\s/'\"()<>,;]+/)+([^\s/'\"()<>,;]*)")  # /abs/dir/name -> name


def _public(message: str) -> str:
    """`message` without Python object reprs (-> "an object") and absolute paths (-> their last part)."""
    return _PATH.sub(lambda m: m[1] or "a folder", _REPR.sub("an object", message))


def _busy(e: Busy) -> JSONResponse:
    return _error(429, str(e), {"Retry-After": str(e.retry_after)})


def _encode_array(a, fmt: str):
    """float32 [tokens, D] -> itself (orjson writes it as nested float lists, each float32's shortest
    exact text), or base64 of its little-endian float32 bytes."""
    import numpy as np

    a = np.ascontiguousarray(a, "<f4")
    return base64.b64encode(a.tobytes()).decode() if fmt == "base64" else a


def _json(items: list[Item], results, fmt: str, deepstack: bool, ids: list[str] | None = None) -> bytes:
    import numpy as np

    data, tokens = [], 0
    for i, (item, (r, cached)) in enumerate(zip(items, results)):
        stamps = None if np.isnan(r.timestamps).all() else [float(t) for t in r.timestamps]
        row = {
            "object": "embedding",
            "index": i,
            "embedding": _encode_array(r.embedding, fmt),
            "shape": list(r.embedding.shape),
            "grid_thw": [int(v) for v in r.grid],
            "timestamps": stamps,
            "sha256": item.digest,
            "cached": cached,
        }
        if deepstack:
            row["deepstack"] = [_encode_array(f, fmt) for f in r.deepstack or []]
        if ids is not None:
            row["vllm_id"] = ids[i]
        data.append(row)
        tokens += len(r.embedding)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}  # OpenAI's names: embeddings have no completion
    return orjson.dumps({"object": "list", "data": data, "usage": usage}, option=orjson.OPT_SERIALIZE_NUMPY)


def checkpoint_name(checkpoint: str) -> str:
    """What an answer calls the checkpoint: a hub id as it is, a local path by its folder's name
    (never the server's path)."""
    if os.path.exists(checkpoint) or os.path.isabs(checkpoint):
        return os.path.basename(os.path.normpath(os.path.abspath(checkpoint)))
    return checkpoint


def _safetensors(items: list[Item], results, service: Service, ids: list[str] | None = None) -> bytes:
    """The answer as the embeddings file `qvj.read_embeddings` reads (written to a temporary file,
    then read back: write_embeddings writes files)."""
    import numpy as np

    from qwen_vit_jax.data.embeddings import Embeddings, run_metadata, write_embeddings

    lengths = [len(r.embedding) for r, _ in results]
    e = Embeddings(
        np.concatenate([r.embedding for r, _ in results]),
        np.stack([np.asarray(r.grid, np.int64) for r, _ in results]),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        [f"input {i}" for i in range(len(items))],
        run_metadata(
            checkpoint_name(service.settings.checkpoint),  # its folder's name, never the server's path
            service.enc.dtype,
            service.preprocessing,  # what made these (the per-item bound's)
            sha256=[it.digest for it in items],
            **({"vllm_id": ids} if ids is not None else {}),
        ),
        np.concatenate([np.asarray(r.timestamps, np.float64) for r, _ in results]),
    )
    with tempfile.TemporaryDirectory(prefix="qvj-serve-") as d:
        path = os.path.join(d, "answer.safetensors")
        write_embeddings(path, e)
        with open(path, "rb") as f:
            return f.read()
