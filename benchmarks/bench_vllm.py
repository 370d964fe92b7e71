"""vLLM with its own tower vs vLLM reading our encoder-cache store: time to first token for a prompt
with one 1080p image, and our encoder's images/s feeding the store.

    PYTHONPATH=. python benchmarks/bench_vllm.py                  # Qwen2.5-VL-3B's tower, 3 rounds
    PYTHONPATH=. python benchmarks/bench_vllm.py --model tiny --rounds 2

The checkpoint: a Qwen2.5-VL whose vision tower is the real 3B one (669M parameters, random
weights) under a 2-layer language model of the 3B's width (tests/vllm_cases.py writes it, with the
hub's pixel bound, so a 1920x1080 JPEG is not shrunk: 1092x1932, 2,691 tokens); `--model tiny` the
tests' tiny one. Both sides bfloat16 (--dtype).

  ours   (project venv) the encoder loaded and warmed on the 1080p grid, then --n distinct 1080p
         JPEGs: decode + preprocess + encode + StoreWriter.put (sha256 ids), what `encode
         --vllm-store` does per image: images/s and the store's share of it.
  vllm   (the vLLM venv, tests/vllm_env.py) one engine, an ECExampleConnector consumer of that store;
         per round two requests of fresh images, one per way, alternating: pixels with a uuid the
         store lacks (vLLM's tower encodes it) and pixels with the image's sha256 as uuid (vLLM
         loads our file; its log must say so). TTFT: the wall time of generate(max_tokens=1), the
         processor's resize of the pixels included (a consumer still runs it: the placeholders
         come from the grid).

Prints a markdown table (the CPU named) and writes benchmarks/results/quick/vllm[-tiny].json. A
plain script, not yet a suite of `python -m benchmarks` (its workers are this file run with
`--worker KIND JSON`, one of them in the vLLM venv): its numbers are in history.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import statistics
import sys
import time

from common import RESULTS, ROOT, log, machine, machine_line, markdown_table

RESULT_TAG = "RESULT "

WORK = pathlib.Path(os.environ.get("QVJ_BENCH_CACHE", pathlib.Path.home() / ".cache" / "qwen_vit_jax_bench")) / "vllm"
SIDE = (1920, 1080)
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


def jpegs(n: int, seed: int) -> list[bytes]:
    """n distinct 1920x1080 JPEGs (gradients and noise: every one new to both sides' caches)."""
    import numpy as np
    from PIL import Image

    w, h = SIDE
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
    sys.path.insert(0, str(ROOT))
    from tests import vllm_cases

    out = WORK / f"ckpt-{p['model']}"
    if not (out / "config.json").exists():
        big = p["model"] == "3b"
        vllm_cases.write_checkpoint(
            out,
            "qwen2_5_vl",
            text_over=TEXT_3B if big else None,
            vision_over=TOWER_3B if big else None,
            max_pixels=HUB_MAX_PIXELS,
        )
    return {"path": str(out)}


def ours_worker(p: dict) -> dict:
    """Our encoder feeding the store: --n images, each decoded, preprocessed, encoded and written."""
    import hashlib

    import numpy as np

    from qwen_vit_jax.data.inputs import load_image
    from qwen_vit_jax.preprocess.images import preprocess_images
    from qwen_vit_jax.runtime.encoder import VisionEncoder
    from qwen_vit_jax.vllm.ids import Ids
    from qwen_vit_jax.vllm.store import StoreWriter

    enc = VisionEncoder.from_pretrained(p["ckpt"], dtype=p["dtype"])
    blobs = [pathlib.Path(f).read_bytes() for f in p["files"]]
    writer = StoreWriter(p["store"], Ids("sha256"))

    def one(data: bytes) -> tuple[float, float]:
        t0 = time.perf_counter()
        px, grid = preprocess_images([load_image(data)], config=enc.preprocess, uint8=True)
        emb = enc.encode(px, grid)
        t1 = time.perf_counter()
        writer.put("image", data, hashlib.sha256(data).hexdigest(), emb, grid=grid[0], ts=[np.nan])
        return time.perf_counter() - t0, time.perf_counter() - t1

    t0 = time.perf_counter()
    one(blobs[0])  # compiles the 1080p grid's program (the warm-up a server does before ready)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    times = [one(b) for b in blobs]
    wall = time.perf_counter() - t0
    return {
        "warmup_s": warm,
        "images_per_s": len(blobs) / wall,
        "per_image_s": [t for t, _ in times],
        "store_write_s": [w for _, w in times],
        "file_mb": os.path.getsize(writer.store / hashlib.sha256(blobs[0]).hexdigest() / "encoder_cache.safetensors")
        / 2**20,
    }


def vllm_worker(p: dict) -> dict:
    """One consumer engine; per round a fresh image each way, alternating."""
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
    prompt = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the picture.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    def ttft(path: str, uuid: str) -> float:
        with Image.open(path) as im:
            image = im.convert("RGB")
        request = {"prompt": prompt, "multi_modal_data": {"image": image}, "multi_modal_uuids": {"image": [uuid]}}
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
def run_worker(kind: str, payload: dict, *, env: dict | None = None, python: str = sys.executable) -> dict:
    """This script run as `--worker KIND JSON` in a fresh process: the dict its RESULT line holds."""
    import subprocess

    t0 = time.perf_counter()
    p = subprocess.run([python, __file__, "--worker", kind, json.dumps(payload)], env=env, stdout=subprocess.PIPE,
                       text=True, cwd=ROOT, check=False)  # fmt: skip
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if p.returncode or not lines:
        sys.stderr.write(p.stdout[-4000:])
        raise RuntimeError(f"worker {kind} failed (exit {p.returncode})")
    log(f"worker {kind}: done in {time.perf_counter() - t0:.1f} s")
    return json.loads(lines[-1][len(RESULT_TAG) :])


def worker_main(handlers: dict) -> bool:
    if len(sys.argv) != 4 or sys.argv[1] != "--worker":
        return False
    print(RESULT_TAG + json.dumps(handlers[sys.argv[2]](json.loads(sys.argv[3]))), flush=True)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("3b", "tiny"), default="3b")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--rounds", type=int, default=3, help="TTFT pairs (default 3)")
    p.add_argument("--n", type=int, default=8, help="images our encoder writes into the store (default 8)")
    p.add_argument("--out")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests import vllm_env

    vllm_python = vllm_env.ensure(log)
    WORK.mkdir(parents=True, exist_ok=True)
    run = WORK / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    (run / "images").mkdir(parents=True)
    store = run / "store"
    ckpt = run_worker("checkpoint", {"model": args.model})["path"]
    n = max(args.n, args.rounds) + 1
    files = []
    for i, data in enumerate(jpegs(2 * n + args.rounds + 1, seed=100)):
        files.append(run / "images" / f"{i}.jpg")
        files[-1].write_bytes(data)
    ours_files, vllm_files = files[: n + 1], files[n + 1 :]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ours = run_worker("ours", {"ckpt": ckpt, "dtype": args.dtype, "files": [str(f) for f in ours_files],
                                         "store": str(store)}, env=env)  # fmt: skip
    log(f"ours: {ours['images_per_s']:.3f} images/s into the store (warm-up {ours['warmup_s']:.1f} s)")
    import hashlib

    stored = [{"file": str(f), "sha256": hashlib.sha256(f.read_bytes()).hexdigest()} for f in ours_files[1:]]
    pairs = [(str(vllm_files[i]), stored[i]) for i in range(args.rounds)]  # pixels for vLLM's tower, a stored image
    venv_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JAX_", "XLA_"))}
    venv_env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                    VLLM_LOGGING_LEVEL="DEBUG", HF_HUB_OFFLINE="1")  # fmt: skip
    payload = {"ckpt": ckpt, "dtype": args.dtype, "store": str(store), "warm": str(vllm_files[-1]), "pairs": pairs}
    theirs = run_worker("vllm", payload, env=venv_env, python=str(vllm_python))
    expected = [b["sha256"] for _, b in pairs]
    assert sorted(theirs["loaded"]) == sorted(expected), f"vLLM loaded {theirs['loaded']}, not {expected}"

    def med(xs):
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    rows = [
        ["vLLM encodes the image (its tower)", med(theirs["encodes"]), "", ""],
        ["vLLM reads our store", med(theirs["store"]), "", ""],
        ["ours: decode + preprocess + encode + write", "", f"{ours['images_per_s']:.3f}",
         f"{statistics.median(ours['store_write_s']) * 1000:.0f} ms, {ours['file_mb']:.1f} MB"],
    ]  # fmt: skip
    cmd = "python benchmarks/bench_vllm.py " + " ".join(sys.argv[1:])
    headers = ["1080p image (2,691 tokens)", "TTFT s, median (range)", "images/s into the store", "store write, file"]
    print(
        f"\n{machine_line()}\n`{cmd}`, {args.model} tower, {args.dtype}, vLLM engine start {theirs['start_s']:.0f} s\n"
    )
    print(markdown_table(headers, rows))
    out = pathlib.Path(args.out or RESULTS / "quick" / f"vllm{'-tiny' * (args.model == 'tiny')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "command": cmd, "ours": ours, "vllm": theirs}, indent=1) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    if not worker_main({"checkpoint": checkpoint_worker, "ours": ours_worker, "vllm": vllm_worker}):
        main()
