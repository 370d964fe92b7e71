"""What a service's batch plans cost: the same images run as one batch plan (what `qwen-vit-jax
serve` runs), as one ladder plan (what `encode` runs on the same concatenation) and one call per
image, on one encoder, alternating, best of --repeats; and how many buckets random batches land in.

    python benchmarks/bench_batch_plans.py                 # the demo's tiny tower
    python benchmarks/bench_batch_plans.py --model 3b      # the real Qwen2.5-VL-3B tower (random weights)

Images: random uint8 pictures whose sizes cycle through bench_serve's SIDES (5 grids of 64..192
patches), prepared as `encode_images` prepares them; `--images K` per batch. Every program is
compiled before anything is timed. Buckets: 300 random batches of 2-32 of those sizes, planned as
batch plans and as ladder plans (no compile). Prints a markdown table and writes
benchmarks/results/batch_plans[-3b].json.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from bench_serve import SIDES, checkpoint_worker
from common import default_out, log, machine_line, markdown_table, run_worker, worker_main, write_json

HERE = pathlib.Path(__file__).resolve()


def timing_worker(p: dict) -> dict:
    import numpy as np

    from qwen_vit_jax import plan as planlib
    from qwen_vit_jax.preprocess.images import image_preprocessor
    from qwen_vit_jax.runtime.encoder import VisionEncoder

    ckpt = checkpoint_worker({"model": p["model"]})["path"]
    enc = VisionEncoder.from_pretrained(ckpt)
    prep = image_preprocessor(enc.cfg.variant)
    rng = np.random.default_rng(0)
    items = [
        prep([rng.integers(0, 256, (*SIDES[i % len(SIDES)], 3), dtype=np.uint8)], config=enc.preprocess, uint8=True)
        for i in range(p["images"])
    ]
    pixels = planlib.Patches.concatenate([x for x, _ in items])
    grid = np.concatenate([g for _, g in items])  # [k, 3]
    sides = {
        "batch plan": [enc.prepare(pixels, grid, batched=True)],
        "ladder plan": [enc.prepare(pixels, grid)],
        "one call per image": [enc.prepare(x, g) for x, g in items],
    }
    out = {"rows": int(grid.prod(axis=1).sum()), "counts": bucket_counts(enc.cfg)}
    for name, prepared in sides.items():
        for pr in prepared:
            for b in pr.buckets:
                enc.programs.get(b, pr.frames)
        out[name] = {"buckets": [[b.patches, b.key_rows, b.tiles] for pr in prepared for b in pr.buckets], "s": []}
    for _ in range(p["repeats"]):  # alternating
        for name, prepared in sides.items():
            t0 = time.perf_counter()
            for pr in prepared:
                enc.run(pr)
            out[name]["s"].append(time.perf_counter() - t0)
    return out


def bucket_counts(cfg) -> dict:
    """Buckets of 300 random batches of 2-32 images of SIDES' grids: batch plans vs ladder plans."""
    import numpy as np

    from qwen_vit_jax import plan as planlib

    grids = [(h // 14, w // 14) for h, w in SIDES]
    rng = np.random.default_rng(1)
    batch, ladder = set(), set()
    for _ in range(300):
        grid = [[1, *grids[i]] for i in rng.integers(0, len(grids), rng.integers(2, 33))]
        batch.add(planlib.make_batch_plan(grid, cfg).bucket)
        ladder |= {p.bucket for p in planlib.make_plans(grid, cfg)}
    return {"batch_plan_buckets": len(batch), "ladder_buckets": len(ladder)}


def distinct(buckets: list) -> str:
    """(rows, K, T) of each distinct bucket, with how many calls it takes when more than one."""
    counts = {tuple(b): buckets.count(b) for b in buckets}
    return ", ".join(f"{b}" + (f" x{n}" if n > 1 else "") for b, n in sorted(counts.items()))


def main():
    if worker_main({"timing": timing_worker}):
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "3b"), default="tiny")
    p.add_argument("--images", type=int, help="images per batch (default 32; 3b: 3)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    images = args.images or (3 if args.model == "3b" else 32)
    log(f"{args.model}: {images} images, {args.repeats} alternating repeats")
    r = run_worker(str(HERE), "timing", {"model": args.model, "images": images, "repeats": args.repeats})
    best = {k: min(v["s"]) for k, v in r.items() if isinstance(v, dict) and "s" in v}
    rows = [
        [k, f"{best[k] * 1e3 / images:.1f} ms", f"{best[k] / best['ladder plan']:.2f}x", distinct(r[k]["buckets"])]
        for k in best
    ]
    text = markdown_table(["side", "per image", "vs ladder plan", "buckets (rows, K, T)"], rows)
    c = r["counts"]
    text += f"\n\n300 random batches of 2-32 images: {c['batch_plan_buckets']} batch-plan buckets, "
    text += f"{c['ladder_buckets']} ladder buckets."
    cmd = "python benchmarks/bench_batch_plans.py " + " ".join(sys.argv[1:])
    print(f"\n{machine_line()}\n`{cmd}` ({images} images, {r['rows']} rows)\n\n{text}")
    write_json(
        args.out or default_out("batch_plans" + ("-3b" if args.model == "3b" else ""), False),
        {"command": cmd, "result": r},
    )


if __name__ == "__main__":
    main()
