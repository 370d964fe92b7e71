"""The answer to POST /v1/embeddings, streamed: never built whole in memory.

    stream = json_answer(items, results, "float", deepstack=False)   # async iterator of bytes
    stream = safetensors_answer(items, results, service)              # the file read_embeddings reads

An answer of 64 large items is hundreds of MB of JSON text (a float32 is ~12 characters as text,
5.3 in base64, 4 in safetensors): built whole, each client that does not read it holds all of it.
Here the JSON is encoded a slab of rows at a time (`CHUNK` bytes of text at most; on a thread, so
the event loop keeps serving), and the safetensors file is written to a temporary file, unlinked at
once and streamed from it. Together with the protocol's write deadline (connections.py: a client
that leaves its answer unread for --header-timeout is cut off), what a client that does not read
holds is the embeddings (held until answered anyway) plus a chunk and the socket's buffer.

The JSON is the bytes `orjson.dumps` gives for the whole document: floats as float32's shortest
exact text, base64 of little-endian float32 (chunks of whole 3-byte groups concatenate exactly).
"""

from __future__ import annotations

import asyncio
import base64
import os
import tempfile
import time

import numpy as np
import orjson

CHUNK = 1 << 20  # bytes of answer text encoded and sent at a time
SAFETENSORS = "application/vnd.safetensors"


async def json_answer(items, results, fmt: str, deepstack: bool, on_done=None, vllm_ids=None):
    """The JSON answer: {"object": "list", "data": [{"object", "index", "embedding", "shape",
    "grid_thw", "timestamps", "sha256", "cached"(, "vllm_id")(, "deepstack")}], "usage": {...}}, in
    pieces. `on_done(seconds)`: called once the last piece is out. `vllm_ids`: each item's identifier
    in vLLM's store (--vllm-store)."""
    t0, tokens = time.perf_counter(), 0
    yield b'{"object":"list","data":['
    for i, (item, (r, cached)) in enumerate(zip(items, results)):
        stamps = None if np.isnan(r.timestamps).all() else [float(t) for t in r.timestamps]
        head = {
            "object": "embedding",
            "index": i,
            "shape": list(r.embedding.shape),
            "grid_thw": [int(v) for v in r.grid],
            "timestamps": stamps,
            "sha256": item.digest,
            "cached": cached,
        }
        if vllm_ids is not None:
            head["vllm_id"] = vllm_ids[i]
        yield (b"," if i else b"") + orjson.dumps(head)[:-1] + b',"embedding":'
        async for piece in _array(r.embedding, fmt):
            yield piece
        if deepstack:
            yield b',"deepstack":['
            for k, f in enumerate(r.deepstack or []):
                if k:
                    yield b","
                async for piece in _array(f, fmt):
                    yield piece
            yield b"]"
        yield b"}"
        tokens += len(r.embedding)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}  # OpenAI's names: embeddings have no completion
    yield b'],"usage":' + orjson.dumps(usage) + b"}"
    if on_done is not None:
        on_done(time.perf_counter() - t0)


async def _array(a, fmt: str):
    """float32 [tokens, D] as JSON: nested float lists, or a base64 string of its bytes."""
    a = np.ascontiguousarray(a, "<f4")
    if fmt == "base64":
        flat = memoryview(a).cast("B")
        step = max(CHUNK // 4 * 3, 3)  # whole 3-byte groups: the pieces' base64 concatenates exactly
        yield b'"'
        for j in range(0, len(flat), step):
            yield await asyncio.to_thread(base64.b64encode, flat[j : j + step])
        yield b'"'
        return
    rows = max(CHUNK // (16 * max(a.shape[1], 1)), 1)  # ~16 bytes of text per float at most
    yield b"["
    for j in range(0, len(a), rows):
        text = await asyncio.to_thread(orjson.dumps, a[j : j + rows], option=orjson.OPT_SERIALIZE_NUMPY)
        yield (b"," if j else b"") + text[1:-1]
    yield b"]"


def safetensors_file(items, results, checkpoint: str, dtype: str, preprocessing, vllm_ids=None):
    """The answer as the embeddings file `qvj.read_embeddings` reads, written to a temporary file
    that is unlinked at once: an open binary file to stream (closing it frees the disk)."""
    from qwen_vit_jax.data.embeddings import Embeddings, run_metadata, write_embeddings

    lengths = [len(r.embedding) for r, _ in results]
    e = Embeddings(
        np.concatenate([r.embedding for r, _ in results]),
        np.stack([np.asarray(r.grid, np.int64) for r, _ in results]),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        [f"input {i}" for i in range(len(items))],
        run_metadata(
            checkpoint,
            dtype,
            preprocessing,
            sha256=[it.digest for it in items],
            **({"vllm_id": vllm_ids} if vllm_ids is not None else {}),
        ),
        np.concatenate([np.asarray(r.timestamps, np.float64) for r, _ in results]),
    )
    with tempfile.TemporaryDirectory(prefix="qvj-serve-") as d:
        path = os.path.join(d, "answer.safetensors")
        write_embeddings(path, e)
        return open(path, "rb")  # noqa: SIM115 (the caller streams and closes it; its name is gone now)


async def file_answer(f, on_done=None):
    """An open file's bytes in CHUNK pieces; closed at the end (or when the client goes)."""
    t0 = time.perf_counter()
    try:
        while piece := await asyncio.to_thread(f.read, CHUNK):
            yield piece
    finally:
        f.close()
    if on_done is not None:
        on_done(time.perf_counter() - t0)


def checkpoint_name(checkpoint: str) -> str:
    """What an answer calls the checkpoint: a hub id as it is, a local path by its folder's name
    (never the server's path)."""
    if os.path.exists(checkpoint) or os.path.isabs(checkpoint):
        return os.path.basename(os.path.normpath(os.path.abspath(checkpoint)))
    return checkpoint
