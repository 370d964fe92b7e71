"""Test helpers on top of `qwen_vit_jax.hf_reference` (HF models from configs with random weights,
no hub access anywhere): random inputs, the docs/numerics.md bars as asserts, HF's gradients in our
layout."""

from __future__ import annotations

import os
import shutil

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


def rel(a, b) -> float:
    """Relative Frobenius error ||a - b|| / ||b||."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def flat_grads(tree) -> dict[str, np.ndarray]:
    """An nnx state (or gradient) tree as flat params: "blocks.attn.qkv.kernel" -> numpy."""
    from flax import nnx

    return {
        ".".join(map(str, k)): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
        for k, v in nnx.to_flat_state(tree)
    }


def hf_grads_through_converter(hf, tmp_path) -> dict[str, np.ndarray]:
    """HF's parameter gradients laid out as our params: written as a vision-only checkpoint and
    read back by the converter (its key table, transposes and stacking)."""
    from qwen_vit_jax.weights.hf_read import read_hf_vision_params
    from qwen_vit_jax.weights.safetensors_io import write_safetensors

    tensors = {name: p.grad.numpy() for name, p in hf.model.visual.named_parameters()}
    hf.config.to_json_file(tmp_path / "config.json")
    write_safetensors(tmp_path / "model.safetensors", tensors)
    return read_hf_vision_params(tmp_path)[1]


def assert_encode_images_equal_hf(encoder, hf, make_processor, images, features=None) -> None:
    """`encoder.encode_images(images)` against HF's image processor (`make_processor()`, built and run
    with HF's warnings silenced) and then `features(hf, pixel_values, grid_thw)` (default: HF's
    get_image_features): the tokens per image, then all of them at the float32 bar."""
    import warnings

    from qwen_vit_jax.tools.hf_reference import hf_image_features

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = make_processor()(images)
    px, grid = np.asarray(batch["pixel_values"]), np.asarray(batch["image_grid_thw"])
    ours = encoder.encode_images(images)
    assert [len(o) for o in ours] == [int(t * h * w) // 4 for t, h, w in grid]
    assert_fp32_close(np.concatenate(ours), (features or hf_image_features)(hf, px.reshape(len(px), -1), grid))


def assert_converted_equals_hf(hf, hf_dir, cfg, tmp_path) -> None:
    """`hf_dir` through our converter, encoded on one 8 x 12 image: HF's get_image_features of the
    model `hf` (loaded from hf_dir by HF) at the float32 bar."""
    import qwen_vit_jax as qvj
    from qwen_vit_jax.tools.hf_reference import hf_image_features

    qvj.convert_checkpoint(hf_dir, tmp_path / "ours")
    grid = np.array([[1, 8, 12]])
    px = random_pixels(cfg, grid, seed=2)
    tokens = qvj.VisionEncoder.from_pretrained(tmp_path / "ours").encode(px, grid)
    assert_fp32_close(tokens, hf_image_features(hf.eval(), px, grid))


COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the snapshot of make_hub_cache


def make_hub_cache(cache, snapshot_src, repo="Org/Tiny-VL", refs=("main",)):
    """`snapshot_src` as huggingface_hub caches it: blobs by hash, snapshot files symlinking to them."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (root / "blobs").mkdir()
    for i, f in enumerate(sorted(snapshot_src.iterdir())):
        blob = root / "blobs" / f"{i:040x}"
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (root / "refs").mkdir()
    for ref in refs:
        (root / "refs" / ref).write_text(COMMIT)
    return snap
