"""Pillow's convolution resize of RGB uint8 images (BICUBIC, BILINEAR, BOX), bit for bit, in numba.

HF's PIL-backend image processors resize with Pillow, and their pixels are our reference. Pillow's
resize is scalar C, slower than the photo's decode (benchmarks/RESULTS.md, "The host path and
workers"). No library gives its bits faster (OpenCV's and torchvision's bicubic filters are other
filters), so this module does Pillow's integer arithmetic in another memory
order, where every step is a loop over whole contiguous rows that the compiler vectorises.

Pillow's algorithm (libImaging/Resample.c, unchanged since Pillow 4.3): per axis, each output
sample's taps and weights come from the filter in float64, normalised to sum 1, then rounded to
22-bit fixed point. A horizontal pass over the input rows the vertical pass needs sums taps in
int32 and clips to uint8; a vertical pass does the same over the result. Here the horizontal pass
runs on the transposed image, so it too sums whole rows; pixels travel through the two transposes
as 32-bit words (R, G, B and a zero byte). `tests/test_resize.py` holds it equal to the installed
Pillow over a sweep of sizes, filters, upscales and thin images.
"""

from __future__ import annotations

import functools
import math
import re
import warnings

import numba
import numpy as np
import PIL
from PIL import Image

_BITS = 22  # Pillow's PRECISION_BITS: 32 - 8 - 2
# Pillow's filters with their support; the others (NEAREST, HAMMING, LANCZOS: libm's sin/cos) go to Pillow
SUPPORT = {int(Image.Resampling.BOX): 0.5, int(Image.Resampling.BILINEAR): 1.0, int(Image.Resampling.BICUBIC): 2.0}


@numba.njit(cache=True, nogil=True)
def _filter(kind: int, x: float) -> float:
    """Pillow's box_filter / bilinear_filter / bicubic_filter (a = -0.5), the same float64 steps."""
    if kind == 3:  # BICUBIC
        if x < 0.0:
            x = -x
        if x < 1.0:
            return ((-0.5 + 2.0) * x - (-0.5 + 3.0)) * x * x + 1
        if x < 2.0:
            return (((x - 5) * x + 8) * x - 4) * -0.5
        return 0.0
    if kind == 2:  # BILINEAR
        if x < 0.0:
            x = -x
        if x < 1.0:
            return 1.0 - x
        return 0.0
    if x > -0.5 and x <= 0.5:  # BOX
        return 1.0
    return 0.0


@numba.njit(cache=True, nogil=True)
def _coefficients(in_size: int, out_size: int, kind: int, support: float):
    """Pillow's precompute_coeffs + normalize_coeffs_8bpc for a whole axis (box 0 .. in_size):
    bounds int32 [out_size, 2] (first tap, taps), weights int32 [out_size, ksize] (22-bit fixed
    point, zero past the taps)."""
    scale = float(in_size) / out_size
    filterscale = max(scale, 1.0)
    support = support * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    bounds = np.zeros((out_size, 2), np.int32)
    weights = np.zeros((out_size, ksize), np.int32)
    w = np.zeros(ksize, np.float64)
    inv = 1.0 / filterscale
    for xx in range(out_size):
        center = 0.0 + (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        ww = 0.0
        for x in range(xmax):
            w[x] = _filter(kind, ((x + xmin) - center + 0.5) * inv)
            ww += w[x]
        for x in range(xmax):
            k = w[x] / ww if ww != 0.0 else w[x]
            weights[xx, x] = int(-0.5 + k * (1 << _BITS)) if k < 0 else int(0.5 + k * (1 << _BITS))
        bounds[xx, 0] = xmin
        bounds[xx, 1] = xmax
    return bounds, weights


@numba.njit(cache=True, nogil=True)
def _sum_rows(src, first: int, bounds, weights, out) -> None:
    """out[r] = clip8(sum_j weights[r, j] * src[first + bounds[r, 0] + j]): uint8 rows [*, L], int32
    sums with Pillow's rounding (start at half, shift by 22, clip to 0 .. 255)."""
    acc = np.empty(src.shape[1], np.int32)
    for r in range(out.shape[0]):
        acc[:] = 1 << (_BITS - 1)
        start = first + bounds[r, 0]
        for j in range(bounds[r, 1]):
            k = weights[r, j]
            row = src[start + j]
            for i in range(acc.shape[0]):
                acc[i] += np.int32(row[i]) * k
        o = out[r]
        for i in range(acc.shape[0]):
            v = acc[i] >> _BITS
            o[i] = 0 if v < 0 else (255 if v > 255 else v)


@numba.njit(cache=True, nogil=True)
def _words(src, first: int, out) -> None:
    """uint8 [H, W, 3] rows first .. first + n -> uint32 [n, W] words (R | G << 8 | B << 16)."""
    for y in range(out.shape[0]):
        s, o = src[first + y], out[y]
        for x in range(out.shape[1]):
            o[x] = np.uint32(s[x, 0]) | (np.uint32(s[x, 1]) << 8) | (np.uint32(s[x, 2]) << 16)


@numba.njit(cache=True, nogil=True)
def _transpose(src, out) -> None:
    """uint32 [H, W] -> [W, H], in 8 x 8 tiles (fixed trip counts the compiler unrolls)."""
    H, W = src.shape
    h8, w8 = H - H % 8, W - W % 8
    for y0 in range(0, h8, 8):
        for x0 in range(0, w8, 8):
            for x in range(x0, x0 + 8):
                for y in range(y0, y0 + 8):
                    out[x, y] = src[y, x]
    for y in range(h8, H):
        for x in range(W):
            out[x, y] = src[y, x]
    for x in range(w8, W):
        for y in range(h8):
            out[x, y] = src[y, x]


@numba.njit(cache=True, nogil=True)
def _rgb(src, out) -> None:
    """uint8 [h, w * 4] (R, G, B, 0 words as bytes) -> [h, w, 3]."""
    for y in range(out.shape[0]):
        s, o = src[y], out[y]
        for x in range(out.shape[1]):
            o[x, 0] = s[4 * x]
            o[x, 1] = s[4 * x + 1]
            o[x, 2] = s[4 * x + 2]


def _horizontal(a: np.ndarray, first: int, rows: int, bounds, weights, width: int) -> np.ndarray:
    """Pillow's horizontal pass over rows first .. first + rows of [H, W, 3] uint8: uint32 words
    [rows, width] (R, G, B, 0), summed on the transposed image."""
    words = np.empty((rows, a.shape[1]), np.uint32)  # [rows, W]
    _words(a, first, words)
    columns = np.empty((a.shape[1], rows), np.uint32)  # [W, rows]: each input column a row
    _transpose(words, columns)
    across = np.empty((width, rows), np.uint32)  # [width, rows]: each output column a row
    _sum_rows(columns.view(np.uint8), 0, bounds, weights, across.view(np.uint8))
    out = np.empty((rows, width), np.uint32)  # [rows, width]
    _transpose(across, out)
    return out


def _vertical(rows: np.ndarray, first: int, bounds, weights, height: int) -> np.ndarray:
    """Pillow's vertical pass over [rows, L] uint8 (any packing of a row's pixels): [height, L]."""
    out = np.empty((height, rows.shape[1]), np.uint8)
    _sum_rows(rows, first, bounds, weights, out)
    return out


def _rgb_of(words: np.ndarray) -> np.ndarray:
    out = np.empty((*words.shape, 3), np.uint8)  # [h, w, 3]
    _rgb(words.view(np.uint8), out)
    return out


def _resample(a: np.ndarray, height: int, width: int, kind: int, vertical_first: bool) -> np.ndarray:
    """Pillow's ImagingResampleInner on [H, W, 3] uint8 (box = the whole image), passes in Pillow's
    order: horizontal over the input rows the vertical pass reads, then vertical; or vertical over
    every row, then horizontal."""
    H, W, _ = a.shape
    if (height, width) == (H, W):
        return a.copy()
    support = SUPPORT[kind]
    if width == W:  # the vertical pass alone, on the packed rows
        bv, kv = _coefficients(H, height, kind, support)
        return _vertical(a.reshape(H, W * 3), 0, bv, kv, height).reshape(height, W, 3)
    bh, kh = _coefficients(W, width, kind, support)
    if height == H:
        return _rgb_of(_horizontal(a, 0, H, bh, kh, width))
    bv, kv = _coefficients(H, height, kind, support)
    if vertical_first:
        down = _vertical(a.reshape(H, W * 3), 0, bv, kv, height).reshape(height, W, 3)
        return _rgb_of(_horizontal(down, 0, height, bh, kh, width))
    first, rows = int(bv[0, 0]), int(bv[-1, 0] + bv[-1, 1] - bv[0, 0])  # the input rows the vertical pass reads
    across = _horizontal(a, first, rows, bh, kh, width)  # [rows, width]: Pillow's intermediate image
    return _rgb_of(_vertical(across.view(np.uint8), -first, bv, kv, height).view(np.uint32))


def _vertical_first_rule():
    """The installed Pillow's choice of pass order for (H, W) -> (h, w): 13.0 runs the vertical pass
    first when the height shrinks by more than twice as many rows as the width loses columns;
    12.2 and 12.3 did so (in Image.resize) for images over 100x as tall as wide; before, never."""
    version = tuple(int(v) for v in re.findall(r"\d+", PIL.__version__)[:2])
    if version >= (13, 0):
        return lambda H, W, h, w: H - h > 0 and H - h > (W - w) * 2
    if version >= (12, 2):
        return lambda H, W, h, w: H > W * 100 and h < H
    return lambda H, W, h, w: False


_VERTICAL_FIRST = _vertical_first_rule()


@functools.cache
def agrees_with_pillow() -> bool:
    """Checked once per process: this module's results equal the installed Pillow's on a probe of
    sizes through both pass orders, each filter, upscales and a thin image. If not (a Pillow that
    resizes another way), `resize_rgb` hands every call to Pillow and says so once."""
    rng = np.random.default_rng(0)
    sizes = [((37, 53), (20, 29)), ((41, 30), (12, 33)), ((19, 23), (45, 31)), ((60, 9), (7, 9)), ((5, 700), (3, 90))]
    for kind in SUPPORT:
        for (H, W), (h, w) in sizes:
            a = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
            ours = _resample(a, h, w, kind, _VERTICAL_FIRST(H, W, h, w))
            if not np.array_equal(ours, np.asarray(Image.fromarray(a).resize((w, h), resample=kind))):
                warnings.warn(
                    f"Pillow {PIL.__version__} resizes differently from qwen_vit_jax's copy of its "
                    "algorithm: images are resized by Pillow itself (the same pixels, slower)",
                    stacklevel=3,
                )
                return False
    return True


def resize_rgb(a: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """[H, W, 3] uint8 -> [height, width, 3] uint8, equal to `np.asarray(Image.fromarray(a).resize(
    (width, height), resample))` (Pillow's `reducing_gap=None`, HF's call). Filters outside
    `SUPPORT`, other layouts, and a Pillow this module does not agree with go to Pillow."""
    if (
        resample not in SUPPORT
        or a.ndim != 3
        or a.shape[2] != 3
        or a.dtype != np.uint8
        or min(a.shape[:2]) < 1
        or not agrees_with_pillow()
    ):
        return np.asarray(Image.fromarray(a).resize((width, height), resample=resample))
    H, W, _ = a.shape
    return _resample(np.ascontiguousarray(a), height, width, resample, _VERTICAL_FIRST(H, W, height, width))
