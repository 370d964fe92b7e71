"""Inputs as users bring them: files and folders found, images decoded (EXIF orientation applied, as
HF's `load_image`), and how many patches an input will have from its header alone. Light to import
(the CLI's parser reads the suffixes): preprocessing is imported where it is used.

Decoding gives HF's pixels. An RGB JPEG is decoded by simplejpeg when both it and Pillow use
libjpeg-turbo (the same integer IDCT and upsampling: the same bits, faster than Pillow;
benchmarks/RESULTS.md, "The host path and workers"); everything else, and anything simplejpeg
refuses, by Pillow.
`fast_decode` lets libjpeg scale a JPEG down in the DCT domain while decoding (PIL's `draft`) when it
is resized to at most half its size anyway: 2-4x less decode work, not the same pixels
(docs/numerics.md has the deviation).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

from qwen_vit_jax import errors

IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".jfif"}
)
VIDEO_SUFFIXES = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".wmv", ".flv", ".3gp"})
_SWAPS_SIDES = (5, 6, 7, 8)  # EXIF orientations that turn the image by 90 degrees


class EncodeError(errors.BadInput):
    """A failure of the encode command to report as one `error: ...` line (a ValueError; its
    message names settings by their keywords, `keep_going=True`, which the CLI spells as flags)."""


# ---- finding inputs ------------------------------------------------------------------------------
def find_inputs(inputs: Iterable[str], recursive: bool = False, extra_suffixes: Iterable[str] = ()) -> list[str]:
    """Files as given, folders expanded to their image and video files (and files with
    `extra_suffixes`; sorted by name, hidden files and other suffixes skipped; sub-folders only with
    `recursive`). Duplicates are dropped."""
    found: list[str] = []
    extra = frozenset(extra_suffixes)
    for item in inputs:
        if os.path.isdir(item):
            if recursive:
                for root, dirs, files in os.walk(item):
                    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                    found += [os.path.join(root, f) for f in sorted(files) if _is_input_name(f, extra)]
            else:
                names = (e.name for e in os.scandir(item) if e.is_file() and _is_input_name(e.name, extra))
                found += sorted(os.path.join(item, n) for n in names)
        elif os.path.isfile(item):
            found.append(item)
        else:
            raise EncodeError(f"input not found: {item}")
    return list(dict.fromkeys(os.path.normpath(p) for p in found))


def _is_input_name(name: str, extra: frozenset = frozenset()) -> bool:
    suffix = os.path.splitext(name)[1].lower()
    return not name.startswith(".") and (suffix in IMAGE_SUFFIXES or suffix in VIDEO_SUFFIXES or suffix in extra)


def is_video(path: str) -> bool:
    """A video by suffix; a file with neither kind of suffix (given by name) by content: PIL cannot
    open it and PyAV finds a video stream in it."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in VIDEO_SUFFIXES or suffix in IMAGE_SUFFIXES:
        return suffix in VIDEO_SUFFIXES
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path):
            return False
    except (UnidentifiedImageError, OSError):
        pass
    from qwen_vit_jax.preprocess.video import probe

    try:
        probe(path)
    except (ValueError, OSError, ImportError):
        return False  # neither: it fails as an image, with PIL's message
    return True


# ---- decoding ------------------------------------------------------------------------------------
def load_image(source, *, draft_to: tuple[int, int] | None = None, name: str | None = None):
    """Decode an image (a file's path, or its bytes) fully, EXIF orientation applied (as HF's
    `load_image` does): a PIL image, or for an RGB JPEG that simplejpeg decodes, its uint8
    [H, W, 3] array (the same pixels). Colour conversion (palette, grey, alpha onto white) is left
    to preprocessing.

    draft_to: (height, width) the image will be resized to (after orientation): a JPEG is then
    decoded by Pillow at the smallest DCT scale (1/2, 1/4, 1/8) that still covers it (`fast_decode`).
    name: what a failure names (default: the path; bytes have none). Bytes Pillow cannot identify
    raise UnidentifiedImageError naming it and the bytes' start, not Pillow's `<_io.BytesIO ...>`.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        opened = Image.open(_file(source))
    except UnidentifiedImageError:
        what = name or (os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the input")
        head = bytes(source[:16]) if isinstance(source, (bytes, bytearray, memoryview)) else _head(source)
        raise UnidentifiedImageError(f"{what} is not an image file Pillow can read (it starts {head!r})") from None
    with opened as im:
        orientation = im.getexif().get(0x0112, 1)
        if im.format == "JPEG" and draft_to is not None:
            h, w = draft_to[::-1] if orientation in _SWAPS_SIDES else draft_to
            im.draft("RGB", (w, h))  # DCT-domain scaling while decoding: not HF's pixels
        elif im.format == "JPEG" and im.mode == "RGB" and _simplejpeg() is not None:
            if isinstance(source, (bytes, bytearray, memoryview)):
                data = source
            else:
                im.fp.seek(0)
                data = im.fp.read()
            a = _decode_jpeg(data)
            if a is not None and a.shape[:2] == im.size[::-1]:
                return _oriented(a, orientation)
        im.load()
        return ImageOps.exif_transpose(im)


def _head(path, n: int = 16) -> bytes:
    """A file's first n bytes (what the error of an unidentified image shows)."""
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def _file(source):
    """What PIL opens: a path as it is, bytes as a file."""
    import io

    return io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source


@functools.cache
def _simplejpeg():
    """simplejpeg, when its decodes equal Pillow's: both on libjpeg-turbo (a Pillow built on IJG's
    libjpeg rounds its IDCT otherwise). None when not."""
    try:
        import simplejpeg
        from PIL import features
    except ImportError:
        return None
    return simplejpeg if features.check_feature("libjpeg_turbo") else None


def _decode_jpeg(data: bytes):
    """simplejpeg's RGB decode with libjpeg-turbo's accurate IDCT and smooth upsampling (Pillow's
    settings); None for a file it refuses (damaged data, an unusual colour space): Pillow decides."""
    try:
        return _simplejpeg().decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False, strict=True)
    except ValueError:
        return None


def _oriented(a, orientation: int):
    """ImageOps.exif_transpose on a decoded [H, W, 3] array: each orientation a flip, a turn, or both."""
    import numpy as np

    t = a.transpose(1, 0, 2) if orientation in _SWAPS_SIDES else a  # [W, H, 3] when the sides swap
    flips = {2: (0, 1), 3: (1, 1), 4: (1, 0), 6: (0, 1), 7: (1, 1), 8: (1, 0)}  # (rows, columns)
    flip_rows, flip_columns = flips.get(orientation, (0, 0))
    return np.ascontiguousarray(t[:: -1 if flip_rows else 1, :: -1 if flip_columns else 1])


def draft_size(path, cfg, variant: str) -> tuple[int, int] | None:
    """The size `fast_decode` may decode a JPEG at: its resize target under `cfg` (a PreprocessConfig)
    when that is at most half the image on both sides (else None: no DCT scale would apply)."""
    from qwen_vit_jax.preprocess.images import target_size

    size = header_size(path)
    if size is None or not cfg.do_resize:
        return None
    h, w = size
    th, tw = target_size(h, w, cfg, variant)
    return (th, tw) if 2 * th <= h and 2 * tw <= w else None


def header_size(path) -> tuple[int, int] | None:
    """(height, width) of an image file (a path, or its bytes) after its EXIF orientation, from the
    header (no decoding); None for a file PIL cannot open."""
    from PIL import Image

    try:
        with Image.open(_file(path)) as im:
            w, h = im.size
            if im.getexif().get(0x0112) in _SWAPS_SIDES:
                w, h = h, w
    except Exception:  # noqa: BLE001 (any unreadable header: decoding reports it)
        return None
    return h, w


# ---- patch counts --------------------------------------------------------------------------------
def image_patches(path: str, preprocess, variant: str = "qwen2_vl") -> int:
    """Patches an image file will have after preprocessing (`preprocess`: a PreprocessConfig), from its
    header alone (size and EXIF orientation; no decoding). 0 for a file PIL cannot open: it fails
    later, in one process."""
    from qwen_vit_jax.preprocess.images import target_size

    size = header_size(path)
    if size is None:
        return 0
    try:
        h, w = target_size(*size, preprocess, variant)
    except ValueError:  # an aspect ratio HF refuses: it fails later, named
        return 0
    return (h // preprocess.patch_size) * (w // preprocess.patch_size)


def input_patches(path: str, image_cfg, video_cfg, variant: str = "qwen2_vl") -> int:
    """Patches an input will have, from headers alone (what the split across processes balances):
    an image's size, a video's container metadata with the sampling and sizing of `video_cfg`. 0 for
    a file that cannot be read: it fails later, in the one process that owns it."""
    if not is_video(path):
        return image_patches(path, image_cfg, variant)
    from qwen_vit_jax.preprocess.video import open_plan

    try:
        return open_plan(path, video_cfg, max_pixels=None).patches  # the container's word: nothing decoded
    except Exception:  # noqa: BLE001 (any unreadable header: the owning process reports it)
        return 0
