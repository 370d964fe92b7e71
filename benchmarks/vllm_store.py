"""vLLM with its own tower vs vLLM reading our encoder-cache store: time to first token for a prompt
with one 1080p image, and our encoder's images/s feeding the store.

    python -m benchmarks vllm_store                             # Qwen2.5-VL-3B's tower, 3 rounds
    python -m benchmarks vllm_store --model tiny --rounds 2

The checkpoint: a Qwen2.5-VL whose vision tower is the real 3B one (669M parameters, random
weights) under a 2-layer language model of the 3B's width (benchmarks/workloads/vllm_cases.py writes
it, with the hub's pixel bound, so a 1920x1080 JPEG is not shrunk: 1092x1932, 2,691 tokens);
`--model tiny` the tests' tiny one. Both sides bfloat16 (--dtype).

  ours   (the project's venv) the encoder loaded and warmed on the 1080p grid, then --n distinct
         1080p JPEGs: decode + preprocess + encode + StoreWriter.put (sha256 ids), what `encode
         --vllm-store` does per image: images/s and the store's share of it.
  vllm   (the vLLM venv, benchmarks/workloads/vllm_env.py, built first if missing) one engine, an
         ECExampleConnector consumer of that store; per round two requests of fresh images, one per
         way, alternating: pixels with a uuid the store lacks (vLLM's tower encodes it) and pixels
         with the image's sha256 as uuid (vLLM loads our file; its log must say so). TTFT: the wall
         time of generate(max_tokens=1), the processor's resize of the pixels included (a consumer
         still runs it: the placeholders come from the grid).

--quick: the tiny model, one round, two 448x336 images; the vLLM side only where its venv is already built
(`make test` builds it), else ours alone.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import shutil
import statistics
import time

from benchmarks import common
from benchmarks.common import log, markdown_table

DEFAULTS = {"rounds": (3, 1)}
SIDE, QUICK_SIDE = (1920, 1080), (448, 336)  # (w, h): 1080p; --quick a size that needs no resize
# Qwen2.5-VL-3B's vision tower, and a language model of its width cut to 2 layers
TOWER_3B = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
    window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
)  # fmt: skip
TEXT_3B = dict(
    hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)  # fmt: skip
HUB_MAX_PIXELS = 12845056  # Qwen2.5-VL's hub preprocessor_config.json
PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the picture.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def add_args(p) -> None:
    p.add_argument("--model", choices=("3b", "tiny"), help="the vision tower (default 3b; --quick tiny)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--n", type=int, help="images our encoder writes into the store (default 8; --quick 2)")


def jpegs(n: int, seed: int, side: tuple[int, int]) -> list[bytes]:
    """n distinct JPEGs of `side` (gradients and noise: every one new to both sides' caches)."""
    import numpy as np
    from PIL import Image

    w, h = side
    y, x = np.mgrid[0:h, 0:w]
    out = []
    for i in range(n):
        rng = np.random.default_rng(seed + i)
        px = np.stack([(x * 255 // w + 17 * i) % 256, y * 255 // h, (x + y) * 127 // (w + h)], -1)
        px = np.clip(px + rng.integers(-30, 30, (h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


# ---- workers --------------------------------------------------------------------------------------
def checkpoint_worker(p: dict) -> dict:
    from benchmarks.workloads import vllm_cases

    out = common.cache() / "vllm" / f"ckpt-{p['model']}"
    if not (out / "config.json").exists():
        big = p["model"] == "3b"
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        vllm_cases.write_checkpoint(
            tmp,
            "qwen2_5_vl",
            text_over=TEXT_3B if big else None,
            vision_over=TOWER_3B if big else None,
            max_pixels=HUB_MAX_PIXELS,
        )
        tmp.replace(out)  # whole or absent: a run stopped while writing it builds it again
    return {"path": str(out)}


def ours_worker(p: dict) -> dict:
    """Our encoder feeding the store: --n images, each decoded, preprocessed, encoded and written."""
    import numpy as np

    from qwen_vit_jax.data.inputs import load_image
    from qwen_vit_jax.preprocess.images import preprocess_images
    from qwen_vit_jax.runtime.encoder import VisionEncoder
    from qwen_vit_jax.vllm.ids import Ids
    from qwen_vit_jax.vllm.store import StoreWriter

    enc = VisionEncoder.from_pretrained(p["ckpt"], dtype=p["dtype"])
    blobs = [pathlib.Path(f).read_bytes() for f in p["files"]]
    writer = StoreWriter(p["store"], Ids("sha256"))

    def one(data: bytes) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        px, grid = preprocess_images([load_image(data)], config=enc.preprocess, uint8=True)
        emb = enc.encode(px, grid)
        t1 = time.perf_counter()
        writer.put("image", data, hashlib.sha256(data).hexdigest(), emb, grid=grid[0], ts=[np.nan])
        return time.perf_counter() - t0, time.perf_counter() - t1, len(emb)

    t0 = time.perf_counter()
    tokens = one(blobs[0])[2]  # compiles the grid's program (the warm-up a server does before ready)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    times = [one(b) for b in blobs[1:]]
    wall = time.perf_counter() - t0
    first = writer.store / hashlib.sha256(blobs[0]).hexdigest() / "encoder_cache.safetensors"
    return {
        "warmup_s": warm,
        "images_per_s": len(times) / wall,
        "per_image_s": [t for t, _, _ in times],
        "store_write_s": [w for _, w, _ in times],
        "file_mb": os.path.getsize(first) / 2**20,
        "tokens": tokens,
    }


def vllm_worker(p: dict) -> dict:
    """One consumer engine (the vLLM venv); per round a fresh image each way, alternating."""
    import logging

    from PIL import Image
    from vllm import LLM, SamplingParams

    loaded: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Success load encoder cache for hash "):
                loaded.append(record.getMessage().split()[-1])

    t0 = time.perf_counter()
    llm = LLM(
        model=p["ckpt"],
        dtype=p["dtype"],
        enforce_eager=True,
        max_model_len=4096,
        max_num_seqs=1,
        max_num_batched_tokens=4096,
        limit_mm_per_prompt={"image": 1, "video": 0},
        seed=0,
        ec_transfer_config={
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"shared_storage_path": p["store"]},
        },
    )
    start = time.perf_counter() - t0
    logging.getLogger("vllm").addHandler(Seen())  # after the start: it configures vLLM's loggers anew
    sp = SamplingParams(temperature=0.0, max_tokens=1)

    def ttft(path: str, uuid: str) -> float:
        with Image.open(path) as im:
            image = im.convert("RGB")
        request = {"prompt": PROMPT, "multi_modal_data": {"image": image}, "multi_modal_uuids": {"image": [uuid]}}
        t = time.perf_counter()
        llm.generate([request], sp, use_tqdm=False)
        return time.perf_counter() - t

    ttft(p["warm"], "warm-up")  # the first request pays one-off costs (allocations, lazy imports)
    out = {"encodes": [], "store": [], "start_s": start}
    for i, (a, b) in enumerate(p["pairs"]):
        order = [("encodes", a, f"pixels-{i}"), ("store", b["file"], b["sha256"])]
        for way, path, uuid in order if i % 2 == 0 else order[::-1]:
            out[way].append(ttft(path, uuid))
    out["loaded"] = loaded
    return out


# ---- the parent -------------------------------------------------------------------------------------
def vllm_python(quick: bool) -> str | None:
    """The vLLM venv's python: built first for a full run; for --quick only if already built."""
    from benchmarks.workloads import vllm_env

    if quick and not vllm_env.stamp().exists():
        log("the vLLM venv is not built (benchmarks/workloads/vllm_env.py): ours alone")
        return None
    try:
        return str(vllm_env.ensure(log))
    except vllm_env.Unavailable as e:
        if quick:
            log(f"the vLLM venv cannot be built ({e}): ours alone")
            return None
        raise


def run(args) -> dict:
    model = args.model or ("tiny" if args.quick else "3b")
    n = args.n or (2 if args.quick else 8)
    python = vllm_python(args.quick)
    run_dir = common.cache() / "vllm" / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    (run_dir / "images").mkdir(parents=True)
    store = run_dir / "store"
    ckpt = common.run_worker(__name__, "checkpoint", {"model": model})["path"]
    # ours: a warm-up image then n timed; vLLM: `rounds` pairs (one encoded by its tower, one stored) + a warm-up
    files = []
    side = QUICK_SIDE if args.quick else SIDE
    for i, data in enumerate(jpegs(n + 1 + args.rounds + 1, seed=100, side=side)):
        files.append(run_dir / "images" / f"{i}.jpg")
        files[-1].write_bytes(data)
    ours_files, vllm_files = files[: n + 1], files[n + 1 :]
    ours = common.run_worker(
        __name__,
        "ours",
        {"ckpt": ckpt, "dtype": args.dtype, "files": [str(f) for f in ours_files], "store": str(store)},
    )
    log(f"ours: {ours['images_per_s']:.3f} images/s into the store (warm-up {ours['warmup_s']:.1f} s)")
    out = {
        "model": model,
        "dtype": args.dtype,
        "side": list(side),
        "tokens": ours["tokens"],
        "ours": ours,
        "vllm": None,
    }
    if python is None:
        return out
    from benchmarks.workloads import vllm_cases

    stored = [{"file": str(f), "sha256": hashlib.sha256(f.read_bytes()).hexdigest()} for f in ours_files[1:]]
    pairs = [(str(vllm_files[i]), stored[i % len(stored)]) for i in range(args.rounds)]
    payload = {"ckpt": ckpt, "dtype": args.dtype, "store": str(store), "warm": str(vllm_files[-1]), "pairs": pairs}
    theirs = common.run_worker(__name__, "vllm", payload, env=vllm_cases.engine_env(), python=python)
    expected = {b["sha256"] for _, b in pairs}
    if set(theirs["loaded"]) != expected:
        raise RuntimeError(f"vLLM loaded {sorted(theirs['loaded'])} from the store, not {sorted(expected)}")
    out["vllm"] = theirs
    return out


def report(result: dict) -> str:
    d = result["data"]
    ours, theirs = d["ours"], d["vllm"]

    def med(xs):
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    rows = []
    if theirs:
        rows += [
            ["vLLM encodes the image (its tower)", med(theirs["encodes"]), "", ""],
            ["vLLM reads our store", med(theirs["store"]), "", ""],
        ]
    rows.append([
        "ours: decode + preprocess + encode + write",
        "",
        f"{ours['images_per_s']:.3f}",
        f"{statistics.median(ours['store_write_s']) * 1000:.0f} ms, {ours['file_mb']:.1f} MB",
    ])  # fmt: skip
    w, h = d["side"]
    head = f"{w}x{h} image ({d['tokens']:,} tokens)"
    table = markdown_table([head, "TTFT s, median (range)", "images/s into the store", "store write, file"], rows)
    start = f", vLLM engine start {theirs['start_s']:.0f} s" if theirs else "; vLLM not run (its venv is not built)"
    return f"The {d['model']} tower, {d['dtype']}{start}; TTFT is `generate(max_tokens=1)`'s wall time.\n\n{table}"


WORKERS = {"checkpoint": checkpoint_worker, "ours": ours_worker, "vllm": vllm_worker}
