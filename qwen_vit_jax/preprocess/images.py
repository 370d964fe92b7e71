"""Image / video preprocessing for the Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 vision towers
(numpy + PIL only).

A re-implementation of transformers' `Qwen2VLImageProcessorPil` (what `Qwen2VLImageProcessor`
falls back to without torchvision), checked bit-for-bit against it in the tests:

  convert to RGB -> smart_resize to multiples of patch * merge (28) within [min_pixels, max_pixels]
  -> Pillow's resize (BICUBIC) on uint8 (resize.py: its arithmetic, faster) -> rescale 1/255
  -> normalise with CLIP mean / std
  -> patchify into rows ordered merge-unit-major, each row (C, T, ph, pw) flattened.

Qwen3-VL and Qwen3.5 use the same HF image processor with other settings: patch 16 (factor 32),
mean = std = 0.5, and the pixel range given as `size` = {shortest_edge, longest_edge} in their
preprocessor_config.json (`QWEN3_VL_PREPROCESS` holds the hub's values; `from_hf` reads the file).

Rescale and normalise use HF's exact float64 / float32 arithmetic, so pixel_values are
bit-identical to HF's, not just close. Patches are shuffled while still uint8 and an image is
repeated over T only at the end, which keeps a 1000x1000 image at a few tens of ms.

Input conventions (where HF is ambiguous or looser, we are explicit):
  * numpy arrays are always channels-last: HxW, HxWx1 (grey), HxWx3 (RGB), HxWx4 (RGBA,
    composited on white exactly as HF does for arrays). HF guesses channels-first when the first
    axis is 1, 3 or 4; we never do. HF rejects 2-D arrays; we treat them as HxWx1.
  * dtype: uint8, or any integer / float array whose values are whole numbers in [0, 255] (cast to
    uint8, as HF does before PIL resizing). Float images in [0, 1] are rejected: HF would rescale
    them by 1/255 twice. bool and other dtypes raise TypeError.
  * PIL images are converted exactly like HF: images with an alpha band or a `transparency` entry
    are alpha-composited onto opaque white with PIL, anything else goes through `.convert("RGB")`.

Video (decoding, frame sampling, HF's video processors' sizing and timestamps) is video.py: it
runs this module's per-frame steps and patchify. PreprocessConfig carries its settings.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from qwen_vit_jax.families import GLM4V, PADDLEOCR_VL, QWEN2_VL
from qwen_vit_jax.preprocess.config import GLM4V_PREPROCESS, PADDLEOCR_PREPROCESS, PreprocessConfig
from qwen_vit_jax.preprocess.resize import resize_rgb

if TYPE_CHECKING:  # the plan (and jax) load where Patches are made, not in a worker process
    from qwen_vit_jax.plan.contract import Patches


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels] where
    possible, aspect ratio kept as well as rounding allows. Same arithmetic as HF's (Python `round`
    is half-to-even there too), so the same sizes.

    Raises ValueError when max/min side > 200 (as HF) and, unlike HF (ZeroDivisionError), for
    non-positive sides or factor.
    """
    for name, v in (("height", height), ("width", width), ("factor", factor)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"smart_resize: {name} must be a positive int, got {v!r}")
    if (ratio := max(height, width) / min(height, width)) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio} ({height}x{width})")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return int(h), int(w)


# ---- per-image steps ---------------------------------------------------------------------------------
def _pil_rgb(img: Image.Image) -> Image.Image:
    """HF's PIL conversion: composite transparency onto white, else plain convert("RGB") (an RGB
    image as it is)."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    return img if img.mode == "RGB" else img.convert("RGB")


def _pil_to_rgb(img: Image.Image) -> np.ndarray:
    return np.asarray(_pil_rgb(img))


def _array_to_uint8(a: np.ndarray, what: str) -> np.ndarray:
    if a.dtype == np.uint8:
        return a
    if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise TypeError(f"{what}: unsupported array dtype {a.dtype} (expected uint8)")
    if a.size and (not np.all(np.isfinite(a)) or a.min() < 0 or a.max() > 255 or np.any(a != np.round(a))):
        raise ValueError(
            f"{what}: {a.dtype} array must hold whole numbers in [0, 255] "
            f"(got range [{a.min()}, {a.max()}]); float images in [0, 1] must be "
            "converted to uint8 first, e.g. (x * 255).round().astype(np.uint8)"
        )
    return a.astype(np.uint8)


def _image_list(images) -> list | tuple | np.ndarray:
    """`images` as a sequence of images: one image (a PIL image or a 2-D / 3-D array) becomes a list
    of one; a list, tuple or 4-D array is a batch. TypeError for anything else, ValueError if empty."""
    if isinstance(images, Image.Image) or (isinstance(images, np.ndarray) and images.ndim != 4):
        images = [images]  # one image; a 4-D array is a batch
    if not isinstance(images, (list, tuple, np.ndarray)):
        raise TypeError(f"images must be an image or a list of images, got {type(images).__name__}")
    if len(images) == 0:
        raise ValueError("images is empty")
    return images


def _family_config(config, default: PreprocessConfig) -> PreprocessConfig:
    """`config`, or the family's `default` for None; TypeError for anything but a PreprocessConfig."""
    cfg = default if config is None else config
    if not isinstance(cfg, PreprocessConfig):
        raise TypeError(f"config must be a PreprocessConfig, got {type(cfg).__name__}")
    return cfg


def to_hwc3(image: Any, cfg: PreprocessConfig, what: str) -> np.ndarray:
    """One image -> HxWx3 uint8 RGB, converted like HF's `convert_to_rgb`."""
    if isinstance(image, Image.Image):
        a = _array_to_uint8(_pil_to_rgb(image) if cfg.do_convert_rgb else np.asarray(image), what)
    elif isinstance(image, np.ndarray):
        a = _array_to_uint8(image, what)
    else:
        raise TypeError(f"{what}: expected a PIL.Image or a numpy array, got {type(image).__name__}")
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3 or a.shape[2] not in (1, 3, 4):
        raise ValueError(f"{what}: expected a channels-last HxW, HxWx1, HxWx3 or HxWx4 image, got shape {a.shape}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"{what}: empty image of shape {a.shape}")
    if a.shape[2] != 3:
        if not cfg.do_convert_rgb:
            raise ValueError(f"{what}: {a.shape[2]}-channel image with do_convert_rgb=False (need 3 channels)")
        if a.shape[2] == 1:
            a = np.repeat(a, 3, axis=2)
        else:  # RGBA array: HF blends onto white in float64 and rounds half-to-even
            alpha = a[:, :, 3:4] / 255
            a = np.round(alpha * a[:, :, :3] + (1 - alpha) * 255).astype(np.uint8)
    return a


def resize(a: np.ndarray, cfg: PreprocessConfig, size: tuple[int, int] | None = None) -> np.ndarray:
    """HxWx3 uint8 -> resized uint8 (Pillow's pixels, as HF's PIL backend: resize.resize_rgb), or
    checked as-is when do_resize is off."""
    h, w = a.shape[:2]
    if not cfg.do_resize:
        if h % cfg.factor or w % cfg.factor:
            raise ValueError(f"do_resize=False needs sides that are multiples of {cfg.factor}, got {h}x{w}")
        return a
    th, tw = size if size is not None else smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return resize_rgb(a, th, tw, cfg.resample)


def rescale_normalize(x: np.ndarray, cfg: PreprocessConfig) -> np.ndarray:
    """uint8 [..., C, t, p, p] -> float32 with HF's exact arithmetic: rescale in float64 then cast to
    float32, normalise in float32 (mean / std cast to float32)."""
    if cfg.do_rescale:
        y = np.multiply(x, cfg.rescale_factor, dtype=np.float64).astype(np.float32)
    else:
        y = x.astype(np.float32)
    if cfg.do_normalize:
        y -= np.asarray(cfg.image_mean, np.float32).reshape(3, 1, 1, 1)
        y /= np.asarray(cfg.image_std, np.float32).reshape(3, 1, 1, 1)
    return y


def pixel_table(cfg: PreprocessConfig) -> np.ndarray:
    """float32 [3, 256]: each channel's byte value -> its pixel_values float, by `rescale_normalize`
    on the 256 values (elementwise: the same numbers it gives inside a whole image). What `Patches`
    carry, so that the device only looks values up."""
    values = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 1, 256))  # [C, t, p, p] as 3 rows of 256
    return rescale_normalize(values, cfg).reshape(3, 256)


def patch_bytes(frames: np.ndarray, cfg: PreprocessConfig) -> np.ndarray:
    """[gt, t, H, W, 3] uint8 -> uint8 [gt * H/p * W/p, t, p, p, 3]: each patch row's t frames as decoded;
    t is T (video) or 1 (an image).

    Rows: (t, h-block, w-block, h-in-block, w-in-block), i.e. merge units of m x m patches are
    contiguous (HF's order)."""
    gt, t, H, W, C = frames.shape
    p, m = cfg.patch_size, cfg.merge_size
    gh, gw = H // p, W // p
    x = frames.reshape(gt, t, gh // m, m, p, gw // m, m, p, C).transpose(0, 2, 5, 3, 6, 1, 4, 7, 8)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, t, p, p, C)  # [gt, hb, wb, i, j, t, py, px, C] -> rows


def _raster_bytes(a: np.ndarray, cfg: PreprocessConfig) -> np.ndarray:
    """[H, W, 3] uint8 -> uint8 [H/p * W/p, 1, p, p, 3], rows in raster order (PaddleOCR-VL's processor:
    no merge-unit grouping)."""
    H, W, C = a.shape
    p = cfg.patch_size
    x = a.reshape(H // p, p, W // p, p, C).transpose(0, 2, 1, 3, 4)  # [gh, p, gw, p, C] -> [gh, gw, p, p, C]
    return np.ascontiguousarray(x).reshape(-1, 1, p, p, C)


def patches_of(data: np.ndarray, cfg: PreprocessConfig) -> Patches:
    """uint8 patch rows ([N, S, p, p, 3]) with `cfg`'s pixel table."""
    from qwen_vit_jax.plan.contract import Patches

    return Patches(data, pixel_table(cfg), cfg.temporal_patch_size)


def patchify(frames: np.ndarray, cfg: PreprocessConfig) -> np.ndarray:
    """[gt, t, H, W, 3] uint8 -> float32 [gt * H/p * W/p, 3 * T * p * p] (HF's pixel_values rows, each
    (C, T, ph, pw) flattened; an image, t = 1, repeated over T): `patch_bytes` looked up in the
    pixel table."""
    return patches_of(patch_bytes(frames, cfg), cfg).to_float()


def _resolve(config: PreprocessConfig | None, min_pixels, max_pixels) -> PreprocessConfig:
    cfg = PreprocessConfig() if config is None else config
    if not isinstance(cfg, PreprocessConfig):
        raise TypeError(f"config must be a PreprocessConfig, got {type(cfg).__name__}")
    over = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    return dataclasses.replace(cfg, **over) if over else cfg


# ---- public entry points -----------------------------------------------------------------------------
def preprocess_images(
    images,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    *,
    config: PreprocessConfig | None = None,
    uint8: bool = False,
) -> tuple[np.ndarray | Patches, np.ndarray]:
    """Images -> vision-tower input, as HF's Qwen2VLImageProcessorPil.

    Args:
      images: one image or a list / tuple of them (or an [N, H, W, C] uint8 array); each a PIL.Image
        or a channels-last array (see the module docstring). Sizes may differ.
      min_pixels, max_pixels: override `config`'s pixel range when given.
      config: PreprocessConfig (default: HF class defaults).
      uint8: return `Patches` (the bytes as decoded and resized, each frame once; the device
        rescales and normalises them) instead of HF's float32 rows: the same numbers once expanded,
        an eighth of the bytes (what `encode_images` and the CLI send).

    Returns:
      pixel_values: float32 [sum_i t*h_i*w_i, 3 * T * p * p] (e.g. (704, 1176) for 300x450), images
        concatenated in order, each repeated over T; with uint8, `Patches` of those rows.
      grid_thw: int64 [num_images, 3], rows [1, h_i, w_i] in patches.
    """
    cfg = _resolve(config, min_pixels, max_pixels)
    return _preprocess(images, cfg, QWEN2_VL, uint8)


def target_size(height: int, width: int, cfg: PreprocessConfig, variant: str = QWEN2_VL) -> tuple[int, int]:
    """The (height, width) HF's image processor of a tower `variant` resizes an image to: PaddleOCR-VL's
    and GLM-4V's rules, smart_resize for the Qwen towers; the size itself without do_resize."""
    if not cfg.do_resize:
        return height, width
    if variant == PADDLEOCR_VL:
        return paddleocr_smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if variant == GLM4V:
        return glm4v_smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels, cfg.temporal_patch_size)
    return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)


def image_patches(
    image, cfg: PreprocessConfig, variant: str = QWEN2_VL, what: str = "image"
) -> tuple[np.ndarray, tuple]:
    """One decoded image (a PIL image or an array, see `to_hwc3`) -> (uint8 patch rows
    [h * w, 1, p, p, 3] in the variant's row order, its grid row (1, h, w)): resized by the
    variant's rule."""
    image = to_hwc3(image, cfg, what)
    a = resize(image, cfg, target_size(*image.shape[:2], cfg, variant) if cfg.do_resize else None)
    rows = _raster_bytes(a, cfg) if variant == PADDLEOCR_VL else patch_bytes(a[None, None], cfg)
    return rows, (1, a.shape[0] // cfg.patch_size, a.shape[1] // cfg.patch_size)


def _preprocess(images, cfg: PreprocessConfig, variant: str, uint8: bool):
    """The image processors' shared loop: per image convert, resize, cut into patch rows."""
    rows, grids = [], []
    for i, image in enumerate(_image_list(images)):
        r, grid = image_patches(image, cfg, variant, f"image {i}")
        rows.append(r)
        grids.append(grid)
    patches = patches_of(rows[0] if len(rows) == 1 else np.concatenate(rows), cfg)
    return patches if uint8 else patches.to_float(), np.asarray(grids, dtype=np.int64)


# ---- PaddleOCR-VL ------------------------------------------------------------------------------------
def paddleocr_smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 384 * 384, max_pixels: int = 1536 * 1536
) -> tuple[int, int]:
    """PaddleOCR-VL's target (height, width): `smart_resize` after first stretching a side shorter
    than `factor` to `factor` (the other side scaled with it, rounded half-to-even as HF's `round`).
    HF's own order of steps, so the same sizes."""
    for name, v in (("height", height), ("width", width), ("factor", factor)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"paddleocr_smart_resize: {name} must be a positive int, got {v!r}")
    if height < factor:
        width, height = round(width * factor / height), factor
    if width < factor:
        height, width = round(height * factor / width), factor
    return smart_resize(int(height), int(width), factor, min_pixels, max_pixels)


def preprocess_paddleocr_images(
    images, *, config: PreprocessConfig | None = None, uint8: bool = False
) -> tuple[np.ndarray | Patches, np.ndarray]:
    """Images -> PaddleOCR-VL's tower input, as HF's PaddleOCRVLImageProcessorPil (bit for bit).

    Args:
      images: one image or a list of them (PIL images or channels-last uint8 arrays), any sizes.
      config: PreprocessConfig (default PADDLEOCR_PREPROCESS, HF's class defaults).
      uint8: return `Patches` instead of floats (see `preprocess_images`).
    Returns:
      pixel_values: float32 [sum_i h_i * w_i, 3 * T * p * p] (HF's [N, 3, 14, 14] flattened per row),
        rows in raster order per image, images concatenated in order (or their `Patches`).
      grid_thw: int64 [num_images, 3], rows [1, h_i, w_i] in patches.
    """
    return _preprocess(images, _family_config(config, PADDLEOCR_PREPROCESS), PADDLEOCR_VL, uint8)


# ---- GLM-4.1V / 4.5V ---------------------------------------------------------------------------------
def smart_resize_3d(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL's video smart_resize (also GLM-4V's for an image, which is one temporal patch of
    frames): like smart_resize, but the pixel bounds are on frames x height x width (frames rounded
    half to even to a multiple of temporal_factor), and sides under `factor` are first scaled up
    (truncated). Same arithmetic as HF's, so the same sizes; ValueError where HF raises (fewer frames
    than temporal_factor, aspect ratio over 200)."""
    if num_frames < temporal_factor:
        raise ValueError(
            f"a Qwen3-VL video needs at least temporal_patch_size = {temporal_factor} frames, got {num_frames}"
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {height}x{width}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(num_frames / temporal_factor) * temporal_factor
    if t * h * w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return int(h), int(w)


def glm4v_smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 112 * 112,
    max_pixels: int = 28 * 28 * 15000,
    temporal_factor: int = 2,
) -> tuple[int, int]:
    """GLM-4.1V's target (height, width) for an image (its `num_frames` = the temporal patch):
    a side under `factor` first scales both sides up (truncated to ints), and the pixel budget
    counts t_bar = temporal_factor frames. HF's own arithmetic, in HF's order, so the same sizes."""
    for name, v in (("height", height), ("width", width), ("factor", factor)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"glm4v_smart_resize: {name} must be a positive int, got {v!r}")
    return smart_resize_3d(temporal_factor, height, width, temporal_factor, factor, min_pixels, max_pixels)


def preprocess_glm4v_images(
    images, *, config: PreprocessConfig | None = None, uint8: bool = False
) -> tuple[np.ndarray | Patches, np.ndarray]:
    """Images -> GLM-4.1V / 4.5V's tower input, as HF's Glm4vImageProcessorPil (bit for bit): Qwen's
    rows (merge units, each image repeated over the temporal patch), GLM's resize rule.

    Args:
      images: one image or a list of them (PIL images or channels-last uint8 arrays), any sizes.
      config: PreprocessConfig (default GLM4V_PREPROCESS, HF's class defaults).
      uint8: return `Patches` instead of floats (see `preprocess_images`).
    Returns:
      pixel_values: float32 [sum_i h_i * w_i, 3 * T * p * p], images concatenated in order (or their
        `Patches`).
      grid_thw: int64 [num_images, 3], rows [1, h_i, w_i] in patches.
    """
    return _preprocess(images, _family_config(config, GLM4V_PREPROCESS), GLM4V, uint8)


def image_preprocessor(variant: str):
    """The `preprocess_*_images(images, config=...)` function of a tower variant's HF image processor."""
    return {PADDLEOCR_VL: preprocess_paddleocr_images, GLM4V: preprocess_glm4v_images}.get(variant, preprocess_images)
