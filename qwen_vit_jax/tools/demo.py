"""The demo: random-weight checkpoint in the real HF layout -> convert -> encode -> PCA picture.

No download and no torch: `write_random_hf_checkpoint` writes what `save_pretrained` of a
Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 model would (config.json in the transformers 5.x
layout, `visual.*` tensors in HF shapes in model.safetensors, the hub's
preprocessor_config.json), so the real converter, loader and preprocessing run on it unchanged.
The weights are random, so the PCA picture shows how the tower's features follow the input's
local structure, not semantics.

    python -m qwen_vit_jax.tools.cli demo            # or: qwen-vit-jax demo [--variant qwen3-vl] [--size full]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import tempfile
import time

import numpy as np
from PIL import Image, ImageDraw
from PIL.PngImagePlugin import PngInfo

from qwen_vit_jax.config import VisionConfig, dtype_named
from qwen_vit_jax.families import GLM4V, OMNI, PADDLEOCR_VL, QWEN3_5, QWEN3_FAMILY
from qwen_vit_jax.preprocess.config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from qwen_vit_jax.presets import (
    GLM_4_1V_9B,
    GLM_4_5V,
    PADDLEOCR_VL_0_9B,
    QWEN2_5_OMNI_3B,
    QWEN2_5_VL_3B,
    QWEN3_5_35B_A3B,
    QWEN3_OMNI_30B_A3B,
    QWEN3_VL_8B,
    QWEN3_VL_30B_A3B,
    QWEN4_EXP,
)
from qwen_vit_jax.tools.args import default_cache_dir
from qwen_vit_jax.tools.hf_reference import hf_config
from qwen_vit_jax.weights.keys import RULES, dims_to_shape
from qwen_vit_jax.weights.safetensors_io import write_safetensors

# A Qwen2.5-VL tower with both window and full-attention layers, small enough to compile and
# run in seconds on two CPU cores.
TINY = dataclasses.replace(
    QWEN2_5_VL_3B, depth=4, width=128, num_heads=4, intermediate_size=256, out_dim=128, fullatt_block_indexes=(1, 3)
)
# The same size of Qwen3-VL tower: the real 48 x 48 position table, deepstack taps on blocks 1 and 2.
TINY_QWEN3_VL = dataclasses.replace(
    QWEN3_VL_8B, depth=4, width=128, num_heads=4, intermediate_size=256, out_dim=128, deepstack_layers=(1, 2)
)
# The rest of the family at the same tiny size: the same towers under other families' config
# layouts and key names (config.FAMILIES).
TINY_QWEN3_5 = dataclasses.replace(TINY_QWEN3_VL, variant=QWEN3_5, deepstack_layers=())
# GLM-4.1V's tower at the same size (the released 24 x 24 table; block MLP width = out_dim, as GLM's).
TINY_GLM4V = dataclasses.replace(
    GLM_4_1V_9B, depth=4, width=128, num_heads=4, intermediate_size=128, out_dim=128, merger_intermediate_size=256
)
# --variant -> {--size -> tower}; "full" is the variant's released tower ("3b": Qwen2.5-VL's, kept
# as the name it had before there were other variants).
VARIANTS = {
    "qwen2.5-vl": {"tiny": TINY, "full": QWEN2_5_VL_3B, "3b": QWEN2_5_VL_3B},
    "qwen3-vl": {"tiny": TINY_QWEN3_VL, "full": QWEN3_VL_8B},
    "qwen3-vl-moe": {"tiny": dataclasses.replace(TINY_QWEN3_VL, family="qwen3_vl_moe"), "full": QWEN3_VL_30B_A3B},
    "qwen3.5-moe": {"tiny": dataclasses.replace(TINY_QWEN3_5, family="qwen3_5_moe"), "full": QWEN3_5_35B_A3B},
    "qwen4-exp": {"tiny": dataclasses.replace(TINY_QWEN3_5, family="qwen4_exp"), "full": QWEN4_EXP},
    "qwen3-omni": {"tiny": dataclasses.replace(TINY_QWEN3_VL, family="qwen3_omni_moe"), "full": QWEN3_OMNI_30B_A3B},
    "qwen2.5-omni": {"tiny": dataclasses.replace(TINY, family="qwen2_5_omni"), "full": QWEN2_5_OMNI_3B},
    "paddleocr-vl": {
        "tiny": dataclasses.replace(
            PADDLEOCR_VL_0_9B, depth=4, width=128, num_heads=4, intermediate_size=256, out_dim=128
        ),
        "full": PADDLEOCR_VL_0_9B,
    },
    "glm-4v": {"tiny": TINY_GLM4V, "full": GLM_4_1V_9B},
    "glm-4.5v": {"tiny": dataclasses.replace(TINY_GLM4V, family="glm4v_moe"), "full": GLM_4_5V},
}
SIZES = VARIANTS["qwen2.5-vl"]
# Random full-size weights are written in bfloat16 (1.3 GB instead of 2.7 GB for the 3B tower, like
# the hub's files) and run in bfloat16 (bf16-rounded operands, float32 accumulation); the tiny
# towers stay float32 (exact mode).
DEMO_DTYPE = {"tiny": "float32", "full": "bfloat16", "3b": "bfloat16"}

# What the Qwen2-VL / Qwen2.5-VL hub repositories ship as preprocessor_config.json.
HUB_PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": list(OPENAI_CLIP_MEAN),
    "image_std": list(OPENAI_CLIP_STD),
    "image_processor_type": "Qwen2VLImageProcessor",
}
# What the Qwen3-VL / Qwen3.5 hub repositories ship: patch 16, mean / std 0.5, the budget as `size`.
HUB_PREPROCESSOR_QWEN3 = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


# HF's PaddleOCRVLImageProcessorPil class defaults as a preprocessor_config.json (raster rows, no
# temporal patch, CLIP mean / std).
HUB_PREPROCESSOR_PADDLEOCR = {
    "min_pixels": 384 * 384,
    "max_pixels": 1536 * 1536,
    "patch_size": 14,
    "temporal_patch_size": 1,
    "merge_size": 2,
    "image_mean": list(OPENAI_CLIP_MEAN),
    "image_std": list(OPENAI_CLIP_STD),
    "image_processor_type": "PaddleOCRVLImageProcessor",
}


# HF's Glm4vImageProcessorPil class defaults as a preprocessor_config.json (the budget as `size`).
HUB_PREPROCESSOR_GLM4V = {
    "size": {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": list(OPENAI_CLIP_MEAN),
    "image_std": list(OPENAI_CLIP_STD),
    "image_processor_type": "Glm4vImageProcessor",
}


# ---- a random checkpoint in HF's layout ---------------------------------------------------------
def random_hf_tensors(cfg: VisionConfig, seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Every `visual.*` tensor of `cfg`'s tower in HF's shapes, randomly initialised.

    Matrices (and the Conv3d patch embedding) N(0, 1/fan_in), biases 0.02 N(0, 1), norm weights
    1 + 0.1 N(0, 1): the parity-test init of docs/numerics.md, which keeps attention far from uniform.
    The key set comes from the converter's table (`convert.RULES`: the rules of `cfg`'s variant and
    key layout), one tensor per rule and row of its stacked param (per block, or per deepstack
    merger: `Rule.rows`), under the family's prefix (`visual.`, the Omni thinkers' `thinker.visual.`).
    """
    out_dtype = dtype_named(dtype)
    rng = np.random.default_rng(seed)
    prefix = "thinker.visual." if cfg.hf_family in OMNI else "visual."
    tensors = {}
    for rule in RULES:
        if not rule.applies(cfg):
            continue
        shape = dims_to_shape(rule.src, cfg)
        for layer in range(rule.rows(cfg)) if rule.per_block else [None]:
            # PaddleOCR-VL's merger is HF's projector, stored beside the tower as mlp_AR.*
            key = ("" if rule.pattern.startswith("mlp_AR") else prefix) + rule.hf_key(layer)
            w = rng.standard_normal(shape, dtype=np.float32)
            if len(shape) >= 2:  # [out, in, ...]: fan_in is everything after the first axis
                w *= 1 / math.sqrt(math.prod(shape[1:]))
            elif key.endswith(".weight"):  # a 1-D weight is a norm scale (norm1/2, merger.ln_q / norm)
                w = 1 + 0.1 * w
            else:
                w *= 0.02
            tensors[key] = w.astype(out_dtype)
    return tensors


def write_random_hf_checkpoint(
    cfg: VisionConfig, path: str | os.PathLike, seed: int = 0, dtype: str = "float32"
) -> pathlib.Path:
    """Write an HF-layout checkpoint directory with a random vision tower, atomically.

    Files: config.json (transformers 5.x layout, a minimal text_config), model.safetensors (only
    `visual.*` tensors, in `dtype`) and preprocessor_config.json (the variant's hub values). `path` must
    not exist; it is filled in a temporary sibling and renamed into place.
    """
    path = pathlib.Path(path)
    if os.path.lexists(path):
        raise FileExistsError(f"{path} exists; not overwriting it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write_safetensors(tmp / "model.safetensors", random_hf_tensors(cfg, seed, dtype), {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
        pre = HUB_PREPROCESSOR_QWEN3 if cfg.variant in QWEN3_FAMILY else HUB_PREPROCESSOR
        pre = {PADDLEOCR_VL: HUB_PREPROCESSOR_PADDLEOCR, GLM4V: HUB_PREPROCESSOR_GLM4V}.get(cfg.variant, pre)
        (tmp / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# ---- sample images ------------------------------------------------------------------------------
def sample_images() -> dict[str, Image.Image]:
    """A few procedurally drawn RGB images of different sizes (deterministic, no licence attached).

    Returns name -> PIL image: "scene" 448x336, "gradient" 320x240, "checkerboard" 224x224,
    "shapes" 252x392 (portrait).
    """
    images = {}

    # A landscape: sky gradient, sun, two mountain ranges, a field and a house.
    w, h = 448, 336
    y = np.linspace(0, 1, h)[:, None, None]
    sky = (1 - y) * np.array([70, 130, 220]) + y * np.array([200, 225, 250])
    im = Image.fromarray(np.broadcast_to(sky, (h, w, 3)).astype(np.uint8))
    d = ImageDraw.Draw(im)
    d.ellipse((330, 40, 390, 100), fill=(255, 210, 60))
    d.polygon(
        [(0, 230), (90, 120), (170, 200), (260, 100), (370, 210), (448, 150), (448, 336), (0, 336)],
        fill=(110, 110, 140),
    )
    d.polygon([(0, 260), (120, 190), (240, 250), (340, 200), (448, 250), (448, 336), (0, 336)], fill=(80, 140, 70))
    d.rectangle((0, 290, 448, 336), fill=(150, 180, 80))
    d.rectangle((60, 230, 150, 300), fill=(200, 80, 60))
    d.polygon([(50, 232), (105, 190), (160, 232)], fill=(120, 50, 40))
    d.rectangle((95, 260, 115, 300), fill=(90, 60, 30))
    images["scene"] = im

    # Hue sweep left to right, brightness top to bottom, with a few rings.
    w, h = 320, 240
    hue = np.linspace(0, 2 * np.pi, w)[None, :, None]
    phase = np.array([0, 2 * np.pi / 3, 4 * np.pi / 3])
    light = np.linspace(1.0, 0.35, h)[:, None, None]
    im = Image.fromarray((255 * light * (0.5 + 0.5 * np.cos(hue - phase))).astype(np.uint8))
    d = ImageDraw.Draw(im)
    for i, r in enumerate((20, 45, 70)):
        colour = (255, 255, 255) if i % 2 else (0, 0, 0)
        d.ellipse((160 - r, 120 - r, 160 + r, 120 + r), outline=colour, width=6)
    images["gradient"] = im

    # An 8x8 checkerboard with coloured squares on the diagonal.
    n, c = 224, 28
    board = ((np.arange(n)[:, None] // c + np.arange(n)[None, :] // c) % 2 * 255).astype(np.uint8)
    im = Image.fromarray(np.repeat(board[:, :, None], 3, axis=2))
    d = ImageDraw.Draw(im)
    for i, colour in enumerate([(230, 40, 40), (40, 200, 60), (40, 90, 230), (240, 200, 30)] * 2):
        d.rectangle((i * c, i * c, i * c + c - 1, i * c + c - 1), fill=colour)
    images["checkerboard"] = im

    # Seeded random shapes on a grey background, portrait orientation.
    rng = np.random.default_rng(7)
    w, h = 252, 392
    im = Image.new("RGB", (w, h), (128, 128, 128))
    d = ImageDraw.Draw(im)
    for _ in range(14):
        x0, y0 = int(rng.integers(0, w - 40)), int(rng.integers(0, h - 40))
        s = int(rng.integers(25, 90))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        box = (x0, y0, x0 + s, y0 + s)
        (d.ellipse if rng.random() < 0.5 else d.rectangle)(box, fill=colour)
    images["shapes"] = im
    return images


# ---- the PCA picture ----------------------------------------------------------------------------
def pca_rgb(embeddings: np.ndarray, grid_hw: tuple[int, int]) -> np.ndarray:
    """Merged-token embeddings -> uint8 [h, w, 3] map of their first three principal components.

    Args:
      embeddings: [h * w, D] one image's merged tokens in raster order over the merged grid.
      grid_hw: (h, w) of the merged grid (the patch grid divided by spatial_merge_size).
    Each component is stretched from its 1st to 99th percentile to 0..255.
    """
    h, w = grid_hw
    x = np.asarray(embeddings, np.float64)
    if x.ndim != 2 or len(x) != h * w:
        raise ValueError(f"embeddings must be [{h} * {w}, D] for a {h}x{w} merged grid, got shape {x.shape}")
    x = x - x.mean(axis=0)
    _, _, vt = np.linalg.svd(x, full_matrices=False)  # rows of vt: principal directions
    comps = x @ vt[:3].T  # [h*w, <=3]
    if comps.shape[1] < 3:  # fewer tokens or dims than 3 components
        comps = np.pad(comps, ((0, 0), (0, 3 - comps.shape[1])))
    lo, hi = np.percentile(comps, 1, axis=0), np.percentile(comps, 99, axis=0)
    rgb = np.clip((comps - lo) / np.maximum(hi - lo, 1e-12), 0, 1)
    return (255 * rgb).round().astype(np.uint8).reshape(h, w, 3)


def pca_picture(
    image, embeddings: np.ndarray, grid_hw: tuple[int, int], path: str | os.PathLike | None = None
) -> Image.Image:
    """The input image next to the PCA map of its embeddings (see `pca_rgb`), same height.

    Args:
      image: the input (PIL image or HxWx3 uint8 array).
      embeddings: [h * w, D] its merged tokens; grid_hw: (h, w) of the merged grid.
      path: where to save the picture as PNG (optional).
    Returns:
      the picture (RGB, height = 28 * h, the map upscaled without smoothing).
    """
    h, w = grid_hw
    pca = Image.fromarray(pca_rgb(embeddings, grid_hw))
    image = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))
    height = 28 * h  # one merged token = 28 x 28 pixels at patch 14, merge 2
    left = image.convert("RGB").resize((round(image.width * height / image.height), height), Image.BICUBIC)
    right = pca.resize((28 * w, height), Image.NEAREST)
    gap = 8
    out = Image.new("RGB", (left.width + gap + right.width, height), (255, 255, 255))
    out.paste(left, (0, 0))
    out.paste(right, (left.width + gap, 0))
    if path is not None:
        out.save(path, format="PNG")
    return out


# The picture's own first lines: whoever sees it without the terminal's output learns the weights
# are random (the colours follow local structure, not meaning).
TITLE = (
    "qwen_vit_jax demo, RANDOM WEIGHTS (no download): the colours follow local structure, not meaning",
    "left: the input image    right: the first 3 principal components of its tokens, as RGB",
)
_LINE = 20  # pixels per line of text


def title_strip(width: int, title: tuple[str, ...] = TITLE) -> Image.Image:
    """The title lines on white, `width` pixels wide: the first in red, the others in black."""
    from PIL import ImageFont

    font = ImageFont.load_default(size=14)
    out = Image.new("RGB", (width, _LINE * len(title)), (255, 255, 255))
    draw = ImageDraw.Draw(out)
    for i, text in enumerate(title):
        draw.text((4, 2 + _LINE * i), text, fill=(180, 0, 0) if i == 0 else (0, 0, 0), font=font)
    return out


def labelled(
    pictures: list[Image.Image], names: list[str], gap: int = 8, title: tuple[str, ...] = TITLE
) -> Image.Image:
    """Pictures (`pca_picture`s) one above the other on white, under `title_strip` (that the weights
    are random; what the two columns are), each with its name above it."""
    from PIL import ImageFont

    font = ImageFont.load_default(size=14)
    line = _LINE
    width = max(max(p.width for p in pictures), *(int(font.getlength(t)) + 8 for t in title))
    top = title_strip(width, title)
    height = top.height + sum(line + p.height for p in pictures) + gap * (len(pictures) - 1)
    out = Image.new("RGB", (width, height), (255, 255, 255))
    out.paste(top, (0, 0))
    draw = ImageDraw.Draw(out)
    y = top.height
    for name, p in zip(names, pictures):
        draw.text((4, y + 2), name, fill=(60, 60, 60), font=font)
        out.paste(p, (0, y + line))
        y += line + p.height + gap
    return out


# ---- the demo -----------------------------------------------------------------------------------
def demo_config(variant: str = "qwen2.5-vl", size: str = "tiny") -> VisionConfig:
    """The demo's tower for `variant` (a key of VARIANTS) and `size` ("tiny" or "full")."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    if size not in VARIANTS[variant]:
        raise ValueError(f"size must be one of {tuple(VARIANTS[variant])} for {variant}, got {size!r}")
    return VARIANTS[variant][size]


def prepare_checkpoint(
    size: str = "tiny", cache_dir: str | os.PathLike | None = None, log=print, variant: str = "qwen2.5-vl"
) -> pathlib.Path:
    """The converted random checkpoint of `variant` / `size`, built on first use under
    `cache_dir`/demo-<size> (Qwen2.5-VL) or demo-<variant>-<size>: hf/ (HF layout, written by
    `write_random_hf_checkpoint`) and converted/ (`convert_checkpoint`). A cached directory whose
    config is not this tower's (an older layout) is rebuilt."""
    from qwen_vit_jax.weights.convert import convert_checkpoint, load_converted

    cfg = demo_config(variant, size)
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if variant == "qwen2.5-vl":  # "full" and "3b" are one tower: one cache, under its older name
        root = root / ("demo-3b" if size == "full" else f"demo-{size}")
    else:
        root = root / f"demo-{variant}-{size}"
    hf_dir, ours = root / "hf", root / "converted"
    try:
        current = VisionConfig.from_hf(hf_dir) == cfg and load_converted(ours)[0] == cfg
    except (OSError, ValueError):
        current = False
    if current:  # both folders: `verify HF_DIR CKPT` takes the HF one
        log(f"checkpoint: cached, HF layout {hf_dir}, converted {ours}")
        return ours
    for stale in (hf_dir, ours):
        shutil.rmtree(stale, ignore_errors=True)
    t0 = time.perf_counter()
    write_random_hf_checkpoint(cfg, hf_dir, dtype=DEMO_DTYPE[size])
    size_mb = (hf_dir / "model.safetensors").stat().st_size / 1e6
    log(
        f"checkpoint: wrote a random {cfg.variant} tower in HF layout ({size_mb:,.1f} MB, "
        f"{DEMO_DTYPE[size]}) in {time.perf_counter() - t0:.1f} s -> {hf_dir}"
    )
    t0 = time.perf_counter()
    convert_checkpoint(hf_dir, ours)
    log(f"checkpoint: converted in {time.perf_counter() - t0:.1f} s -> {ours}")
    return ours


def run_demo(
    size: str = "tiny",
    cache_dir: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    log=print,
    variant: str = "qwen2.5-vl",
    compile_cache: str | os.PathLike | None = None,
) -> pathlib.Path:
    """Build (or reuse) the random checkpoint, encode the sample images twice, save the PCA picture.

    Args:
      size: "tiny" (a 4-block tower, float32) or "full" (the variant's released tower, random
        bfloat16 weights, run in bfloat16: Qwen2.5-VL-3B's, 1.3 GB on disk, also called "3b";
        Qwen3-VL-8B's, 1.2 GB).
      variant: "qwen2.5-vl" or "qwen3-vl" (with deepstack mergers: their features are computed
        with every call, the picture shows the final tokens).
      cache_dir: where the checkpoints are kept (default: `default_cache_dir()`).
      out: the PNG to write (default: demo.png beside the checkpoint's hf/ and converted/ folders);
        the last line names it by its absolute path.
      log: where progress lines go.
      compile_cache: keep the compiled programs in this folder (`enable_compilation_cache`): a
        second run loads them (default: JAX's own setting).
    Returns:
      the path of the PNG.
    """
    from qwen_vit_jax.runtime.encoder import VisionEncoder, enable_compilation_cache

    ckpt = prepare_checkpoint(size, cache_dir, log, variant)
    if compile_cache is not None:
        enable_compilation_cache(compile_cache)
    t0 = time.perf_counter()
    # The ladder only (no size declared tight): the second call shows the bucket reused.
    enc = VisionEncoder.from_pretrained(ckpt, dtype=DEMO_DTYPE[size])
    cfg = enc.cfg
    log(
        f"encoder: {cfg.variant}, depth {cfg.depth}, width {cfg.width}, out_dim {cfg.out_dim}, "
        f"{enc.dtype}, on {enc.device.platform} (loaded in {time.perf_counter() - t0:.1f} s)"
    )

    from qwen_vit_jax import plan as planlib
    from qwen_vit_jax.preprocess.images import target_size

    images = sample_images()
    m = cfg.spatial_merge_size
    t0 = time.perf_counter()
    planlib.make_plans([[1, 2 * m, 2 * m]], cfg)  # the host planner's numba kernels: compiled once, then cached
    if (numba_s := time.perf_counter() - t0) > 0.5:
        log(
            f"host planner: numba compiled its kernels in {numba_s:.1f} s "
            "(once after an install: cached on disk for later runs)"
        )
    t0 = time.perf_counter()
    enc.encode_images(list(images.values()))
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    embs = enc.encode_images(list(images.values()))
    t_second = time.perf_counter() - t0

    grids = []  # patch grid (h, w) of each image: its preprocessed size / patch_size
    p = enc.preprocess
    for (name, im), emb in zip(images.items(), embs):
        hh, ww = target_size(im.height, im.width, p, enc.cfg.variant)
        grids.append((hh // p.patch_size, ww // p.patch_size))
        log(
            f"  {name:<13} {im.width}x{im.height} px -> grid_thw [1, {grids[-1][0]}, {grids[-1][1]}] "
            f"-> embeddings {emb.shape}"
        )
    n_patches = sum(h * w for h, w in grids)
    rows = ", ".join(str(b.patches) for b in enc.compile_seconds)
    log(
        f"first call:  {t_first:7.3f} s  ({enc.compile_count} program(s) compiled in "
        f"{sum(enc.compile_seconds.values()):.2f} s; {n_patches} patches padded to bucket(s) of {rows} rows)"
    )
    log(
        f"second call: {t_second:7.3f} s  ({n_patches / t_second:,.0f} patches/s; compile count still "
        f"{enc.compile_count}: same bucket, no recompilation)"
    )

    pictures = [pca_picture(im, emb, (h // m, w // m)) for im, emb, (h, w) in zip(images.values(), embs, grids)]
    out = (ckpt.parent / "demo.png" if out is None else pathlib.Path(out)).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    info = PngInfo()
    info.add_text("Description", ". ".join(TITLE))  # the title as text too, for tools that read it
    picture = labelled(pictures, [f"{name} ({im.width}x{im.height} px)" for name, im in images.items()])
    picture.save(out, format="PNG", pnginfo=info)
    log(f"saved the PCA picture (input | first 3 principal components of its tokens as RGB) -> {out}")
    return out
