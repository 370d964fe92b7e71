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
in a request is opened or fetched. The body is read up to max_body_bytes, then parsed strictly
(request.py: images sized from their headers, formats from an allow-list); the answer is streamed
(answers.py). With an API key every route but the probes (/openapi.json and /metrics too) wants
`Authorization: Bearer KEY` (compared in constant time). Every failure is an `errors` kind, and
statuses.py alone chooses its status, metric label and body ({"error": {"message", "type",
"code"}}, the message naming the item, `input[i]: ...`, never a server path or a Python object's
repr). Connection deadlines and limits: connections.py.

The lifespan loads in a thread, so /healthz answers at once and /readyz tells when to send work;
on shutdown (uvicorn's own: SIGTERM stops accepting and waits for the requests in flight) it
encodes what is queued, then stops the device thread and the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from qwen_vit_jax import errors
from qwen_vit_jax.serve import answers, statuses
from qwen_vit_jax.serve.answers import SAFETENSORS, checkpoint_name
from qwen_vit_jax.serve.metrics import Metrics
from qwen_vit_jax.serve.request import parse
from qwen_vit_jax.serve.service import Service
from qwen_vit_jax.serve.settings import Settings

log = logging.getLogger("qwen_vit_jax.serve")
LOAD_FAILED = "loading the model failed (the server's log says why)"  # the error itself may name server paths


def create_app(settings: Settings, *, encoder=None) -> FastAPI:
    """The app for `settings`. `encoder`: an already loaded VisionEncoder to serve instead of loading
    settings.checkpoint (the Ray deployment's replicas, tests). A ValueError for a key file whose
    key is empty or not printable ASCII."""
    metrics = Metrics()
    service = Service(settings, metrics)
    key = settings.api_key()  # read now: a missing, empty or unusable key fails before serving

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

    def authorize(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # a header's text is its bytes as latin-1 (Starlette): those bytes are compared
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), key.encode("ascii")):
            return
        raise statuses.Unauthorized("a valid API key is required: Authorization: Bearer KEY")

    @app.get("/healthz")
    async def healthz():
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz():
        if service.ready:
            return {"ready": True}
        code, headers, _ = statuses.parts(errors.Unavailable("not ready"))
        body = {"ready": False, "error": LOAD_FAILED} if service.error else {"ready": False}
        return JSONResponse(body, code, headers=headers)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        try:
            authorize(request)
        except errors.Error as e:
            return error(e)
        return JSONResponse(app.openapi())

    @app.get("/metrics")
    async def prometheus(request: Request):
        try:
            authorize(request)
        except errors.Error as e:
            return error(e)
        return Response(metrics.render(), media_type=Metrics.CONTENT_TYPE)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        t0 = time.perf_counter()
        try:
            response = await _embeddings(request, service, settings, authorize)
        except errors.Error as e:
            response = error(e)
        metrics.requests.labels(str(response.status_code)).inc()
        metrics.request_seconds.observe(time.perf_counter() - t0)
        return response

    return app


def error(e: errors.Error) -> Response:
    """The answer to a failure: its status, headers and body as statuses.py chooses them."""
    code, headers, body = statuses.parts(e)
    return Response(body, code, headers=headers, media_type="application/json")


async def _embeddings(request: Request, service: Service, s: Settings, authorize) -> Response:
    """One request's way. Every failure raises its errors kind (the caller answers it); the items
    are counted here by outcome (qvj_items_total)."""
    m = service.metrics
    authorize(request)
    if not service.ready:
        raise errors.Unavailable(f"not ready: {LOAD_FAILED}" if service.error else "not ready: the model is loading")
    service.check_room()  # before reading the body: an overloaded server reads no more bodies
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > s.max_body_bytes:
        raise errors.TooLarge(
            f"the body has {int(length):,} bytes; at most {s.max_body_bytes:,}", limit="max_body_bytes"
        )
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > s.max_body_bytes:
                raise errors.TooLarge(f"the body is over {s.max_body_bytes:,} bytes", limit="max_body_bytes")
    except ClientDisconnect:  # gone while sending: nothing was admitted
        raise statuses.ClientGone("the client closed the connection") from None
    try:
        req = await asyncio.to_thread(parse, bytes(body), s, service.bound)
    except errors.Error as e:
        m.items.labels(statuses.label(e)).inc()
        raise
    del body
    safetensors = SAFETENSORS in request.headers.get("accept", "")
    if safetensors and req.deepstack:
        raise errors.BadInput("deepstack features come in JSON only; drop return_deepstack or the safetensors Accept")
    n = len(req.items)
    try:
        service.admit(n)
    except errors.Error as e:
        m.items.labels(statuses.label(e)).inc(n)
        raise
    try:
        work = asyncio.ensure_future(service.embed(req.items, req.deepstack))
        gone = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({work, gone}, timeout=s.request_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            e = (
                statuses.ClientGone("the client closed the connection")  # nobody to answer: its items withdrawn
                if gone in done
                else statuses.TimedOut(f"not answered within {s.request_timeout_s:g} s")
            )
            m.items.labels(statuses.label(e)).inc(n)
            raise e
        gone.cancel()
        try:
            results = work.result()
        except errors.Error as e:
            m.items.labels(statuses.label(e)).inc()
            raise
    finally:
        service.release(n)
    ids = None
    if service.vllm is not None:  # each item in vLLM's store before the answer says so
        try:
            ids = await asyncio.to_thread(service.vllm.put_results, req.items, [r for r, _ in results])
        except OSError as e:  # a full or read-only store: the server's fault, and no answer claims an item
            log.error("writing vLLM's store failed: %s", e)
            failed = errors.Internal("the embeddings could not be written to vLLM's store (logged by the server)")
            m.items.labels(statuses.label(failed)).inc(n)
            raise failed from None
    for _, cached in results:
        m.items.labels("cached" if cached else "ok").inc()
    m.resized.inc(req.resized)

    def responded(seconds: float) -> None:
        m.stage.labels("respond").observe(seconds)

    if safetensors:
        name = checkpoint_name(s.checkpoint)  # its folder's name, never the server's path
        f = await asyncio.to_thread(
            answers.safetensors_file, req.items, results, name, service.enc.dtype, service.preprocessing, ids
        )
        return StreamingResponse(answers.file_answer(f, responded), media_type=SAFETENSORS)
    stream = answers.json_answer(req.items, results, req.fmt, req.deepstack, responded, ids)
    return StreamingResponse(stream, media_type="application/json")


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the ASGI server's http.disconnect, after the body)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
