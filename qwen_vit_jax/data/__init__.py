"""Inputs in, embeddings out: what `qwen-vit-jax encode` reads and writes, and the worker pipeline
that prepares the inputs (`qvj.data.load`). Read in this order:

  inputs.py        finding image and video files, decoding images (EXIF applied, as HF's
                   load_image), patch counts from headers.
  sources.py       datasets as records: files, folders, webdataset shards, parquet files, HF
                   datasets, globs; reading a record's bytes in a worker.
  items.py         one input, prepared: `Job` -> `prepare` -> `Item` (kind, sha256, grid,
                   timestamps, pieces: a long video's frame groups decoded as they are read); the
                   one item path of encode, serve and Ray.
  workers.py       worker processes: how many by default, the one start-up, `WorkerPool` (jobs
                   whose messages stream back in order; the service's pool, encode's video stream).
  pipeline.py      the Grain pipeline: read -> decode -> resize -> uint8 patches in worker
                   processes, in input order (`load`, `Loader`, `Item`); long videos streamed.
  stream.py        a progress bar; counts in words.
  embeddings.py    the embeddings file (safetensors / npz / parquet) and its sharded form (one per
                   process).
  parquet.py       the parquet form: its schema, written in parts as it goes, merged atomically.
  sinks.py         where the encode loop's rows go (held in memory, or parquet parts) and what a
                   file being resumed holds.
  cache.py         the content-hash cache (--cache DIR): entries keyed by checkpoint, dtype,
                   preprocessing and the bytes' sha256, checksummed.
  encode_files.py  the encode loop: pieces packed into calls, identical inputs encoded once, periodic
                   saves, resuming, skipping unreadable inputs, Ctrl-C and dead workers.
  ray_data.py      Ray Data's stages (`qvj.ray.preprocess`, `qvj.ray.Encoder`).

Names load on first use: importing this package costs nothing; `qvj.data.load` imports Grain.
"""

import importlib

_EXPORTS = {
    "load": "pipeline",
    "Loader": "pipeline",
    "Item": "pipeline",
    "WorkerError": "pipeline",
    "default_workers": "workers",
    "find_inputs": "inputs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qwen_vit_jax.data' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"qwen_vit_jax.data.{_EXPORTS[name]}"), name)
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
