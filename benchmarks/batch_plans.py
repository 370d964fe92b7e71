"""What a service's batch plans cost: the same images run as one batch plan (what `qwen-vit-jax
serve` runs), as one ladder plan (what `encode` runs on the same concatenation) and one call per
image, on one encoder, alternating, best of --repeats; and how many buckets random batches land in.

    python -m benchmarks batch_plans                 # the demo's tiny tower
    python -m benchmarks batch_plans --model 3b      # the real Qwen2.5-VL-3B tower: results/batch_plans-3b.json

Images: random uint8 pictures whose sizes cycle through workloads/grids.py's SERVE_SIDES (5 grids of
64..192 patches), prepared as `encode_images` prepares them; `--images K` per batch. Every program is
compiled before anything is timed. Buckets: 300 random batches of 2-32 of those sizes, planned as
batch plans and as ladder plans (no compile). --quick: 2 images, 30 random batches.
"""

from __future__ import annotations

import time

from benchmarks import common
from benchmarks.common import log, markdown_table
from benchmarks.workloads.grids import SERVE_SIDES as SIDES

DEFAULTS = {"repeats": (3, 1)}


def add_args(p) -> None:
    p.add_argument("--model", choices=("tiny", "3b"), default="tiny")
    p.add_argument("--images", type=int, help="images per batch (default 32; 3b: 3; --quick 2)")


def timing_worker(p: dict) -> dict:
    import numpy as np

    from qwen_vit_jax import plan as planlib
    from qwen_vit_jax.preprocess.images import image_preprocessor
    from qwen_vit_jax.runtime.encoder import VisionEncoder

    enc = VisionEncoder.from_pretrained(p["ckpt"])
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
    out = {"rows": int(grid.prod(axis=1).sum()), "counts": bucket_counts(enc.cfg, p["batches"])}
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


def bucket_counts(cfg, batches: int) -> dict:
    """Buckets of random batches of 2-32 images of SIDES' grids: batch plans vs ladder plans."""
    import numpy as np

    from qwen_vit_jax import plan as planlib

    grids = [(h // 14, w // 14) for h, w in SIDES]
    rng = np.random.default_rng(1)
    batch, ladder = set(), set()
    for _ in range(batches):
        grid = [[1, *grids[i]] for i in rng.integers(0, len(grids), rng.integers(2, 33))]
        batch.add(planlib.make_batch_plan(grid, cfg).bucket)
        ladder |= {p.bucket for p in planlib.make_plans(grid, cfg)}
    return {"batches": batches, "batch_plan_buckets": len(batch), "ladder_buckets": len(ladder)}


def distinct(buckets: list) -> str:
    """(rows, K, T) of each distinct bucket, with how many calls it takes when more than one."""
    counts = {tuple(b): buckets.count(b) for b in buckets}
    return ", ".join(f"{b}" + (f" x{n}" if n > 1 else "") for b, n in sorted(counts.items()))


def run(args) -> dict:
    if args.model == "3b":
        args.label = args.label or "3b"
    images = args.images or (2 if args.quick else 3 if args.model == "3b" else 32)
    log(f"{args.model}: {images} images, {args.repeats} alternating repeats")
    ckpt = common.run_worker("common", "demo", {"model": args.model})["path"]
    p = {"ckpt": ckpt, "images": images, "repeats": args.repeats, "batches": 30 if args.quick else 300}
    return {"model": args.model, "images": images} | common.run_worker(__name__, "timing", p)


def report(result: dict) -> str:
    r = result["data"]
    images = r["images"]
    best = {k: min(v["s"]) for k, v in r.items() if isinstance(v, dict) and "s" in v}
    rows = [
        [k, f"{best[k] * 1e3 / images:.1f} ms", f"**{best[k] / best['ladder plan']:.2f}x**", distinct(r[k]["buckets"])]
        for k in best
    ]
    c = r["counts"]
    return (
        f"The {r['model']} tower, {images} images ({r['rows']:,} rows) as one batch plan (what `serve` runs), one "
        "ladder plan (what `encode` runs on the same concatenation) and one call each, alternating, best of "
        f"{len(r['ladder plan']['s'])}; time per image:\n\n"
        + markdown_table(["side", "per image", "vs ladder plan", "buckets (rows, K, T)"], rows)
        + f"\n\n{c['batches']} random batches of 2-32 images of the 5 sizes: {c['batch_plan_buckets']} batch-plan "
        f"buckets, {c['ladder_buckets']} ladder buckets."
    )


WORKERS = {"timing": timing_worker}
