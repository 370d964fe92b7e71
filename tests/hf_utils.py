"""Test helpers on top of `qwen_vit_jax.hf_reference` (HF models from configs with random weights,
no hub access anywhere): random inputs, tiny configs, and the docs/numerics.md bars as asserts."""

from __future__ import annotations

import dataclasses

import numpy as np

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.hf_reference import (  # noqa: F401 (re-exported for the tests)
    BFLOAT16,
    FLOAT32,
    build_hf_model,
    compare,
    hf_vision_config,
    hf_visual,
    reinit_,
)


def random_pixels(cfg: VisionConfig, grid_thw, seed: int = 0) -> np.ndarray:
    """float32 [sum(t*h*w), patch_dim] standard normal rows."""
    n = int(np.prod(np.asarray(grid_thw), axis=1).sum())
    return np.random.default_rng(seed).standard_normal((n, cfg.patch_dim), dtype=np.float32)


def tiny(variant_cfg: VisionConfig, **kw) -> VisionConfig:
    return dataclasses.replace(variant_cfg, **kw)


def assert_fp32_close(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """The float32 bar (hf_reference.FLOAT32); returns (rel, max abs / max|ref|)."""
    assert np.isfinite(ours).all()
    m = compare(ours, ref)
    assert FLOAT32.passes(m), (
        f"rel {m['rel']:.3g}, max abs {m['max_abs']:.3g} (/max|ref| {m['max_rel']:.3g}); bar: {FLOAT32.describe()}"
    )
    return m["rel"], m["max_rel"]


def assert_bf16_close(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """The bfloat16 bar (hf_reference.BFLOAT16); returns (min cos, rel)."""
    m = compare(ours, ref)
    assert BFLOAT16.passes(m), f"min cos {m['min_cos']:.5f}, rel {m['rel']:.3g}; bar: {BFLOAT16.describe()}"
    return m["min_cos"], m["rel"]
