"""Test helpers on top of `qwen_vit_jax.hf_reference` (HF models from configs with random weights,
no hub access anywhere): random inputs, tiny configs, and the docs/numerics.md bars as asserts."""

from __future__ import annotations

import dataclasses

import numpy as np

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.tools.hf_reference import (  # noqa: F401 (re-exported for the tests)
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


def check_image_features_real_size(cfg: VisionConfig, name: str, tmp_path) -> None:
    """A real-size tower whose HF reference is `get_image_features` (PaddleOCR-VL, GLM-4.1V): HF
    model with random weights saved to tmp_path / "hf", loaded from there directly (no converted
    copy: disk), one non-square 12 x 20 image (240 patches: CI time), fp32 and bf16 bars."""
    import time

    import qwen_vit_jax as qvj
    from qwen_vit_jax.tools.hf_reference import hf_image_features

    t0 = time.perf_counter()
    hf = build_hf_model(cfg, seed=7)
    hf.save_pretrained(tmp_path / "hf")
    g = np.array([[1, 12, 20]])
    px = random_pixels(cfg, g, seed=8)
    ref = hf_image_features(hf, px, g)
    del hf
    rel32, max32 = assert_fp32_close(qvj.VisionEncoder.from_pretrained(tmp_path / "hf").encode(px, g), ref)
    enc16 = qvj.VisionEncoder.from_pretrained(tmp_path / "hf", dtype="bfloat16")
    cos16, rel16 = assert_bf16_close(enc16.encode(px, g), ref)
    print(f"\n{name} real size fp32: rel {rel32:.3g}, max abs / max|ref| {max32:.3g}")
    print(f"{name} real size bf16: min cos {cos16:.5f}, rel {rel16:.3g}")
    print(f"{name} real-size test: {time.perf_counter() - t0:.1f} s")
