"""preprocess.py vs transformers' Qwen2VLImageProcessorPil (what `Qwen2VLImageProcessor` falls back to
without torchvision in transformers 5.x). Videos: HF's Qwen2VLVideoProcessor needs torchvision, so the
reference is HF's PIL image pipeline per frame (its own resize / rescale / normalize methods) followed
by a transcription of HF's video patchify (pad with the last frame, view + permute) in torch."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil
from transformers.image_utils import SizeDict
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_mod

from qwen_vit_jax.preprocess.config import VIDEO_DEFAULT, PreprocessConfig
from qwen_vit_jax.preprocess.images import preprocess_images, smart_resize
from qwen_vit_jax.preprocess.video import preprocess_video
from qwen_vit_jax.tools.demo import HUB_PREPROCESSOR_QWEN3

HUB_CONFIG = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
}


def rand_img(h, w, c=3, seed=0):
    shape = (h, w) if c is None else (h, w, c)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def hf_proc(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Qwen2VLImageProcessorPil(**kw)


def hf_run(proc, images):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(images, input_data_format="channels_last") if _is_array_input(images) else proc(images)
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def _is_array_input(images):
    first = images[0] if isinstance(images, list) else images
    return isinstance(first, np.ndarray)


def assert_same(ours, ref, atol=0.0):
    """Same grid; pixel_values within atol (0: HF's arithmetic is reproduced bit for bit)."""
    (pv, grid), (rpv, rgrid) = ours, ref
    assert grid.dtype == np.int64 and pv.dtype == np.float32 and pv.flags.c_contiguous
    np.testing.assert_array_equal(grid, rgrid)
    assert pv.shape == rpv.shape
    np.testing.assert_allclose(pv, rpv, rtol=0, atol=atol)


# ---- smart_resize ------------------------------------------------------------------------------------
def test_smart_resize_matches_hf():
    rng = np.random.default_rng(0)
    sizes = [
        (1, 1),
        (20, 30),
        (28, 28),
        (300, 450),
        (333, 517),
        (28, 5000),
        (5000, 28),
        (14, 14),
        (42, 42),
        (1000, 1000),
        (4000, 3000),
        (10, 2000),
        (1, 200),
    ]
    sizes += [tuple(int(v) for v in rng.integers(1, 4000, 2)) for _ in range(300)]
    ranges = [(3136, 1003520), (3136, 12845056), (100 * 784, 200 * 784), (784, 784)]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        for lo, hi in ranges:
            assert smart_resize(h, w, 28, lo, hi) == hf_mod.smart_resize(h, w, 28, lo, hi), (h, w, lo, hi)
        assert smart_resize(h, w, 32, 1024, 65536) == hf_mod.smart_resize(h, w, 32, 1024, 65536)


@pytest.mark.parametrize("h,w", [(1, 201), (10, 2100), (3000, 14)])
def test_smart_resize_aspect_ratio_raises_like_hf(h, w):
    with pytest.raises(ValueError, match="aspect ratio"):
        hf_mod.smart_resize(h, w)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(h, w)
    with pytest.raises(ValueError, match="aspect ratio"):
        preprocess_images(rand_img(h, w))


def test_smart_resize_bad_sides():
    for h, w in [(0, 5), (5, -1), (2.5, 3)]:
        with pytest.raises(ValueError):
            smart_resize(h, w)


# ---- images vs HF ------------------------------------------------------------------------------------
def test_300x450_shapes():
    pv, grid = preprocess_images(rand_img(300, 450))
    assert pv.shape == (704, 1176) and grid.tolist() == [[1, 22, 32]]


@pytest.mark.parametrize(
    "h,w", [(300, 450), (333, 517), (1, 1), (20, 30), (7, 13), (28, 5000), (5000, 28), (1000, 1000), (57, 1111)]
)
def test_image_matches_hf(h, w):
    img = rand_img(h, w, seed=h * 7 + w)
    ref = hf_run(hf_proc(), Image.fromarray(img))  # PIL into HF: no channel-order guessing for tiny arrays
    assert_same(preprocess_images(img), ref)
    assert_same(preprocess_images(Image.fromarray(img)), ref)


def test_image_bit_exact():
    img = rand_img(333, 517, seed=3)
    pv, _ = preprocess_images(img)
    rpv, _ = hf_run(hf_proc(), img)
    np.testing.assert_array_equal(pv, rpv)


@pytest.mark.parametrize("lo,hi", [(100 * 784, 200 * 784), (3136, 50000), (500000, 600000), (784, 784)])
def test_custom_pixel_range(lo, hi):
    img = rand_img(333, 517, seed=1)
    ref = hf_run(hf_proc(min_pixels=lo, max_pixels=hi), img)
    assert_same(preprocess_images(img, min_pixels=lo, max_pixels=hi), ref)
    cfg = PreprocessConfig(min_pixels=lo, max_pixels=hi)
    assert_same(preprocess_images(img, config=cfg), ref)
    # arguments override the config
    assert_same(preprocess_images(img, lo, hi, config=PreprocessConfig(max_pixels=hi * 4)), ref)


def test_several_images_one_call():
    imgs = [rand_img(300, 450, seed=1), rand_img(64, 900, seed=2), rand_img(500, 120, seed=3)]
    pv, grid = preprocess_images(imgs)
    rpv, rgrid = hf_run(hf_proc(), imgs)
    assert_same((pv, grid), (rpv, rgrid))
    assert grid.shape == (3, 3) and pv.shape[0] == int(grid.prod(1).sum())
    pv4, grid4 = preprocess_images(np.stack([imgs[0]] * 2))  # [N, H, W, C] array = a batch
    assert grid4.tolist() == [[1, 22, 32]] * 2
    np.testing.assert_array_equal(pv4, np.concatenate([pv[:704]] * 2))


def test_rows_are_merge_unit_major_and_repeated_over_t():
    img = rand_img(56, 84, seed=4)  # 4 x 6 patches, 2 x 3 merge units
    pv, grid = preprocess_images(img, min_pixels=56 * 84, max_pixels=56 * 84)
    assert grid.tolist() == [[1, 4, 6]]
    x = pv.reshape(2, 3, 2, 2, 3, 2, 14, 14)  # (bh, bw, mh, mw, C, T, ph, pw)
    np.testing.assert_array_equal(x[..., 0, :, :], x[..., 1, :, :])
    mean = np.float32([0.48145466, 0.4578275, 0.40821073])
    std = np.float32([0.26862954, 0.26130258, 0.27577711])
    byte = np.round((x[:, :, :, :, :, 0] * std[:, None, None] + mean[:, None, None]) * 255)
    # patch (row 1, col 3) = block (0, 1), in-block (1, 1); pixel (ph, pw) = image (14 + ph, 42 + pw)
    np.testing.assert_array_equal(byte[0, 1, 1, 1].transpose(1, 2, 0), img[14:28, 42:56])


def test_numpy_dtypes():
    img = rand_img(120, 90, seed=5)
    ref = preprocess_images(img)
    for a in (img.astype(np.int64), img.astype(np.float32), img.astype(np.float64)):
        assert_same(preprocess_images(a), ref, atol=0)


# ---- colour modes vs HF ------------------------------------------------------------------------------
def _pil_modes():
    rgb = Image.fromarray(rand_img(150, 230, seed=6))
    rgba = Image.fromarray(rand_img(150, 230, 4, seed=7), "RGBA")
    pal = rgb.quantize(64)
    pal_t = pal.copy()
    pal_t.info["transparency"] = 5
    la = Image.fromarray(rand_img(150, 230, 2, seed=8), "LA")
    return {
        "L": rgb.convert("L"),
        "RGBA": rgba,
        "P": pal,
        "P+transparency": pal_t,
        "LA": la,
        "CMYK": rgb.convert("CMYK"),
        "1": rgb.convert("1"),
        "I": rgb.convert("I"),
    }


@pytest.mark.parametrize("mode", list(_pil_modes()))
def test_pil_modes_match_hf(mode):
    img = _pil_modes()[mode]
    assert_same(preprocess_images(img), hf_run(hf_proc(), img))


@pytest.mark.parametrize("c", [1, 4])
def test_array_channels_match_hf(c):
    img = rand_img(150, 230, c, seed=9 + c)
    if c == 4:
        img[:10, :, 3] = 0  # fully transparent -> white
        img[10:20, :, 3] = 255
    assert_same(preprocess_images(img), hf_run(hf_proc(), img))


def test_grey_2d_array_is_hxwx1():
    img = rand_img(150, 230, None, seed=11)
    ref = hf_run(hf_proc(), img[:, :, None])  # HF rejects 2-D arrays; HxWx1 is the same image
    assert_same(preprocess_images(img), ref)
    assert_same(preprocess_images(Image.fromarray(img)), ref)


# ---- config ------------------------------------------------------------------------------------------
def test_defaults_match_hf():
    hf = hf_proc().to_dict()
    d = PreprocessConfig().to_dict()
    assert (d["min_pixels"], d["max_pixels"]) == (hf["size"]["shortest_edge"], hf["size"]["longest_edge"])
    assert d["max_pixels"] == 1003520
    for k in (
        "patch_size",
        "temporal_patch_size",
        "merge_size",
        "rescale_factor",
        "resample",
        "do_resize",
        "do_rescale",
        "do_normalize",
        "do_convert_rgb",
    ):
        assert d[k] == hf[k], k
    assert tuple(d["image_mean"]) == tuple(hf["image_mean"])
    assert tuple(d["image_std"]) == tuple(hf["image_std"])


def test_from_hf_hub_config(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(HUB_CONFIG))
    cfg = PreprocessConfig.from_hf(tmp_path)
    assert (
        cfg == PreprocessConfig.from_hf(tmp_path / "preprocessor_config.json") == PreprocessConfig.from_hf(HUB_CONFIG)
    )
    assert (cfg.min_pixels, cfg.max_pixels) == (3136, 12845056)
    hf = Qwen2VLImageProcessorPil.from_dict(HUB_CONFIG)
    img = rand_img(1100, 1300, seed=12)  # above the class default max_pixels, below the hub's
    ours = preprocess_images(img, config=cfg)
    assert_same(ours, hf_run(hf, img))
    assert ours[1].tolist() == [[1, 78, 92]]
    assert preprocess_images(img)[1].tolist() != ours[1].tolist()


def test_from_hf_size_dict_and_roundtrip():
    d = {"size": {"shortest_edge": 50000, "longest_edge": 300000}, "do_normalize": False, "junk": 1, "image_mean": None}
    cfg = PreprocessConfig.from_hf(d)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.do_normalize) == (50000, 300000, False)
    assert PreprocessConfig.from_hf(dict(d, min_pixels=4000)).min_pixels == 4000  # top level wins, as in HF
    assert PreprocessConfig.from_hf(cfg.to_dict()) == cfg
    img = rand_img(333, 517, seed=13)
    hf = Qwen2VLImageProcessorPil.from_dict(cfg.to_dict())
    assert_same(preprocess_images(img, config=cfg), hf_run(hf, img))


@pytest.mark.parametrize(
    "kw",
    [
        dict(do_rescale=False),
        dict(do_normalize=False),
        dict(do_rescale=False, do_normalize=False),
        dict(patch_size=16, merge_size=2, temporal_patch_size=1),
        dict(merge_size=1, temporal_patch_size=3),
        dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.25, 0.5, 2.0], rescale_factor=0.01),
    ],
)
def test_other_settings_match_hf(kw):
    img = rand_img(203, 311, seed=14)
    ours = preprocess_images(img, config=PreprocessConfig.from_hf(kw))
    assert_same(ours, hf_run(hf_proc(**kw), img))


def test_no_resize():
    img = rand_img(56, 112, seed=15)
    assert_same(preprocess_images(img, config=PreprocessConfig(do_resize=False)), hf_run(hf_proc(do_resize=False), img))
    with pytest.raises(ValueError, match="multiples of 28"):
        preprocess_images(rand_img(50, 112), config=PreprocessConfig(do_resize=False))


@pytest.mark.parametrize(
    "bad",
    [
        {"patch_size": 0},
        {"merge_size": "2"},
        {"image_mean": [0.5, 0.5]},
        {"image_std": [1, 0, 1]},
        {"do_resize": "yes"},
        {"min_pixels": 5000, "max_pixels": 4000},
        {"size": 5},
        {"rescale_factor": -1},
        {"resample": 9},
        {"max_pixels": 1.5e6},
    ],
)
def test_from_hf_bad_values(bad):
    with pytest.raises(ValueError):
        PreprocessConfig.from_hf(bad)


def test_from_hf_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        PreprocessConfig.from_hf(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        PreprocessConfig.from_hf(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{nope")
    with pytest.raises(ValueError, match="JSON"):
        PreprocessConfig.from_hf(tmp_path)


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "images,err,match",
    [
        ([], ValueError, "empty"),
        (np.zeros((10, 10, 2), np.uint8), ValueError, "channels-last"),
        (np.zeros((3, 100, 120), np.uint8), ValueError, "channels-last"),
        (np.zeros((2, 2, 10, 10, 3), np.uint8), ValueError, "shape"),
        (np.zeros((0, 10, 3), np.uint8), ValueError, "empty"),
        (np.full((10, 10, 3), 0.5), ValueError, r"\[0, 1\]"),
        (np.full((10, 10, 3), 300), ValueError, "255"),
        (np.zeros((10, 10, 3), bool), TypeError, "dtype"),
        ("cat.png", TypeError, "str"),
        ([np.zeros((10, 10, 3), np.uint8), 5], TypeError, "image 1"),
    ],
)
def test_bad_images(images, err, match):
    with pytest.raises(err, match=match):
        preprocess_images(images)


def test_no_convert_rgb_needs_rgb():
    cfg = PreprocessConfig(do_convert_rgb=False)
    img = rand_img(60, 80, seed=16)
    assert_same(preprocess_images(img, config=cfg), hf_run(hf_proc(do_convert_rgb=False), img))
    with pytest.raises(ValueError, match="do_convert_rgb"):
        preprocess_images(Image.fromarray(img).convert("L"), config=cfg)


# ---- video (decoded frames; files, sampling and HF's video processors: test_video.py) -------------------
IMAGE_DEFAULTS = PreprocessConfig()  # the image processor's pixel range, not the video processor's


def hf_video_reference(frames, lo=3136, hi=1003520, T=2, p=14, m=2):
    """HF's PIL image pipeline per frame, then HF's Qwen2VLVideoProcessor.patchify transcribed in torch."""
    proc = hf_proc(min_pixels=lo, max_pixels=hi)
    size = SizeDict(shortest_edge=lo, longest_edge=hi)
    chw = []
    for f in frames:
        x = proc.process_image(f, do_convert_rgb=True)
        x = proc.resize(x, size=size, resample=proc.resample, factor=p * m)
        chw.append(proc.normalize(proc.rescale(x, proc.rescale_factor), proc.image_mean, proc.image_std))
    videos = torch.from_numpy(np.stack(chw))[None]  # (B, F, C, H, W)
    b, nf, c, h, w = videos.shape
    if pad := -nf % T:
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
        nf += pad
    gt, gh, gw = nf // T, h // p, w // p
    patches = videos.view(b, gt, T, c, gh // m, m, p, gw // m, m, p).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(gt * gh * gw, c * T * p * p).numpy(), np.array([[gt, gh, gw]])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_video_matches_hf_layout(n):
    frames = [rand_img(150, 230, seed=20 + i) for i in range(n)]
    pv, grid, ts = preprocess_video(frames, config=IMAGE_DEFAULTS)
    assert grid.tolist() == [[(n + 1) // 2, 10, 16]] and ts is None
    assert_same((pv, grid), hf_video_reference(frames))
    assert_same(preprocess_video(np.stack(frames), config=IMAGE_DEFAULTS)[:2], (pv, grid), atol=0)
    # the image path on each frame gives the same patches (T slice 0)
    per_frame = [preprocess_images(f)[0].reshape(-1, 3, 2, 196)[:, :, 0] for f in frames + frames[-1:]]
    x = pv.reshape(grid[0, 0], -1, 3, 2, 196)
    for i in range(n + n % 2):
        np.testing.assert_array_equal(x[i // 2, :, :, i % 2], per_frame[min(i, n - 1)])


def test_video_two_equal_frames_is_the_image():
    img = rand_img(333, 517, seed=30)
    assert_same(
        preprocess_video([img, Image.fromarray(img)], config=IMAGE_DEFAULTS)[:2], preprocess_images(img), atol=0
    )


def test_video_pixel_range_and_modes():
    frames = [Image.fromarray(rand_img(360, 640, seed=40 + i)).convert("L") for i in range(3)]
    lo, hi = 128 * 28 * 28, 768 * 28 * 28  # HF's video-processor class defaults
    pv, grid, _ = preprocess_video(frames, config=VIDEO_DEFAULT)
    assert_same((pv, grid), hf_video_reference(frames, lo, hi))
    half = preprocess_video(frames, lo // 2, hi // 2, config=VIDEO_DEFAULT)[:2]
    assert_same(half, hf_video_reference(frames, lo // 2, hi // 2))


def test_video_bad_input():
    with pytest.raises(ValueError, match="no frames"):
        preprocess_video([])
    with pytest.raises(ValueError, match="one size"):
        preprocess_video([rand_img(100, 100), rand_img(100, 101)])
    with pytest.raises(ValueError, match=r"\[F, H, W, C\]"):
        preprocess_video(rand_img(100, 100))
    with pytest.raises(TypeError):
        preprocess_video(Image.fromarray(rand_img(100, 100)))


# ---- Qwen3-VL / Qwen3.5 ------------------------------------------------------------------------------
HUB_QWEN3_VL_CONFIG = dict(HUB_PREPROCESSOR_QWEN3, processor_class="Qwen3VLProcessor")  # the hub's file


def test_qwen3_vl_hub_config_matches_hf(tmp_path):
    """The hub's Qwen3-VL preprocessor_config.json: patch 16 (factor 32), mean / std 0.5, the pixel
    budget as `size`; HF's processor configured from the same file is the reference."""
    from qwen_vit_jax.preprocess.config import QWEN3_VL_PREPROCESS

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(HUB_QWEN3_VL_CONFIG))
    cfg = PreprocessConfig.from_hf(tmp_path)
    assert cfg == QWEN3_VL_PREPROCESS
    assert (cfg.factor, cfg.patch_dim, cfg.min_pixels, cfg.max_pixels) == (32, 1536, 65536, 16777216)
    hf = hf_proc(**{k: v for k, v in HUB_QWEN3_VL_CONFIG.items() if not k.endswith("_type") and k != "processor_class"})
    assert hf.to_dict()["size"] == HUB_QWEN3_VL_CONFIG["size"] and hf.patch_size == 16
    images = [
        rand_img(100, 150, seed=20),  # below min_pixels: scaled up
        rand_img(333, 517, seed=21),
        rand_img(1024, 768, seed=22),
        rand_img(40, 1900, seed=23),
    ]
    ours = preprocess_images(images, config=cfg)
    assert_same(ours, hf_run(hf, images))
    assert ours[0].shape[1] == 1536 and (ours[1][:, 1:] % 2 == 0).all()
    assert (ours[1][:, 1:] * 16 % 32 == 0).all()
    # the pixel budget as `size` also overrides like HF when passed at call time
    small = preprocess_images(images[2], max_pixels=200_000, config=cfg)
    assert_same(
        small,
        hf_run(hf_proc(**dict(HUB_QWEN3_VL_CONFIG, size={"shortest_edge": 65536, "longest_edge": 200_000})), images[2]),
    )
