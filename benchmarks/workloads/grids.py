"""Grids (t, h, w in patches) and image sizes the suites share, each defined once."""

from __future__ import annotations

import numpy as np

# (h, w) px, multiples of 28: the service's JPEGs, grids of 64..192 patches (serve, serve_cold, batch_plans)
SERVE_SIDES = [(112, 112), (168, 224), (224, 224), (280, 196), (224, 336)]


def seed_cases(seed: int = 0) -> dict[str, list[list[int]]]:
    """The five seed cases of the host plans (from vLLM's profile): one small and one 36x36 image,
    a 10-frame video, ten of them, ten with sides jittered by +-2 (seed 0)."""
    rng = np.random.default_rng(seed)
    jitter = [[10, 36 + int(rng.choice([-2, 0, 2])), 36 + int(rng.choice([-2, 0, 2]))] for _ in range(10)]
    return {
        "1x8x8": [[1, 8, 8]],
        "1x36x36": [[1, 36, 36]],
        "10x36x36": [[10, 36, 36]],
        "10 videos 10x36x36": [[10, 36, 36]] * 10,
        "10 videos 10x(36+-2)^2": jitter,
    }


def cost_cases() -> dict[str, list[list[int]]]:
    """The padding cases: the multi-frame seed cases with tests/test_plan.py's jitter (seed 1), a
    128x128-patch image (the largest bucket) and a 36x36 one."""
    jitter = np.random.default_rng(1).integers(-1, 2, (10, 2))
    return {
        "[[10, 36, 36]]": [[10, 36, 36]],
        "ten [10, 36, 36]": [[10, 36, 36]] * 10,
        "ten [10, 36+-2, 36+-2]": [[10, 36 + 2 * int(a), 36 + 2 * int(b)] for a, b in jitter],
        "[[1, 128, 128]]": [[1, 128, 128]],
        "[[1, 36, 36]]": [[1, 36, 36]],
    }


def compile_stream(count: int = 30, seed: int = 0) -> list[list[int]]:
    """`count` single-image sizes (h, w), both even in [2, 64] (repeats allowed): the compile stream."""
    rng = np.random.default_rng(seed)
    return [[2 * int(rng.integers(1, 33)), 2 * int(rng.integers(1, 33))] for _ in range(count)]


def distinct_stream(n: int = 10, seed: int = 1, lo: int = 8, hi: int = 36) -> list[list[int]]:
    """`n` distinct sizes (h, w), both even in [lo, hi]: the peer's stream of images seen once."""
    rng = np.random.default_rng(seed)
    out: list[list[int]] = []
    while len(out) < n:
        hw = [int(x) for x in 2 * rng.integers(lo // 2, hi // 2 + 1, size=2)]
        if hw not in out:
            out.append(hw)
    return out
