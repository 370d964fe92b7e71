"""Several devices: frames balanced over a mesh (devices.py) must give the single-device output.

The host routing (balance, shared bucket, gather) is tested here on the host; the mesh itself runs
in a child process with 4 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4 must
be set before jax starts, so not in this process): this file, run as a script, is that child.
float32 results must match one device within 1e-6 relative (docs/numerics.md: padding
invariance), for a mixed batch of images and videos with one frame larger than all others, for
fewer frames than devices, and for a request split into several rounds; bfloat16 must meet the
bf16 bars (cosine >= 0.999, relative error <= 2e-2) against one device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.runtime import devices as devlib
from qwen_vit_jax.tools.demo import TINY

# (name, grid_thw, max_patches of the policy): images and videos, [1, 40, 36] larger than any
# other frame; two frames on four devices; a request of several rounds (budget 256 rows / device).
CASES = [
    ("mixed", [[1, 16, 16], [3, 8, 12], [1, 40, 36], [1, 4, 6], [2, 10, 14], [1, 6, 6]], 16384),
    ("fewer frames than devices", [[1, 8, 8], [1, 12, 16]], 16384),
    ("rounds", [[4, 12, 16], [1, 20, 20], [3, 8, 8], [1, 16, 24]], 256),
]


def _fake_forward(pixels: np.ndarray, mu: int = 4) -> np.ndarray:
    """A stand-in for the tower that keeps the row structure: [..., N, P] -> [..., N / mu, P], the
    mean of each merge unit's rows. Routing errors (a frame in the wrong place) change it."""
    return pixels.reshape(*pixels.shape[:-2], pixels.shape[-2] // mu, mu, pixels.shape[-1]).mean(-2)


@pytest.mark.parametrize("name,grid,max_patches", CASES)
@pytest.mark.parametrize("n_devices", [2, 3, 4, 8])
def test_steps_route_every_frame_back(name, grid, max_patches, n_devices):
    """take -> (per-device rows) -> gather is the identity on the request, for any device count."""
    policy = planlib.BucketPolicy(max_patches=max_patches)
    g = np.array(grid)
    px = np.random.default_rng(0).standard_normal((int(np.prod(g, 1).sum()), 8)).astype(np.float32)
    steps = devlib.plan_steps(g, TINY, policy, n_devices)
    got = np.concatenate([_fake_forward(s.take(px, np.float32)).reshape(-1, 8)[s.gather] for s in steps])
    np.testing.assert_array_equal(got, _fake_forward(px))
    for s in steps:
        b = s.plan.bucket
        assert s.plan.pos_ids.shape == (n_devices, b.patches, 2)
        assert s.plan.tile_block.shape == (n_devices, b.tiles)
        assert s.plan.window_ids.shape == (n_devices, b.windows, b.window_rows)
        assert max(s.rows) <= b.patches and sum(s.rows) <= len(px)
        assert max(s.rows) <= max(max_patches, int((g[:, 1] * g[:, 2]).max()))  # the per-program budget
        # every device's real rows are its span: the plans say the same as the routing
        assert [int(n) for n in s.plan.span[:, 1]] == [r if r else 4 for r in s.rows]  # idle: placeholder
    if len(px) > n_devices * max_patches:
        assert len(steps) > 1  # the rounds path is exercised (case "rounds" below 8 devices)
    else:
        assert len(steps) == 1


def test_steps_with_tight_buckets():
    """BucketPolicy(tight=True): every device's shard is padded to the busiest one's tight size."""
    policy = planlib.BucketPolicy(tight=True)
    g = np.array(CASES[0][1])
    px = np.random.default_rng(0).standard_normal((int(np.prod(g, 1).sum()), 8)).astype(np.float32)
    (step,) = devlib.plan_steps(g, TINY, policy, 4)
    assert step.plan.bucket.patches == policy.padded_rows(max(step.rows)) < policy.rung(max(step.rows))
    got = _fake_forward(step.take(px, np.float32)).reshape(-1, 8)[step.gather]
    np.testing.assert_array_equal(got, _fake_forward(px))


def test_balance_largest_first():
    assert devlib.balance(np.array([5, 1, 9, 3, 3, 7]), 2) == [[2, 3, 4], [0, 1, 5]]  # 15 vs 13
    assert devlib.balance(np.array([4, 4, 4]), 4) == [[0], [1], [2], []]
    sizes = np.random.default_rng(1).integers(1, 100, 200)
    loads = [int(sizes[b].sum()) for b in devlib.balance(sizes, 8)]
    assert max(loads) / np.mean(loads) <= 1.02  # many small frames: near the mean
    assert max(loads) - min(loads) <= sizes.max()  # LPT: no bin exceeds another by more than an item


def test_rounds_pad_least():
    """100 frames of 1296 rows on 8 devices: one round would give the busiest device 13 frames
    (16848 rows, padded to 20480); two rounds of at most 7 frames pad to 2 x 10240 (as little as
    five rounds of 3 frames, 5 x 4096, in fewer steps), and carrying loads across rounds keeps the
    devices' totals within one frame of each other."""
    steps = devlib.plan_steps([[10, 36, 36]] * 10, TINY, planlib.BucketPolicy(), 8)
    assert [s.plan.bucket.patches for s in steps] == [10240] * 2
    totals = np.sum([s.rows for s in steps], axis=0)
    assert totals.max() - totals.min() <= 1296 and totals.sum() == 100 * 1296


def test_pad_plan_is_exact(tiny_encoder):
    """A plan grown to a larger bucket (window slots, tiles, key rows) gives the same tokens."""
    import jax

    grid = np.array([[1, 12, 16], [2, 8, 8]])
    plan = planlib.make_plan(grid, tiny_encoder.cfg, tiny_encoder.policy)
    b = plan.bucket
    assert b.key_rows < b.patches
    big = devlib.pad_plan(plan, dataclasses.replace(b, windows=b.windows + 3, tiles=b.tiles + 2, key_rows=b.patches))
    assert big.window_tokens.shape == (b.windows + 3, b.window_rows) and big.tile_block.shape == (b.tiles + 2,)
    px = np.random.default_rng(0).standard_normal((int(np.prod(grid, 1).sum()), TINY.patch_dim), np.float32)
    forward, state = jax.jit(tiny_encoder.programs.forward), tiny_encoder.programs.state
    ref, got = (np.asarray(p.unpad(forward(state, p.take(px), p)[0])) for p in (plan, big))  # tokens
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-6
    with pytest.raises(ValueError, match="cannot pad"):
        devlib.pad_plan(big, b)


def test_device_arguments(tiny_dirs):
    import jax

    from qwen_vit_jax.runtime.encoder import VisionEncoder

    with pytest.raises(ValueError, match="either device= or devices="):
        VisionEncoder.from_pretrained(tiny_dirs[1], device=jax.devices()[0], devices=jax.devices())
    with pytest.raises(ValueError, match="empty"):
        VisionEncoder.from_pretrained(tiny_dirs[1], devices=[])
    with pytest.raises(ValueError, match="twice"):
        VisionEncoder.from_pretrained(tiny_dirs[1], devices=[jax.devices()[0]] * 2)
    one = VisionEncoder.from_pretrained(tiny_dirs[1], devices=jax.devices()[:1])
    assert one.mesh.devices.size == 1 and one.device == jax.devices()[0]  # one device: a mesh of one


def test_four_host_devices_match_one(tiny_dirs):
    """The mesh path in a child process with 4 CPU devices vs 1 device (float32, 1e-6)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, __file__, str(tiny_dirs[1])], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4
    for name, r in report["cases"].items():
        assert r["rel"] <= 1e-6, (name, r)
        assert r["max_item_rel"] <= 1e-6, (name, r)
        assert r["programs"] == r["buckets"], (name, r)  # one compiled program per (bucket, mesh)
        assert r["recompiled"] == 0, (name, r)
    assert report["encode_images_rel"] <= 1e-6
    assert report["bf16"]["min_cos"] >= 0.999 and report["bf16"]["rel"] <= 2e-2, report["bf16"]
    assert report["cost"]["patches_ok"] and report["cost"]["padded_ok"] and report["cost"]["ratio"] > 1


def _child(ckpt: str) -> None:
    """Run in a process with 4 host devices: print one JSON line of errors vs one device."""
    import jax

    from qwen_vit_jax.runtime.encoder import VisionEncoder

    assert len(jax.devices()) == 4, jax.devices()
    out = {"devices": len(jax.devices()), "cases": {}}
    rng = np.random.default_rng(0)
    for name, grid, max_patches in CASES:
        policy = planlib.BucketPolicy(max_patches=max_patches)
        one = VisionEncoder.from_pretrained(ckpt, policy=policy)
        many = VisionEncoder.from_pretrained(ckpt, policy=policy, devices=jax.devices())
        g = np.array(grid)
        px = rng.standard_normal((int(np.prod(g, 1).sum()), one.cfg.patch_dim), np.float32)
        ref, got = one.encode(px, g), many.encode(px, g)
        count = many.compile_count
        again = many.encode(px, g)
        assert np.array_equal(again, got)
        cuts = np.cumsum(np.prod(g, 1) // one.cfg.merge_unit)[:-1]
        items = [
            float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(np.split(got, cuts), np.split(ref, cuts))
        ]
        out["cases"][name] = {
            "rel": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
            "max_item_rel": max(items),
            "programs": count,
            "buckets": len(set(many.prepare(px, g).buckets)),
            "recompiled": many.compile_count - count,
        }
        if name == "mixed":  # the cost report counts every device's copy of the step's bucket
            r = many.cost_report(g)
            out["cost"] = {
                "patches_ok": r["patches"] == len(px),
                "ratio": r["flops_ratio"],
                "padded_ok": r["padded_patches"] == 4 * sum(b["patches"] for b in r["buckets"]),
            }
    from sample_images import make_image

    from qwen_vit_jax import preprocess_images

    one = VisionEncoder.from_pretrained(ckpt)
    many = VisionEncoder.from_pretrained(ckpt, devices=jax.devices())
    images = [make_image(h, w, seed=i) for i, (h, w) in enumerate([(112, 112), (100, 150), (224, 224), (40, 40)])]
    ref = [one.encode(*preprocess_images([im], config=one.preprocess)) for im in images]
    got = many.encode_images(images)
    out["encode_images_rel"] = max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(got, ref))
    # bfloat16 goes through the same routing with bf16 host pixels: no exactness bar of its own
    # (other buckets sum in other orders), but far below what a routing or dtype slip would give.
    g = np.array(CASES[0][1])
    px = rng.standard_normal((int(np.prod(g, 1).sum()), one.cfg.patch_dim), np.float32)
    ref = VisionEncoder.from_pretrained(ckpt, dtype="bfloat16").encode(px, g)
    got = VisionEncoder.from_pretrained(ckpt, dtype="bfloat16", devices=jax.devices()).encode(px, g)
    cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
    out["bf16"] = {"rel": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)), "min_cos": float(cos.min())}
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sample_images' make_image
    _child(sys.argv[1])
