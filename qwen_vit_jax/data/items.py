"""One input, prepared: the typed item every consumer takes (the encode loop, `qvj.data.load`'s
users, the service), and `prepare`, the one function that makes it. No jax here: workers run it.

    item = prepare(Job("clip.mp4", "clip.mp4"), enc.preprocessing, budget=16384)
    item.grid, item.timestamps      # the whole input's, known before a frame is decoded
    for piece in item.pieces:       # a video's frame groups, decoded as they are read
        ...

`prepare` tells an image from a video (a request says; a file by suffix, else by content), reads
the bytes once (a path, a dataset record, a request's payload: nothing goes to a temporary file),
hashes them once (a digest already known is taken as it is), applies the sampling (a request's
fps over the preprocessing: `Preprocessing.with_limits`, the one place that says what fps= does),
checks `Limits` before decoding and raises typed errors (qwen_vit_jax.errors). `stream` runs it in
a worker: the item's header, then its pieces, as messages (data/workers.py carries them).

Names, one meaning each:
  job     what to prepare: a name, a source, its kind if known, a request's fps, a known digest
  item    one input, prepared: kind, digest, grid, timestamps and its pieces (`Item`)
  piece   a run of an item's patch rows: an image's rows, or a group of a video's temporal patches
          (`preprocess.video.Piece`); an item's pieces concatenated are its rows
  limits  what an item may cost, checked before decoding (`Limits`)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from qwen_vit_jax.data.inputs import draft_size, is_video, load_image
from qwen_vit_jax.data.sources import Record, RecordReader
from qwen_vit_jax.errors import Error, TooLarge
from qwen_vit_jax.preprocess.config import PreprocessConfig, Preprocessing

if TYPE_CHECKING:
    from qwen_vit_jax.plan.contract import Patches
    from qwen_vit_jax.preprocess.video import Piece

KINDS = ("image", "video")


@dataclasses.dataclass(frozen=True)
class Job:
    """What to prepare. source: a file path, a `sources.Record`, bytes, or a decoded image (a PIL
    image or an HxWx3 uint8 array). kind: "image" / "video", None to tell by suffix and content.
    fps: a request's sampling for a video (None: the preprocessing's). digest: the bytes' sha256
    when the caller has it (a service hashes a request's items once)."""

    name: str
    source: object
    kind: str | None = None
    fps: float | None = None
    digest: str | None = None


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one item may cost, checked before anything is decoded (None: no bound).

    frame_pixels: pixels of a video frame as its container announces it ("default": Pillow's
      MAX_IMAGE_PIXELS, the bound images get). frame_patches: patches of a video frame once resized.
    video_patches: a video's patches in all (t * h * w).
    """

    frame_pixels: int | None | str = "default"
    frame_patches: int | None = None
    video_patches: int | None = None


@dataclasses.dataclass(eq=False)
class Item:
    """One input, prepared.

    name: its path, key or "image i". kind: "image" or "video". digest: the sha256 of its bytes
    (an in-memory image: of its pixels). grid: int64 [1, 3] (t, h, w) of the whole input.
    timestamps: float64 [t] seconds per temporal patch (NaN: an image, or a model that reads no
    time). pieces: its patch rows (`preprocess.video.Piece`s, raw uint8): a tuple in hand, or an
    iterator a long video is decoded through as it is read (read it once). config: the
    PreprocessConfig of its kind (what turns rows into `Patches`); None in a worker's header.
    frames: frames sampled (1 for an image). note: a line for the log. capped: a line when a
    video's max_frames changed what was asked. seconds: its preparation time (up to its first
    piece). error: "Type: message" when it could not be prepared (then no pieces); failure: the
    errors kind of that ("bad_input", "too_large", "unsupported"; "missing" for a decoder this
    machine lacks; None for another library's error, e.g. Pillow's).
    """

    name: str
    kind: str = "image"
    digest: str | None = None
    grid: np.ndarray | None = None
    timestamps: np.ndarray | None = None
    pieces: Iterable[Piece] | None = None
    config: PreprocessConfig | None = None
    frames: int = 1
    note: str | None = None
    capped: str | None = None
    seconds: float = 0.0
    error: str | None = None
    failure: str | None = None
    _joined: Patches | None = dataclasses.field(default=None, repr=False)

    @property
    def is_video(self) -> bool:
        return self.kind == "video"

    @property
    def message(self) -> str | None:
        """The error without its type's name (what a client is told)."""
        return None if self.error is None else self.error.partition(": ")[2] or self.error

    def patch_pieces(self) -> Iterator[tuple[Patches, np.ndarray, Piece]]:
        """(uint8 `Patches`, grid int64 [1, 3], piece) per piece, in order: what a device call takes."""
        for p in self.pieces:
            yield patches_of(p.rows, self.config), np.asarray([p.grid], np.int64), p

    @property
    def patches(self) -> Patches:
        """Every row of the item as one `Patches` (a streamed video is read whole here, once: the
        pieces are dropped and the joined rows kept, so that it may be read again)."""
        from qwen_vit_jax.plan.contract import Patches

        if self._joined is None:
            parts = [px for px, _, _ in self.patch_pieces()]
            self._joined = parts[0] if len(parts) == 1 else Patches.concatenate(parts)
            self.pieces = None
        return self._joined


def patches_of(rows: np.ndarray, config: PreprocessConfig) -> Patches:
    """A piece's uint8 rows [N, S, p, p, 3] as `Patches` of `config`'s pixel table (computed once
    per config: the encode loop and the service make one per piece)."""
    from qwen_vit_jax.plan.contract import Patches

    return Patches(rows, _pixel_table(config), config.temporal_patch_size)


@functools.lru_cache(maxsize=16)
def _pixel_table(config: PreprocessConfig) -> np.ndarray:
    from qwen_vit_jax.preprocess.images import pixel_table

    return pixel_table(config)


def prepare(
    job: Job,
    preprocessing: Preprocessing,
    *,
    limits: Limits = Limits(),
    budget: int | None = None,
    fast_decode: bool = False,
    reader: RecordReader | None = None,
) -> Item:
    """The item of `job` under `preprocessing` (module docstring). A video's pieces hold at most
    `budget` patches each (None: one piece) and are decoded as they are read. Raises the typed
    errors of preparation (BadInput and VideoError, TooLarge, Unsupported), OSError for a file that
    cannot be read, ImportError without PyAV for a video."""
    t0 = time.perf_counter()
    source, kind = job.source, job.kind
    if isinstance(source, Record):
        video = source.is_video if kind is None else kind == "video"
        source = (reader or RecordReader()).read(source)  # bytes, or a file's path
        kind = kind or ("video" if video or (isinstance(source, str) and is_video(source)) else "image")
    elif kind is None:
        kind = "video" if isinstance(source, (str, os.PathLike)) and is_video(os.fspath(source)) else "image"
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "video":
        item = _video(job, source, preprocessing, limits, budget)
    else:
        item = _image(job, source, preprocessing, fast_decode)
    item.seconds = time.perf_counter() - t0
    return item


def _image(job: Job, source, p: Preprocessing, fast_decode: bool) -> Item:
    from qwen_vit_jax.preprocess.images import image_patches
    from qwen_vit_jax.preprocess.video import Piece

    if isinstance(source, (str, os.PathLike)):  # read once: hashed, then decoded from memory
        with open(source, "rb") as f:
            source = f.read()
    if isinstance(source, (bytes, bytearray, memoryview)):
        digest = job.digest or hashlib.sha256(source).hexdigest()
        draft = draft_size(source, p.image, p.variant) if fast_decode else None
        source = load_image(source, draft_to=draft, name=job.name)
    else:
        digest = job.digest or _pixels_digest(source)
    rows, grid = image_patches(source, p.image, p.variant, job.name)
    piece = Piece(rows, tuple(grid), None, 0)
    return Item(job.name, "image", digest, np.asarray([grid], np.int64), np.full(1, np.nan), (piece,), p.image)


def _video(job: Job, source, p: Preprocessing, limits: Limits, budget: int | None) -> Item:
    from qwen_vit_jax.preprocess.video import open_plan, video_pieces
    from qwen_vit_jax.preprocess.video_io import named

    cfg = p.with_limits(fps=job.fps).video if job.fps is not None else p.video
    digest = job.digest or _digest(source)
    plan = open_plan(source, cfg, name=job.name, max_pixels=limits.frame_pixels)
    t, h, w = plan.grid
    if limits.frame_patches is not None and h * w > limits.frame_patches:
        raise TooLarge(
            named(job.name, f"each frame is {h}x{w} = {h * w:,} patches; at most {limits.frame_patches:,} per frame"),
            limit="max_item_patches",
        )
    if limits.video_patches is not None and plan.patches > limits.video_patches:
        raise TooLarge(
            named(job.name, f"{plan.frames} frames of {h}x{w} = {plan.patches:,} patches; at most ")
            + f"{limits.video_patches:,} per video (fewer frames: fps or max_frames)",
            limit="max_video_patches",
        )
    ts = plan.timestamps
    times = "no timestamps" if ts is None else f"{ts[0]:.2f}..{ts[-1]:.2f} s"
    note = f"video {job.name}: {t} x {h}x{w} patches ({plan.patches // cfg.merge_size**2:,} tokens), {times}"
    pieces = video_pieces(source, plan, cfg, budget=budget, name=job.name, max_pixels=_frame_pixels(limits))
    stamps = np.full(t, np.nan) if ts is None else np.asarray(ts, np.float64)
    grid = np.asarray([plan.grid], np.int64)
    return Item(job.name, "video", digest, grid, stamps, pieces, cfg, plan.frames, note, plan.capped)


def _frame_pixels(limits: Limits) -> int | None:
    """The bound on a video frame's pixels (the decoder refuses a frame that grows past it)."""
    from qwen_vit_jax.preprocess.video import max_frame_pixels

    return max_frame_pixels() if limits.frame_pixels == "default" else limits.frame_pixels


def _digest(source) -> str:
    """sha256 of a video's bytes (a file's: read in blocks)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return hashlib.sha256(source).hexdigest()
    h = hashlib.sha256()
    with open(source, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pixels_digest(image) -> str:
    """An in-memory image's digest: its mode or dtype, shape and pixels."""
    if hasattr(image, "tobytes") and hasattr(image, "mode"):  # PIL
        head, data = f"PIL {image.mode} {image.size}", image.tobytes()
    else:
        a = np.ascontiguousarray(image)
        head, data = f"array {a.dtype} {a.shape}", a.tobytes()
    return hashlib.sha256(head.encode() + b"\0" + data).hexdigest()


def failed(name: str, e: BaseException, where: str = "", seconds: float = 0.0) -> Item:
    """The item of a job that could not be prepared: its error in words and its kind."""
    if isinstance(e, ImportError):  # a decoder this machine lacks: not the input's fault
        kind = "missing"
    else:  # None: a failure without a type of ours (a decoder's own error): bad input all the same
        kind = e.kind if isinstance(e, Error) else None
    return Item(name, error=f"{where}{type(e).__name__}: {e}", failure=kind, seconds=seconds)


def stream(preprocessing: Preprocessing, limits: Limits, budget: int | None, job: Job) -> Iterator:
    """A worker's job (data/workers.WorkerPool): the item's header (the item without pieces or
    config), then its pieces, one message each; a failure at any point is an error item (a failed
    header, or after pieces: the item is void)."""
    t0 = time.perf_counter()
    try:
        item = prepare(job, preprocessing, limits=limits, budget=budget)
        pieces, item.pieces, item.config = item.pieces, None, None
        yield item
        yield from pieces
    except Exception as e:  # noqa: BLE001 (any decoder / preprocessing failure: named in its place)
        yield failed(job.name, e, seconds=time.perf_counter() - t0)
