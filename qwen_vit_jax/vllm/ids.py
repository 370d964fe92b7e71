"""The identifier an item has in vLLM's encoder-cache store (STORE/<identifier>/...).

Two rules (`Ids`):

  "sha256"  the sha256 hex of the item's bytes (a file's bytes; what an embeddings file's metadata
            records as `sha256`), passed to vLLM as the request's `multi_modal_uuids` entry. Any
            item, image or video; any vLLM with an encoder-cache connector.
  "vllm"    vLLM's own identifier of an image that arrives as bytes (an `image_url`: a data: URL, an
            http URL or a file, what an EPD proxy forwards): `MultiModalHasher.hash_kwargs("blake3",
            model_id=<the model vLLM was started with>, image=<the bytes as MediaWithBytes>)`, so a
            consumer given plain pixels finds our file. Videos keep their sha256: vLLM hashes a
            video's decoded frames and its loader's metadata, which only its own loader reproduces.

`vllm_image_id` recomputes vLLM's hash outside vLLM, byte for byte as vllm/multimodal/hasher.py of
the version in `VLLM_TESTED` frames it: every chunk preceded by its length (8 bytes, little end),
every container by a tag and its length, the keyword arguments in name order. blake3 is vLLM's
default `mm_hasher_algorithm` (the `blake3` package; hashlib has no blake3).

Where vLLM's identifier is not a content hash, no rule can match it: a request with
`mm_processor_kwargs` or `media_io_kwargs` (they join the hash, even of a given uuid), a server
started with `--media-io-kwargs` changing the image mode, or one with both the processor cache
(`--mm-processor-cache-gb 0`) and prefix caching off (vLLM then names items per request).
"""

from __future__ import annotations

import hashlib
import io
import uuid
from collections.abc import Iterator

import numpy as np

from qwen_vit_jax.errors import BadInput, Unsupported

RULES = ("sha256", "vllm")
# The vLLM release whose MultiModalHasher tests/test_vllm.py checks `vllm_image_id` against (the
# vLLM venv's pin); docs/vllm.md says which other releases frame their hashes the same way.
VLLM_TESTED = "0.32.0"

_LENGTH = 8
_NONE, _SEQUENCE, _MAPPING, _LEAF = b"\x00", b"\x01", b"\x02", b"\x03"
# ImageMediaIO's defaults: the mode vLLM converts images to and the background alpha is laid on
_IMAGE_MODE, _RGBA_BACKGROUND = "RGB", (255, 255, 255)
_MODE_IN_HEADER = ("JPEG", "PNG", "WEBP")  # formats whose first frame decodes in the header's mode


def sha256_id(data: bytes) -> str:
    """The "sha256" rule: the hex digest of the item's bytes."""
    return hashlib.sha256(data).hexdigest()


def vllm_image_id(model_id: str, image) -> str:
    """vLLM's default identifier of one image, as `VLLM_TESTED` computes it.

    Args:
      model_id: the model exactly as vLLM was started with it (`vllm serve MODEL`, `LLM(model=...)`:
        a hub id, or the path as given).
      image: the image's encoded bytes (what vLLM's server receives in an `image_url` and keeps
        beside the decoded image as `MediaWithBytes`), or a PIL image (what `LLM.generate` is given
        in `multi_modal_data`: then its mode and pixels are hashed).

    Returns:
      64 hex digits (blake3).
    """
    if not isinstance(model_id, str) or not model_id:
        raise BadInput(f"model_id must be the model vLLM was started with, got {model_id!r}")
    from PIL import Image

    if isinstance(image, (bytes, bytearray, memoryview)):
        item = _encoded_image(bytes(image))
    elif isinstance(image, Image.Image):
        item = _pil_image(image)
    else:
        raise BadInput(f"image must be its bytes or a PIL image, got {type(image).__name__}")
    h = _blake3()()
    # hash_kwargs(model_id=..., image=...): the keyword arguments sorted by name
    for chunk in (*_item("image", item), *_item("model_id", model_id)):
        h.update(chunk)
    return h.hexdigest()


def _blake3():
    try:
        from blake3 import blake3
    except ImportError:
        raise Unsupported(
            "vLLM's identifiers are blake3 hashes: pip install blake3 (or qwen_vit_jax[vllm])", what="blake3"
        ) from None
    return blake3


class _Leaf:
    """A value hashed as its serialisation (MultiModalHasher.serialize_item) already spelled out."""

    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks


def _encoded_image(data: bytes) -> _Leaf:
    """serialize_item(MediaWithBytes(image, data, io_config)): the bytes, with the decode settings
    when decoding changed the mode (ImageMediaIO.load_bytes: io_config is set then). The EXIF
    ImageID short cut never applies here: a tag read from a file is text, never a uuid.UUID."""
    from PIL import Image, ImageOps

    try:
        with Image.open(io.BytesIO(data)) as im:
            mode = im.mode
            if mode != _IMAGE_MODE or im.format not in _MODE_IN_HEADER:  # vLLM's decode, to see its mode
                im.load()
                mode = ImageOps.exif_transpose(im).mode
    except Exception as e:  # noqa: BLE001 (whatever PIL raises for bytes it cannot read)
        raise BadInput(f"not an image PIL can read ({type(e).__name__})") from None
    if mode == _IMAGE_MODE:
        return _Leaf(list(_item("image", data)))
    io_config = {"image_mode": _IMAGE_MODE, "rgba_background_color": _RGBA_BACKGROUND}
    return _Leaf(list(_item("image", {"io_config": io_config, "data": data})))


def _pil_image(image) -> _Leaf:
    """serialize_item(PIL image): an EXIF ImageID that is a uuid.UUID, else the mode, the pixels
    (np.asarray) and the palette."""
    from PIL import Image

    try:
        image_id = image.getexif().get(Image.ExifTags.Base.ImageID)
    except Exception:  # noqa: BLE001 (vLLM tolerates malformed EXIF the same way)
        image_id = None
    if isinstance(image_id, uuid.UUID):
        return _Leaf(list(_framed(image_id.bytes)))
    data = {"mode": image.mode, "data": np.asarray(image)}
    if image.palette is not None:
        data["palette"] = image.palette.palette
        if image.palette.rawmode is not None:
            data["palette_rawmode"] = image.palette.rawmode
    return _Leaf(list(_item("image", data)))


def _framed(chunk: bytes | memoryview) -> Iterator[bytes | memoryview]:
    size = chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)
    yield size.to_bytes(_LENGTH, "little")
    yield chunk


def _item(key: str, value) -> Iterator[bytes | memoryview]:
    """iter_item_to_bytes(key, value)."""
    yield from _framed(key.encode())
    yield from _value(value)


def _value(value) -> Iterator[bytes | memoryview]:
    """iter_value_to_bytes: containers tagged with their length, anything else a leaf."""
    if value is None:
        yield _NONE
    elif isinstance(value, (list, tuple)):
        yield _SEQUENCE
        yield len(value).to_bytes(_LENGTH, "little")
        for v in value:
            yield from _value(v)
    elif isinstance(value, dict):
        yield _MAPPING
        yield len(value).to_bytes(_LENGTH, "little")
        for k, v in value.items():
            yield from _framed(str(k).encode())
            yield from _value(v)
    else:
        yield _LEAF
        yield from _leaf(value)


def _leaf(value) -> Iterator[bytes | memoryview]:
    """serialize_item for the leaves an image's hash holds."""
    if isinstance(value, _Leaf):
        yield from value.chunks
    elif isinstance(value, (bytes, memoryview)):
        yield from _framed(value)
    elif isinstance(value, str):
        yield from _framed(value.encode())
    elif isinstance(value, (int, float)):
        yield from _framed(np.array(value).tobytes())
    elif isinstance(value, np.ndarray):
        if value.ndim == 0:
            data = value.item()
        elif value.flags.c_contiguous:
            data = value.view(np.uint8).data
        else:
            data = value.tobytes()
        yield from _item("ndarray", {"dtype": value.dtype.str, "shape": value.shape, "data": data})
    else:  # vLLM pickles what it has no rule for; an image's hash never reaches that
        raise TypeError(f"no serialisation for {type(value).__name__}")


class Ids:
    """An identifier rule: "sha256", or "vllm" with the model vLLM is started with."""

    def __init__(self, rule: str = "sha256", model: str | None = None):
        if rule not in RULES:
            raise BadInput(f"the identifier rule is one of {', '.join(RULES)}, got {rule!r}")
        if rule == "vllm" and not model:
            raise BadInput("vLLM's identifiers need the model vLLM is started with", limit="vllm_model")
        if rule == "vllm":
            _blake3()  # without it: fail now, not at the first item
        self.rule, self.model = rule, model

    def __call__(self, kind: str, data: bytes | None, digest: str | None = None) -> str:
        """The identifier of an item of `kind` ("image" / "video") with these bytes (`digest`: their
        sha256 when known)."""
        if self.rule == "vllm" and kind == "image":
            if data is None:
                raise BadInput("vLLM's identifier of an image needs its bytes")
            return vllm_image_id(self.model, data)
        if digest is not None:
            return digest
        if data is None:
            raise BadInput("an item's identifier needs its bytes or their sha256")
        return sha256_id(data)

    def __repr__(self) -> str:
        return f"Ids({self.rule!r}{f', model={self.model!r}' if self.model else ''})"
