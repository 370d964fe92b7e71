"""A POST /v1/embeddings body -> its items, strictly: what the schema does not allow is refused before
it is parsed any further.

    req = parse(body, settings, bound)    # Request(items, fmt, deepstack, resized); errors.* otherwise

The schema: {"input": [{"image": B} | {"video": B, "fps": F}, ...], "encoding_format": "float" |
"base64", "return_deepstack": bool, "model": S, "user": S}, B base64 or a data: URL, F in (0, 120],
S a string of at most MAX_NAME characters (OpenAI's fields, accepted and ignored). Any other field,
a value of another type, a repeated field or more than max_items items is refused (400, 413 for the
items) at the first character that shows it: a `"user"` holding ten million empty lists costs a
scan of its first byte, not a parse of 30 MB into Python objects. `json` parses a whole document
before anything can look at it, so the body is walked here by hand, its strings and numbers read
with `json`'s own scanners. Bytes only: a value that looks like a path or a URL is refused, never
opened. An image's size is read from its header (images.py) and checked against max_image_pixels
and the per-item bound before any decoding.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import json.decoder
import re

from qwen_vit_jax import errors
from qwen_vit_jax.serve.images import header_size
from qwen_vit_jax.serve.service import Input

MAX_NAME = 256  # characters of "model" and "user" (OpenAI's user ids are short)
FIELDS = ("input", "encoding_format", "return_deepstack", "model", "user")
_SPACE = re.compile(r"[ \t\r\n]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_B64_SPACE = re.compile(r"[ \t\r\n]+")


@dataclasses.dataclass(frozen=True)
class Request:
    items: list[Input]
    fmt: str  # "float" or "base64"
    deepstack: bool
    resized: int  # images the per-item bound resizes down


class _Scan:
    """A cursor over the body's text; each read either returns a value or raises BadInput."""

    def __init__(self, text: str):
        self.text, self.i = text, 0

    def space(self) -> str:
        """Skip whitespace; the next character ("" at the end)."""
        self.i = _SPACE.match(self.text, self.i).end()
        return self.text[self.i : self.i + 1]

    def expect(self, char: str, what: str) -> None:
        if self.space() != char:
            raise errors.BadInput(f"the body is not JSON (of the schema): {what} expected at character {self.i}")
        self.i += 1

    def string(self, what: str) -> str:
        if self.space() != '"':
            raise errors.BadInput(f"{what} must be a string")
        try:
            value, self.i = json.decoder.scanstring(self.text, self.i + 1)
        except json.JSONDecodeError as e:
            raise errors.BadInput(f"the body is not JSON: {e}") from None
        return value

    def number(self, what: str):
        m = _NUMBER.match(self.text, self.i) if self.space() in "-0123456789" else None
        if m is None or not m.group():
            raise errors.BadInput(f"{what} must be a number")
        self.i = m.end()
        text = m.group()
        return float(text) if any(c in text for c in ".eE") else int(text)

    def boolean(self, what: str) -> bool:
        self.space()
        for word, value in (("true", True), ("false", False)):
            if self.text.startswith(word, self.i):
                self.i += len(word)
                return value
        raise errors.BadInput(f"{what} must be true or false")

    def members(self, what: str):
        """Yield an object's keys (the cursor then at its value), each once."""
        self.expect("{", what)
        seen = set()
        if self.space() == "}":
            self.i += 1
            return
        while True:
            if self.space() != '"':
                raise errors.BadInput(f"the body is not JSON: a field name expected at character {self.i}")
            key = self.string("a field name")
            if key in seen:
                raise errors.BadInput(f"{what}: the field {key!r} is given twice")
            seen.add(key)
            self.expect(":", "':'")
            yield key
            if self.space() == ",":
                self.i += 1
                continue
            self.expect("}", "',' or '}'")
            return

    def elements(self, what: str):
        """Yield once per element of an array (the cursor then at the element)."""
        self.expect("[", what)
        if self.space() == "]":
            self.i += 1
            return
        while True:
            yield
            if self.space() == ",":
                self.i += 1
                continue
            self.expect("]", "',' or ']'")
            return


def parse(body: bytes, s, bound) -> Request:
    """The body -> Request; BadInput / TooLarge / Unsupported naming the field or item that is wrong.
    `s`: the Settings (max_items, max_image_pixels); `bound`: the service's ItemBound."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise errors.BadInput(f"the body is not JSON: not UTF-8 ({e.reason} at byte {e.start})") from None
    scan = _Scan(text)
    first = scan.space()
    if first != "{":
        if first and first in '["-0123456789tfn':
            raise errors.BadInput("the body must be a JSON object with an `input` list")
        raise errors.BadInput("the body is not JSON: an object expected")
    raw, fmt, deepstack = None, "float", False
    for key in scan.members("the body"):
        if key == "input":
            raw = _inputs(scan, s.max_items)
        elif key == "encoding_format":
            fmt = scan.string("encoding_format") if scan.space() == '"' else None
            if fmt not in ("float", "base64"):
                raise errors.BadInput(f'encoding_format must be "float" or "base64", got {_shown(fmt)}')
        elif key == "return_deepstack":
            deepstack = scan.boolean("return_deepstack")
        elif key in ("model", "user"):
            value = scan.string(f"`{key}` (OpenAI's schema: a string of at most {MAX_NAME} characters)")
            if len(value) > MAX_NAME:
                raise errors.BadInput(f"`{key}` holds {len(value):,} characters; at most {MAX_NAME}")
        else:
            raise errors.BadInput(f"unknown fields [{key!r}]; known: {', '.join(FIELDS)}")
    if scan.space():
        raise errors.BadInput(f"the body is not JSON: extra data at character {scan.i}")
    if not raw:
        raise errors.BadInput('`input` must be a non-empty list of {"image": ...} / {"video": ...} objects')
    items, resized = [], 0
    for i, (kind, value, fps) in enumerate(raw):
        where = f"input[{i}]"
        payload = _bytes(where, value)
        if kind == "image":
            resized += _check_image(where, payload, s, bound)
        items.append(Input(kind, payload, hashlib.sha256(payload).hexdigest(), None if fps is None else float(fps)))
    return Request(items, fmt, deepstack, resized)


def _inputs(scan: _Scan, max_items: int) -> list[tuple[str, str, float | None]]:
    """The `input` list -> [(kind, its string, fps)], refused at the first item past max_items."""
    if scan.space() != "[":
        raise errors.BadInput('`input` must be a non-empty list of {"image": ...} / {"video": ...} objects')
    out = []
    for _ in scan.elements("`input`"):
        i = len(out)
        where = f"input[{i}]"
        if i == max_items:
            raise errors.TooLarge(f"at least {i + 1} items in one request; at most {max_items}", limit="max_items")
        if scan.space() != "{":
            raise errors.BadInput(f'{where}: an item is an object, {{"image": B64}} or {{"video": B64, "fps": F}}')
        fields: dict = {}
        for key in scan.members(where):
            if key in ("image", "video"):
                if scan.space() != '"':
                    raise errors.BadInput(f"{where}: the bytes must be a non-empty base64 string or a data: URL")
                fields[key] = scan.string(where)
            elif key == "fps":
                fields[key] = fps = scan.number(f"{where}: fps") if scan.space() in "-0123456789" else None
                if fps is None or not 0 < fps <= 120:
                    raise errors.BadInput(f"{where}: fps must be a number in (0, 120], got {_shown(fps)}")
            else:
                raise errors.BadInput(f"{where}: unknown fields [{key!r}] for an item (image, video, fps)")
        kinds = [k for k in ("image", "video") if k in fields]
        if len(kinds) != 1:
            raise errors.BadInput(f'{where}: give exactly one of "image" and "video"')
        if "fps" in fields and kinds[0] != "video":
            raise errors.BadInput(f"{where}: unknown fields ['fps'] for an image item")
        out.append((kinds[0], fields[kinds[0]], fields.get("fps")))
    return out


def _shown(value) -> str:
    return "another type" if value is None else repr(value)[:40]


def _bytes(where: str, value: str) -> bytes:
    """base64 (standard alphabet; whitespace such as MIME's line breaks ignored) or a data: URL's
    base64 part -> bytes. Nothing else: a path or a URL is refused, never opened."""
    if not value:
        raise errors.BadInput(f"{where}: the bytes must be a non-empty base64 string or a data: URL")
    if _B64_SPACE.search(value):  # `base64` without -w0, Python's encodebytes: lines of 76
        value = _B64_SPACE.sub("", value)
    if value.startswith("data:"):
        head, sep, value = value.partition(",")
        if not sep or not head.endswith(";base64"):
            raise errors.BadInput(f"{where}: a data: URL must be base64 (data:<type>;base64,...)")
    elif "://" in value[:16] or value.startswith(("/", "~", ".")) and not _looks_base64(value):
        raise errors.BadInput(
            f"{where}: only bytes are accepted (base64 or a data: URL); paths and URLs are not opened"
        )
    try:
        payload = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise errors.BadInput(f"{where}: not valid base64 ({e})") from None
    if not payload:
        raise errors.BadInput(f"{where}: empty bytes")
    return payload


def _looks_base64(value: str) -> bool:
    return len(value) % 4 == 0 and all(c.isalnum() or c in "+/=" for c in value[:64])


def _check_image(where: str, payload: bytes, s, bound) -> bool:
    """The image's size from its header (no decoding): TooLarge past max_image_pixels or (refused,
    not resized) past the per-item bound. Whether the bound resizes it down."""
    try:
        _, w, h = header_size(payload)
    except errors.Error as e:
        raise e.at(where) from None
    if w * h > s.max_image_pixels:
        raise errors.TooLarge(
            f"{where}: the image is {w}x{h} = {w * h:,} pixels; at most {s.max_image_pixels:,}",
            limit="max_image_pixels",
        )
    try:
        over = bound.image_over(w, h)
    except ValueError as e:  # a size no resize rule takes (aspect ratio over 200)
        raise errors.BadInput(f"{where}: {e}") from None
    if over is not None:
        raise errors.TooLarge(f"{where}: {over}", limit="max_item_patches")
    return bound.resized(w, h)
