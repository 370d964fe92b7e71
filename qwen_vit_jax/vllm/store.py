"""vLLM's encoder-cache store, written by us: what vLLM's `ECExampleConnector` reads.

    STORE/<identifier>/encoder_cache.safetensors      one tensor, "ec_cache": [tokens, width]

A consumer (`ec_role` "ec_consumer", `shared_storage_path` STORE) checks for that file when it
schedules an item and loads it instead of running its own tower; `width` is what the language
model's splice reads: out_dim, and for Qwen3-VL / Qwen3.5 the deepstack features after it
(`vllm_layout`). The consumer creates the empty folder STORE/<identifier>/ itself for every item
it checks, so a writer never moves a folder into place: the file is written as a temporary beside
it and renamed over it (files.atomic_file). A reader sees the whole file or none; a consumer asked
for a missing or broken file stops its engine, so nothing here is ever half-written.

The safetensors header also records the item's grid_thw and timestamps (vLLM reads only the
tensor; `read_store` gives them back). The store has no eviction and no index: a folder per item,
kept until someone removes it; several hosts share one only through a shared file system.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

from qwen_vit_jax.errors import BadInput
from qwen_vit_jax.files import atomic_file
from qwen_vit_jax.vllm.ids import Ids

FILE, TENSOR = "encoder_cache.safetensors", "ec_cache"
DTYPES = ("float32", "bfloat16", "float16")


def store_path(store: str | os.PathLike, identifier: str) -> pathlib.Path:
    """STORE/<identifier>/encoder_cache.safetensors; an identifier that is not one plain folder name
    (a separator, "." or "..", empty) is refused: it would point outside the store."""
    if (
        not isinstance(identifier, str)
        or identifier in ("", ".", "..")
        or "/" in identifier
        or os.sep in identifier
        or (os.altsep and os.altsep in identifier)
        or "\0" in identifier
    ):
        raise BadInput(f"an identifier is one folder name, got {identifier!r}")
    return pathlib.Path(store) / identifier / FILE


def vllm_layout(embedding: np.ndarray, deepstack=None) -> np.ndarray:
    """One item's embedding as vLLM's Qwen models hold it: [tokens, out_dim], and for a deepstack
    tower (Qwen3-VL) [tokens, out_dim * (1 + layers)], the deepstack features concatenated after the
    tokens in cfg.deepstack_layers order (vLLM's Qwen3_VisionTransformer.forward returns
    torch.cat([merger, *deepstack mergers], dim=1); its language model splits them back)."""
    parts = [np.asarray(embedding, np.float32), *(np.asarray(f, np.float32) for f in deepstack or ())]
    shapes = {p.shape[0] for p in parts}
    if any(p.ndim != 2 for p in parts) or len(shapes) != 1:
        raise BadInput(f"embedding and deepstack features must be [tokens, D] each, got {[p.shape for p in parts]}")
    return np.ascontiguousarray(np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0])


def write_store(
    store: str | os.PathLike,
    identifier: str,
    embeddings,
    *,
    dtype: str = "float32",
    grid_thw=None,
    timestamps=None,
    durable: bool = True,
) -> pathlib.Path:
    """Write one item into `store` for vLLM's ECExampleConnector, atomically.

    Args:
      store: the consumer's `shared_storage_path` (created if missing).
      identifier: the item's identifier (`Ids`: its sha256, passed as `multi_modal_uuids`, or vLLM's
        own default identifier).
      embeddings: float [tokens, width]: `encode`'s rows for one item in vLLM's layout
        (`vllm_layout`: with the deepstack features for Qwen3-VL).
      dtype: the tensor's dtype in the file: "float32" (vLLM casts what it loads to the model's
        dtype when it splices), or the model's own ("bfloat16", "float16": half the bytes).
      grid_thw, timestamps: recorded in the header (read back by `read_store`).
      durable: fsync before the rename (a power cut then never leaves a torn file behind).

    Returns:
      the file's path.
    """
    if dtype not in DTYPES:
        raise BadInput(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    emb = np.asarray(embeddings)
    if emb.ndim != 2 or not np.issubdtype(emb.dtype, np.floating) and emb.dtype.name != "bfloat16":
        raise BadInput(f"embeddings must be a float [tokens, width] array, got {emb.dtype} {emb.shape}")
    if not np.isfinite(emb.astype(np.float32)).all():
        raise BadInput("embeddings hold NaN or Inf: a consumer would splice them into its prompt")
    path = store_path(store, identifier)
    path.parent.mkdir(parents=True, exist_ok=True)  # the consumer may have made it already: never replaced
    meta = {"format": "vllm_ec_cache", "producer": "qwen_vit_jax"}
    if grid_thw is not None:
        meta["grid_thw"] = json.dumps([int(v) for v in np.asarray(grid_thw).reshape(-1)])
    if timestamps is not None:
        ts = np.asarray(timestamps, np.float64).reshape(-1)
        meta["timestamps"] = json.dumps([None if np.isnan(t) else float(t) for t in ts])
    from safetensors.numpy import save_file

    with atomic_file(path, durable=durable) as tmp:
        save_file({TENSOR: np.ascontiguousarray(_cast(emb, dtype))}, str(tmp), metadata=meta)
    return path


def _cast(emb: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        return emb.astype(np.float32).astype(ml_dtypes.bfloat16)
    return emb.astype(dtype)


def read_store(store: str | os.PathLike, identifier: str) -> tuple[np.ndarray, dict]:
    """(the item's tensor as written, its header metadata: grid_thw / timestamps as lists when
    recorded). FileNotFoundError when the store has no such item."""
    from safetensors import safe_open

    path = store_path(store, identifier)
    with safe_open(str(path), framework="numpy") as f:
        meta = dict(f.metadata() or {})
        emb = f.get_tensor(TENSOR)
    for key in ("grid_thw", "timestamps"):
        if key in meta:
            meta[key] = json.loads(meta[key])
    return emb, meta


class StoreWriter:
    """The one writer of `encode --vllm-store` and `serve --vllm-store`: an item's identifier under
    `ids`, its embedding in vLLM's layout, the file in the store.

    deepstack: the tower's deepstack layer count (cfg.deepstack_layers): its features go into the
    file after the tokens, so a caller must compute them (`needs_deepstack`).
    """

    def __init__(self, store: str | os.PathLike, ids: Ids, deepstack: int = 0, dtype: str = "float32"):
        self.store, self.ids, self.dtype = pathlib.Path(store), ids, dtype
        self.needs_deepstack = deepstack > 0
        self.store.mkdir(parents=True, exist_ok=True)

    def put(self, kind: str, data: bytes | None, digest: str | None, embedding, deepstack=None, grid=None, ts=None):
        """Write one item; its identifier. `embedding` [tokens, out_dim] and, for a deepstack tower,
        `deepstack` (one [tokens, out_dim] array per layer), or `embedding` already in vLLM's layout
        with `deepstack` None."""
        ident = self.ids(kind, data, digest)
        write_store(
            self.store, ident, vllm_layout(embedding, deepstack), dtype=self.dtype, grid_thw=grid, timestamps=ts
        )
        return ident

    def put_results(self, items, results) -> list[str]:
        """The service's answer path: each (item, Result) written; the identifiers in order."""
        return [
            self.put(
                it.kind,
                it.payload,
                it.digest,
                r.embedding,
                r.deepstack if self.needs_deepstack else None,
                r.grid,
                r.timestamps,
            )
            for it, r in zip(items, results)
        ]
