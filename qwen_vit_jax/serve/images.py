"""An image item's size from its header, before anything is decoded: the service admits only the image
formats whose size a header gives without decoding (the allow-list, `FORMATS`), and refuses the
others by name.

    fmt, w, h = header_size(payload)      # ("PNG", 4000, 3000); BadInput / Unsupported otherwise

Which format a payload is, is the first Pillow plugin in Pillow's own order whose signature check
accepts its first bytes: the plugin a worker's `Image.open` then opens it with. A format off the
list is `errors.Unsupported` (415) even when Pillow reads it: ICO and CUR (Pillow loads the largest
frame of the directory at open: a 16x16 directory entry may hold a 12000x12000 PNG), ICNS, and the
rest of what Pillow reads, none of which a photo or a video frame arrives as. The formats kept are
those whose Pillow plugin reads the size from the header and decodes nothing at open
(tests/test_serve_edges.py sends each one claiming a size past the bound).
"""

from __future__ import annotations

import io

from qwen_vit_jax import errors

# Pillow's format names; MPO (a phone's multi-picture JPEG) opens through JPEG's plugin.
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM")
SHOWN = "JPEG, PNG, WebP, GIF, BMP, TIFF, PNM"


def identify(payload: bytes) -> str | None:
    """The Pillow format whose plugin Image.open tries first on these bytes, or None."""
    from PIL import Image

    Image.init()
    prefix = payload[:16]  # what Image.open gives the plugins' signature checks
    for fmt in Image.ID:
        accept = Image.OPEN[fmt][1]
        if accept is not None and accept(prefix):
            return fmt
    return None


def header_size(payload: bytes) -> tuple[str, int, int]:
    """(format, width, height) of an image in an accepted format, from its header.

    Raises:
      errors.Unsupported: a format Pillow knows but the service does not take (`what`: its name).
      errors.BadInput: not an image in any format, or a header that does not read.
      errors.TooLarge: a header past Pillow's decompression-bomb bound.
    """
    from PIL import Image

    fmt = identify(payload)
    if fmt is None:
        raise errors.BadInput(f"not an image in an accepted format ({SHOWN})")
    if fmt not in FORMATS:
        raise errors.Unsupported(f"{fmt} images are not accepted; send {SHOWN}", what=fmt.lower())
    try:
        with Image.open(io.BytesIO(payload), formats=[fmt]) as im:
            w, h = im.size
    except Image.DecompressionBombError as e:
        raise errors.TooLarge(str(e), limit="max_image_pixels") from None
    except Exception as e:  # noqa: BLE001 (whatever a garbled header makes PIL raise)
        why = "an unknown format" if isinstance(e, Image.UnidentifiedImageError) else f"{type(e).__name__}: {e}"
        raise errors.BadInput(f"not an image PIL can read ({why})") from None
    return fmt, w, h
