"""encode_images / encode_video: preprocessing + batching around VisionEncoder.encode.

An image's embedding must not depend on what it was batched with or which bucket it landed in
(float32: within 1e-6 relative, docs/numerics.md)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from sample_images import make_image

from qwen_vit_jax import VisionEncoder, preprocess_images, preprocess_video
from qwen_vit_jax.preprocess.config import PreprocessConfig

# (height, width) in pixels: squares, odd sizes (resized to multiples of 28), a wide strip, one
# below min_pixels (scaled up). Patches: 64, 80, 256, 88, 16, 60.
SIZES = [(112, 112), (100, 150), (224, 224), (56, 300), (40, 40), (140, 84)]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def one_by_one(enc: VisionEncoder, images) -> list[np.ndarray]:
    return [enc.encode(*preprocess_images([im], config=enc.preprocess)) for im in images]


@pytest.fixture(scope="module")
def images():
    return [make_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]


@pytest.fixture(scope="module")
def reference(tiny_encoder, images):
    return one_by_one(tiny_encoder, images)


def test_encode_images_equals_per_image_encode(tiny_encoder, images, reference):
    out = tiny_encoder.encode_images(images)
    assert len(out) == len(images)
    for im, got, ref in zip(images, out, reference):
        _, grid = preprocess_images([im], config=tiny_encoder.preprocess)
        assert got.shape == (grid[0, 1] * grid[0, 2] // 4, tiny_encoder.cfg.out_dim)
        assert got.dtype == np.float32
        assert rel_err(got, ref) <= 1e-6


def test_batches_split_at_max_batch_patches(tiny_encoder, images, reference, monkeypatch):
    """Consecutive images share a call up to max_batch_patches; a larger image runs alone."""
    n = [len(preprocess_images([im], config=tiny_encoder.preprocess)[0]) for im in images]
    assert n == [64, 80, 256, 88, 16, 60]
    calls = []
    encode = tiny_encoder.encode
    monkeypatch.setattr(tiny_encoder, "encode", lambda pv, g: calls.append(len(pv)) or encode(pv, g))
    monkeypatch.setattr(tiny_encoder, "max_batch_patches", 160)
    out = tiny_encoder.encode_images(images)
    assert calls == [64 + 80, 256, 88 + 16, 60]
    for got, ref in zip(out, reference):
        assert rel_err(got, ref) <= 1e-6


def test_single_image_and_array_input(tiny_encoder, images, reference):
    (got,) = tiny_encoder.encode_images(images[0])
    assert rel_err(got, reference[0]) <= 1e-6
    (got,) = tiny_encoder.encode_images([np.asarray(images[0])])
    assert rel_err(got, reference[0]) <= 1e-6


def test_encode_video(tiny_encoder):
    """encode_video samples and sizes with the tower's video config (HF's video-processor defaults
    here: the checkpoint ships the hub's preprocessor_config.json only, as Qwen2.5-VL's do)."""
    vp = tiny_encoder.video_preprocess
    assert (vp.video_sampler, vp.min_pixels, vp.max_pixels) == ("qwen2.5-vl", 3136, 12845056)
    frames = [make_image(56, 84, seed=s) for s in range(3)]  # 3 frames -> t = 2 (last repeated)
    emb = tiny_encoder.encode_video(frames)
    pv, grid, ts = preprocess_video(frames, config=vp)
    assert grid.tolist() == [[2, 4, 6]] and ts is None  # no source_fps: no timestamps
    assert emb.shape == (2 * 4 * 6 // 4, tiny_encoder.cfg.out_dim)
    assert rel_err(emb, tiny_encoder.encode(pv, grid)) <= 1e-6
    emb2 = tiny_encoder.encode_video(frames * 2, source_fps=4.0, num_frames=3)  # 3 rounds half-even to 4
    pv, grid, ts = preprocess_video(frames * 2, config=vp, source_fps=4.0, num_frames=3)
    assert grid.tolist() == [[2, 4, 6]] and ts.tolist() == [0.0, 0.75]  # T / sampled fps (4 of 6 at 4 fps)
    assert rel_err(emb2, tiny_encoder.encode(pv, grid)) <= 1e-6


def test_checkpoint_preprocessor_config_sets_pixel_limits(tiny_dirs, tmp_path):
    """The demo checkpoint carries the hub's preprocessor_config.json through the converter; a
    converted directory's own file decides the pixel range; without one, HF's class defaults."""
    _, converted = tiny_dirs
    assert (converted / "preprocessor_config.json").is_file()
    enc = VisionEncoder.from_pretrained(converted)
    assert (enc.preprocess.min_pixels, enc.preprocess.max_pixels) == (3136, 12845056)

    small = tmp_path / "small"
    shutil.copytree(converted, small)
    pre = json.loads((small / "preprocessor_config.json").read_text())
    (small / "preprocessor_config.json").write_text(json.dumps(dict(pre, max_pixels=28 * 28 * 16)))
    enc = VisionEncoder.from_pretrained(small)
    assert enc.preprocess.max_pixels == 28 * 28 * 16
    (emb,) = enc.encode_images([make_image(448, 448)])  # 448x448 -> at most 16 merge units
    assert emb.shape == (16, enc.cfg.out_dim)

    (small / "preprocessor_config.json").unlink()
    assert VisionEncoder.from_pretrained(small).preprocess == PreprocessConfig()
