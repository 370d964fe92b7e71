"""The service's client: `Client(url, api_key=None).embed(images)` -> an `Embeddings`.

    client = qvj.serve.Client("http://127.0.0.1:8000")
    e = client.embed([open("cat.jpg", "rb").read(), pil_image, "clip.mp4"])
    e[0]                          # the first input's tokens [tokens, D]
    e, deepstack = client.embed(images, return_deepstack=True)   # Qwen3-VL: one [T, D] per layer

Inputs are sent as bytes (base64 in JSON, embeddings back as base64 little-endian float32): encoded
image or video files' bytes, local paths (read here, on the client: the server never opens a path;
a video by its suffix), PIL images and HxWx3 uint8 arrays (sent as PNG, lossless). A 429 (queue
full) or 503 (loading, a worker lost) is retried after the server's Retry-After, else with
exponential back-off, up to `retries` times, and so is a connection refused or lost before the
answer (an embeddings request is idempotent: the server's cache and in-flight dedup make a resend
cheap); a timeout is not retried. Other errors raise `ServeError` with the server's message
(naming the item).
"""

from __future__ import annotations

import base64
import io
import os
import time

import numpy as np

from qwen_vit_jax.data.embeddings import Embeddings
from qwen_vit_jax.serve.statuses import OK, RETRY

RETRY_STATUSES = RETRY  # queue full, not ready, a worker lost: the same request may succeed later
SHOWN_CHARS = 512  # of a body that is not the service's JSON error, in the ServeError


class ServeError(RuntimeError):
    """The service refused or failed a request: `status` and the server's message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


class Client:
    """A synchronous client of `qwen-vit-jax serve` (httpx).

    Args:
      url: the server's base URL, e.g. "http://127.0.0.1:8000".
      api_key: the bearer token (when the server has --api-key-file).
      timeout: seconds per HTTP request.
      retries: how many times a 429 / 503, or a connection refused or lost, is retried.
      backoff: the first wait in seconds when the server gives no Retry-After; doubled each time.
      transport: an httpx transport (tests: httpx.ASGITransport is async-only, so a real server).
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        timeout: float = 120.0,
        retries: int = 8,
        backoff: float = 0.25,
        transport=None,
    ):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport)
        self.retries, self.backoff = retries, backoff

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ready(self) -> bool:
        """Whether /readyz says ready."""
        import httpx

        try:
            return self._http.get("/readyz").status_code == OK
        except httpx.TransportError:
            return False

    def embed(self, inputs, *, fps: float | None = None, return_deepstack: bool = False):
        """Embed images and videos.

        Args:
          inputs: a list (or one) of: bytes of an image or video file, a path (read here), a PIL
            image or an HxWx3 uint8 array.
          fps: the sampling of the videos (None: the checkpoint's video config).
          return_deepstack: also return the deepstack features.
        Returns:
          Embeddings (names "input i", metadata "sha256": each input's bytes' sha256 and "cached":
          whether the server answered it without encoding); with return_deepstack, (Embeddings,
          [float32 [T, D] per deepstack layer, inputs concatenated]).
        """
        if not isinstance(inputs, (list, tuple)):
            inputs = [inputs]
        if not inputs:
            raise ValueError("embed: no inputs")
        items = [_item(x, i, fps) for i, x in enumerate(inputs)]
        body = {"input": items, "encoding_format": "base64", "return_deepstack": bool(return_deepstack)}
        data = self._post(body)["data"]
        embs = [_array(d["embedding"], d["shape"]) for d in data]
        lengths = [len(e) for e in embs]
        stamps = [
            np.asarray(d["timestamps"], np.float64)
            if d["timestamps"] is not None
            else np.full(d["grid_thw"][0], np.nan)
            for d in data
        ]
        e = Embeddings(
            np.concatenate(embs),
            np.array([d["grid_thw"] for d in data], np.int64).reshape(-1, 3),
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            [f"input {i}" for i in range(len(data))],
            {"sha256": [d["sha256"] for d in data], "cached": [d["cached"] for d in data]},
            np.concatenate(stamps),
        )
        if not return_deepstack:
            return e
        layers = len(data[0].get("deepstack") or [])
        shapes = [d["shape"] for d in data]
        features = [np.concatenate([_array(d["deepstack"][k], s) for d, s in zip(data, shapes)]) for k in range(layers)]
        return e, features

    def _post(self, body: dict) -> dict:
        import httpx

        wait = self.backoff
        for attempt in range(self.retries + 1):
            try:
                r = self._http.post("/v1/embeddings", json=body)
            except (httpx.NetworkError, httpx.RemoteProtocolError):  # refused, or lost before the answer
                if attempt == self.retries:
                    raise
                time.sleep(wait)
                wait *= 2
                continue
            if r.status_code == OK:
                return r.json()
            if r.status_code in RETRY_STATUSES and attempt < self.retries:
                after = r.headers.get("retry-after")
                time.sleep(float(after) if after and after.replace(".", "", 1).isdigit() else wait)
                wait *= 2
                continue
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:SHOWN_CHARS]
            raise ServeError(r.status_code, message)
        raise AssertionError("unreachable")


def _item(x, i: int, fps: float | None) -> dict:
    """One input as the request's item: {"image": base64} or {"video": base64(, "fps")}."""
    video = False
    if isinstance(x, (str, os.PathLike)):
        from qwen_vit_jax.data.inputs import is_video

        path = os.fspath(x)
        video = is_video(path)
        with open(path, "rb") as f:
            x = f.read()
    elif not isinstance(x, (bytes, bytearray, memoryview)):
        x = _png(x, i)
    item = {"video" if video else "image": base64.b64encode(bytes(x)).decode()}
    if video and fps is not None:
        item["fps"] = fps
    return item


def _png(image, i: int) -> bytes:
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"input {i}: an array must be HxWx3 uint8, got {image.dtype} {image.shape}")
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise ValueError(f"input {i}: expected bytes, a path, a PIL image or an HxWx3 uint8 array, got {type(image)}")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _array(text: str, shape) -> np.ndarray:
    """base64 little-endian float32 -> float32 [shape]."""
    return np.frombuffer(base64.b64decode(text), "<f4").reshape(shape).astype(np.float32)
