"""The encoder as a service (`qwen-vit-jax serve`), and its client. Read in this order:

  settings.py   Settings: one frozen object, every flag of `qwen-vit-jax serve`.
  prepare.py    the preparation worker pool: bytes -> an item's header and pieces in worker
                processes (encode's item path), a dead worker replaced and its item failed (503).
  cache.py      Result; the in-memory LRU and the CLI's content-hash cache on disk.
  batcher.py    dynamic batching: items of concurrent requests -> one encode call per batch.
  metrics.py    Prometheus metrics of one app.
  service.py    admission, lookups, in-flight dedup, cancellation: an item's way through.
  bounds.py     the per-item bound: the service's Preprocessing, what an item may cost.
  statuses.py   every failure kind -> its HTTP status, metric label and body (the one place).
  images.py     an image's format (the allow-list) and size from its header, never decoded.
  request.py    a request body -> its items, strictly (refused at the first wrong character).
  answers.py    the answer, streamed (JSON or the safetensors file).
  asgi.py       create_app(settings): the FastAPI app (routes, auth, a request's way).
  connections.py  uvicorn_config(app, settings): deadlines, bounded heads, the connection limits.
  client.py     Client(url, api_key=None).embed(images) -> Embeddings, retrying 429 / 503.
  cli.py        `qwen-vit-jax serve CKPT` flags and run.
  ray_app.py    app(checkpoint, ...): the same app as a Ray Serve application.

    import qwen_vit_jax as qvj
    settings = qvj.serve.Settings(checkpoint="ckpt")
    app = qvj.serve.create_app(settings)
    uvicorn.Server(qvj.serve.uvicorn_config(app, settings)).run()     # what `qwen-vit-jax serve` runs
    e = qvj.serve.Client("http://127.0.0.1:8000").embed([jpeg_bytes])  # an Embeddings

Names load on first use: importing this package costs nothing.
"""

import importlib

_EXPORTS = {
    "Settings": "settings",
    "create_app": "asgi",
    "uvicorn_config": "connections",
    "Client": "client",
    "ServeError": "client",
    "app": "ray_app",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qwen_vit_jax.serve' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"qwen_vit_jax.serve.{_EXPORTS[name]}"), name)
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
