"""preprocess/resize.py: Pillow's resize, bit for bit, against the installed Pillow: both pass orders,
every filter it computes (the others handed to Pillow), upscales, thin and very tall images, HF's
smart_resize targets, views."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from sample_images import make_image

from qwen_vit_jax.preprocess import resize as R
from qwen_vit_jax.preprocess.images import smart_resize


def _pillow(a, height, width, resample):
    return np.asarray(Image.fromarray(a).resize((width, height), resample=resample))


def test_this_pillow_is_followed():
    assert R.agrees_with_pillow()  # else every resize would silently be Pillow's (a warning says so)


@pytest.mark.parametrize("resample", sorted(R.SUPPORT))
def test_random_sizes_equal_pillow(resample):
    rng = np.random.default_rng(resample)
    orders = set()
    for trial in range(150):
        H, W = (int(x) for x in rng.integers(1, 160, 2))
        h, w = (int(x) for x in rng.integers(1, 220, 2))
        if trial % 15 == 0:  # thin and very tall (Pillow 12.2's 100:1 rule)
            H, W = int(rng.integers(200, 900)), int(rng.integers(1, 4))
        a = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
        orders.add(R._VERTICAL_FIRST(H, W, h, w))
        np.testing.assert_array_equal(
            R.resize_rgb(a, h, w, resample), _pillow(a, h, w, resample), err_msg=f"{H, W, h, w}"
        )
    assert R._VERTICAL_FIRST(100, 100, 40, 100) and not R._VERTICAL_FIRST(100, 100, 100, 40)
    assert len(orders) == 2 or not R._VERTICAL_FIRST(1000, 5, 10, 5)  # both orders exercised (on a Pillow with both)


def test_hf_targets_on_a_photo():
    """smart_resize's targets (one side up, the other down; both down; a photo's real sizes)."""
    photo = np.asarray(make_image(600, 800, seed=1))
    for H, W in [(480, 640), (600, 800), (563, 1000), (90, 700), (1080, 1920)]:
        a = np.asarray(Image.fromarray(photo).resize((W, H), Image.BICUBIC))
        h, w = smart_resize(H, W, 28, 56 * 56, 1003520)
        np.testing.assert_array_equal(R.resize_rgb(a, h, w, Image.BICUBIC), _pillow(a, h, w, Image.BICUBIC))


def test_views_identity_and_handed_on_cases():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (40, 60, 4), dtype=np.uint8)
    rgb = a[:, ::-1, :3]  # a non-contiguous view
    np.testing.assert_array_equal(R.resize_rgb(rgb, 23, 71, 3), _pillow(np.ascontiguousarray(rgb), 23, 71, 3))
    same = R.resize_rgb(rgb, 40, 60, 3)
    np.testing.assert_array_equal(same, rgb)
    assert same.flags.c_contiguous and not np.shares_memory(same, a)
    for resample in (Image.NEAREST, Image.LANCZOS, Image.HAMMING):  # Pillow's own
        np.testing.assert_array_equal(
            R.resize_rgb(rgb, 17, 29, resample), _pillow(np.ascontiguousarray(rgb), 17, 29, resample)
        )
    grey = a[:, :, 0]
    np.testing.assert_array_equal(R.resize_rgb(grey, 17, 29, 3), _pillow(grey, 17, 29, 3))
