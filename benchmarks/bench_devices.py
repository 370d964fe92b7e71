"""Several devices: how evenly the host spreads frames (balance) and what D host devices deliver.

  balance     (host only, no device) devices.plan_steps on the seed cases with 2, 4 and 8
              devices and the Qwen2.5-VL-3B config: max / mean real patches per device (summed
              over the mesh steps),
              the best any split of whole frames could reach (`lower_bound`), and padded rows / real rows.
  throughput  one JAX process per device count D (XLA_FLAGS=--xla_force_host_platform_device_count=D)
              runs VisionEncoder(devices=jax.devices()) on a fixed batch (12 images and a video,
              about 12k patches); the device counts alternate over --rounds; reported: the median
              seconds per call and patches/s. Host devices share this machine's cores: what this
              measures is the mesh path's overhead (placement, the larger shared bucket, dispatch),
              not a speed-up; on separate accelerators the compute part divides by D.

    python benchmarks/bench_devices.py [--quick] [--devices 1,2,4] [--repeats N] [--rounds R] [--out PATH]

The throughput tower is the Qwen2.5-VL-3B tower cut to 2 blocks (one window, one full layer; full
width, so per-row costs are real) with zero weights (timing does not depend on them); --quick cuts
it to the 2-block, width-128 tower of common.model_config.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys

import common
import numpy as np

VARIANT = "qwen2.5-vl-3b"
DEVICE_COUNTS = (2, 4, 8)
TARGET = 1.10


def seed_cases() -> dict[str, list[list[int]]]:
    """bench_plan's seed cases plus a mixed batch of images and videos (seed 0)."""
    rng = np.random.default_rng(0)
    jitter = [[10, 36 + int(rng.choice([-2, 0, 2])), 36 + int(rng.choice([-2, 0, 2]))] for _ in range(10)]
    mixed = [[1, 2 * int(rng.integers(4, 33)), 2 * int(rng.integers(4, 33))] for _ in range(24)]
    return {
        "1x8x8": [[1, 8, 8]],
        "1x36x36": [[1, 36, 36]],
        "10x36x36": [[10, 36, 36]],
        "10 videos 10x36x36": [[10, 36, 36]] * 10,
        "10 videos 10x(36+-2)^2": jitter,
        "24 images 8..64 + 2 videos": [*mixed[:12], [4, 24, 32], *mixed[12:], [6, 16, 20]],
    }


def balance_table() -> list[dict]:
    from qwen_vit_jax.plan import BucketPolicy
    from qwen_vit_jax.presets import PRESETS
    from qwen_vit_jax.runtime import devices

    cfg, policy = PRESETS[VARIANT], BucketPolicy()
    rows = []
    for name, grid in seed_cases().items():
        g = np.array(grid)
        sizes = np.repeat(g[:, 1] * g[:, 2], g[:, 0])
        for d in DEVICE_COUNTS:
            steps = devices.plan_steps(g, cfg, policy, d)
            mean = sizes.sum() / d
            worst = max(np.sum([s.rows for s in steps], axis=0)) / mean  # real rows per device, all steps
            best = lower_bound(sizes, d) / mean
            padded = sum(d * s.plan.bucket.patches for s in steps) / sizes.sum()
            rows.append(
                {
                    "case": name,
                    "frames": len(sizes),
                    "devices": d,
                    "steps": len(steps),
                    "balance": float(worst),
                    "best": float(best),
                    "padded_over_real": float(padded),
                    "meets_target": bool(worst <= TARGET or worst <= best * 1.001),
                }
            )
    return rows


def lower_bound(sizes: np.ndarray, d: int) -> float:
    """Rows on the busiest of d devices that no split of whole frames can beat: the largest frame,
    the mean, and for each k, k + 1 of the k * d + 1 largest frames share a device."""
    p = np.sort(sizes)[::-1]
    bound = max(float(p[0]), p.sum() / d)
    k = 1
    while k * d + 1 <= len(p):
        n = k * d + 1
        bound = max(bound, float(p[n - k - 1 : n].sum()))
        k += 1
    return bound


def throughput_worker(p: dict) -> dict:
    import time

    import jax

    import qwen_vit_jax as qvj
    from qwen_vit_jax.presets import PRESETS
    from qwen_vit_jax.weights.keys import expected_param_shapes

    if p["quick"]:
        cfg = common.model_config(VARIANT, quick=True)
    else:
        cfg = dataclasses.replace(PRESETS[VARIANT], depth=2, fullatt_block_indexes=(1,))
    params = {k: np.zeros(s, np.float32) for k, s in expected_param_shapes(cfg).items()}
    devs = jax.devices()
    enc = qvj.VisionEncoder(cfg, params, devices=devs) if len(devs) > 1 else qvj.VisionEncoder(cfg, params)
    grid = np.array(p["grid"])
    px = np.random.default_rng(0).standard_normal((int(np.prod(grid, 1).sum()), cfg.patch_dim), np.float32)
    t0 = time.perf_counter()
    enc.encode(px, grid)
    first = time.perf_counter() - t0
    times = common.time_calls(enc.encode, p["repeats"], px, grid)
    return {
        "devices": len(devs),
        "first_call_s": first,
        "compile_s": sum(enc.compile_seconds.values()),
        "buckets": [b.patches for b in enc.compile_seconds],
        **common.summary(times),
        "patches": int(px.shape[0]),
        "patches_per_s": px.shape[0] / float(np.median(times)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the width-128 2-block tower, 2 repeats")
    ap.add_argument("--devices", default="1,2,4", help="host device counts for the throughput part")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per worker (default 3; quick 2)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds over the device counts (default 2)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    repeats = args.repeats or (2 if args.quick else 3)

    rows = balance_table()
    print(
        f"balance: max / mean real patches per device ({VARIANT} plan, default buckets); target <= {TARGET} "
        "where the frames allow ('best': a frame is never cut)"
    )
    print(
        common.markdown_table(
            ["case", "frames", "D", "steps", "max/mean", "best", "padded/real", "ok"],
            [
                [
                    r["case"],
                    r["frames"],
                    r["devices"],
                    r["steps"],
                    f"{r['balance']:.3f}",
                    f"{r['best']:.3f}",
                    f"{r['padded_over_real']:.2f}",
                    "yes" if r["meets_target"] else "NO",
                ]
                for r in rows
            ],
        )
    )

    grid = seed_cases()["24 images 8..64 + 2 videos"][:13]  # 12 images and a 4-frame video
    counts = [int(x) for x in args.devices.split(",")]
    runs: dict[int, list[dict]] = {d: [] for d in counts}
    for _ in range(args.rounds):  # device counts alternate: this VM's speed drifts over minutes
        for d in counts:
            env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={d}", JAX_PLATFORMS="cpu")
            runs[d].append(
                common.run_worker(
                    __file__, "throughput", {"grid": grid, "repeats": repeats, "quick": args.quick}, env=env
                )
            )
    table = []
    for d, rs in runs.items():
        times = [t for r in rs for t in r["times"]]
        table.append(
            {
                "devices": d,
                "median": float(np.median(times)),
                "min": min(times),
                "patches": rs[0]["patches"],
                "patches_per_s": rs[0]["patches"] / float(np.median(times)),
                "buckets": rs[0]["buckets"],
                "first_call_s": [r["first_call_s"] for r in rs],
                "runs": rs,
            }
        )
    base = table[0]["patches_per_s"]
    print(
        f"\nthroughput: {table[0]['patches']} patches per call (12 images + a 4-frame video), "
        f"{'quick tower' if args.quick else VARIANT + ' cut to 2 blocks'}, float32, {os.cpu_count()} cores, "
        f"median of {repeats} calls x {args.rounds} alternating rounds"
    )
    print(
        common.markdown_table(
            ["host devices", "median s", "min s", "patches/s (median)", "vs 1 device", "bucket rows", "first call s"],
            [
                [
                    r["devices"],
                    f"{r['median']:.3f}",
                    f"{r['min']:.3f}",
                    f"{r['patches_per_s']:,.0f}",
                    f"{r['patches_per_s'] / base:.2f}x",
                    "+".join(map(str, r["buckets"])),
                    "/".join(f"{x:.1f}" for x in r["first_call_s"]),
                ]
                for r in table
            ],
        )
    )
    out = args.out or common.default_out("bench_devices", args.quick)
    common.write_json(
        out,
        {
            "balance": rows,
            "throughput": table,
            "repeats": repeats,
            "rounds": args.rounds,
            "quick": args.quick,
            "load_average": os.getloadavg(),
        },
    )


if __name__ == "__main__":
    if not common.worker_main({"throughput": throughput_worker}):
        sys.path.insert(0, str(common.ROOT))
        main()
