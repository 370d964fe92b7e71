"""The file side of `qwen-vit-jax encode`: finding the inputs (images and videos), loading and
preprocessing them, and the loop that encodes them into an embeddings file with progress, periodic
saves, --resume and --keep-going. cli.py parses the arguments and calls `encode_files`.

Nothing here is half-written: OUT is only ever replaced whole (embeddings.write_embeddings writes a
temporary sibling and renames it), with the inputs finished so far.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterable, Iterator

import numpy as np

from qwen_vit_jax.data.embeddings import Embeddings, read_embeddings, write_embeddings
from qwen_vit_jax.data.stream import Progress, count, prefetch
from qwen_vit_jax.preprocess.config import PreprocessConfig
from qwen_vit_jax.preprocess.images import smart_resize
from qwen_vit_jax.runtime.batching import pack

IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".jfif"}
)
VIDEO_SUFFIXES = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".wmv", ".flv", ".3gp"})
SAVE_EVERY_S = 600.0  # OUT is rewritten with the inputs done so far at most this often
RESUME_KEYS = ("checkpoint", "dtype", "preprocess", "video_preprocess")  # must match to add to a file


class EncodeError(ValueError):
    """A failure of the encode command to report as one `error: ...` line."""


@dataclasses.dataclass
class Item:
    """One preprocessed input."""

    name: str
    pixel_values: np.ndarray  # float32 [t * h * w, patch_dim]
    grid: np.ndarray  # int64 [1, 3]
    timestamps: np.ndarray  # float64 [t]: seconds per temporal patch; NaN where there are none


# ---- finding and loading inputs -------------------------------------------------------------------
def find_inputs(inputs: Iterable[str], recursive: bool = False) -> list[str]:
    """Files as given, folders expanded to their image and video files (sorted by name, hidden files
    and other suffixes skipped; sub-folders only with `recursive`). Duplicates are dropped."""
    found: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            if recursive:
                for root, dirs, files in os.walk(item):
                    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                    found += [os.path.join(root, f) for f in sorted(files) if _is_input_name(f)]
            else:
                found += sorted(
                    os.path.join(item, e.name) for e in os.scandir(item) if e.is_file() and _is_input_name(e.name)
                )
        elif os.path.isfile(item):
            found.append(item)
        else:
            raise EncodeError(f"input not found: {item}")
    return list(dict.fromkeys(os.path.normpath(p) for p in found))


def _is_input_name(name: str) -> bool:
    suffix = os.path.splitext(name)[1].lower()
    return not name.startswith(".") and (suffix in IMAGE_SUFFIXES or suffix in VIDEO_SUFFIXES)


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


def load_image(path: str):
    """Decode an image file fully, EXIF orientation applied (as HF's `load_image` does). Colour
    conversion (palette, grey, alpha onto white) is left to preprocessing."""
    from PIL import Image, ImageOps

    with Image.open(path) as im:
        im.load()
        return ImageOps.exif_transpose(im)


def load_inputs(
    paths: list[str], image_cfg: PreprocessConfig, video_cfg: PreprocessConfig, failed: list, keep_going: bool
) -> Iterator[Item]:
    """Each of `paths` loaded and preprocessed, in order (a video decoded and sampled by `video_cfg`,
    with a line on stderr). A file that fails is recorded in `failed` as (path, reason) and skipped
    with `keep_going`, else ends the inputs there (the ones before it still reach the encoder)."""
    from qwen_vit_jax.preprocess.images import preprocess_images
    from qwen_vit_jax.preprocess.video import preprocess_video

    every_frame = not (video_cfg.do_sample_frames and (video_cfg.fps or video_cfg.num_frames))
    for path in paths:
        try:
            t0 = time.perf_counter()
            if is_video(path):
                if every_frame:  # HF's Qwen2-VL processor does the same; a long clip then costs a lot
                    print(
                        "note: videos use every frame (the checkpoint's video config samples none, as HF's "
                        "Qwen2VLVideoProcessor); --fps 2 is what Qwen's own tools use",
                        file=sys.stderr,
                    )
                    every_frame = False
                pv, grid, ts = preprocess_video(path, config=video_cfg)
                t, h, w = grid[0].tolist()
                print(
                    f"video {path}: {t} x {h}x{w} patches ({pv.shape[0] // video_cfg.merge_size**2:,} tokens), "
                    f"{'no timestamps' if ts is None else f'{ts[0]:.2f}..{ts[-1]:.2f} s'}, "
                    f"decoded in {time.perf_counter() - t0:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                (pv, grid), ts = preprocess_images([load_image(path)], config=image_cfg), None
        except Exception as e:  # noqa: BLE001 (any decoder / preprocessing failure: name the file)
            reason = f"{type(e).__name__}: {e}"
            failed.append((path, reason))
            if not keep_going:
                return
            continue
        yield Item(path, pv, grid, np.full(grid[0, 0], np.nan) if ts is None else np.asarray(ts, np.float64))


def input_patches(path: str, image_cfg: PreprocessConfig, video_cfg: PreprocessConfig) -> int:
    """Patches an input will have, from headers alone (what the split across processes balances):
    an image's size, a video's container metadata with the sampling and sizing of `video_cfg`. 0 for
    a file that cannot be read: it fails later, in the one process that owns it."""
    if not is_video(path):
        return image_patches(path, image_cfg)
    from qwen_vit_jax.preprocess.video import frame_size, probe, sample_indices

    try:
        info = probe(path)
        cfg = video_cfg
        fps, num = (cfg.fps, cfg.num_frames) if cfg.do_sample_frames else (None, None)
        n = len(sample_indices(info.total_frames, info.fps, cfg, fps=fps, num_frames=num))
        h, w = frame_size(n, info.height, info.width, cfg) if cfg.do_resize else (info.height, info.width)
    except Exception:  # noqa: BLE001 (any unreadable header: the owning process reports it)
        return 0
    return -(-n // cfg.temporal_patch_size) * (h // cfg.patch_size) * (w // cfg.patch_size)


def image_patches(path: str, preprocess: PreprocessConfig) -> int:
    """Patches an image file will have after preprocessing, from its header alone (size and EXIF
    orientation; no decoding). 0 for a file PIL cannot open: it fails later, in one process."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            w, h = im.size
            if im.getexif().get(0x0112) in (5, 6, 7, 8):  # EXIF orientations that swap the sides
                w, h = h, w
        if preprocess.do_resize:
            h, w = smart_resize(h, w, preprocess.factor, preprocess.min_pixels, preprocess.max_pixels)
    except Exception:  # noqa: BLE001 (any unreadable header: the owning process reports it)
        return 0
    return (h // preprocess.patch_size) * (w // preprocess.patch_size)


# ---- resume --------------------------------------------------------------------------------------
def resume_from(target, meta: dict) -> Embeddings:
    """The embeddings already in `target`, checked to come from the same checkpoint and settings."""
    old = read_embeddings(target)
    for key in RESUME_KEYS:
        if key == "video_preprocess" and key not in old.metadata:
            continue  # written before videos were supported: it holds images only
        if old.metadata.get(key) != meta[key]:
            raise EncodeError(
                f"--resume: {target} was written with {key} {old.metadata.get(key)!r}, this run uses "
                f"{meta[key]!r}; mixing them in one file would be silently wrong"
            )
    return old


# ---- the loop ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    names: list[str]  # the inputs encoded by this run, in order
    tokens: int
    failed: list[tuple[str, str]]  # (path, reason) of the inputs skipped (--keep-going)
    seconds: float


def encode_files(
    enc,
    paths: list[str],
    target,
    meta: dict,
    old: Embeddings | None,
    *,
    video_cfg: PreprocessConfig,
    image_cfg: PreprocessConfig,
    batch_patches: int,
    keep_going: bool,
    save_empty: bool = False,
) -> Result:
    """Encode `paths` (consecutive inputs packed into calls of at most `batch_patches` patches) and
    write `old` + them to `target`.

    Saves every SAVE_EVERY_S, on Ctrl-C, and before reporting an unreadable input (without
    keep_going); EncodeError then says how to continue. With keep_going unreadable inputs are skipped
    with a warning each. When nothing could be encoded, nothing is written unless `save_empty` (a
    process of a sharded run writes its shard all the same: the set must be complete).

    Returns:
      Result: names encoded, their token count, the skipped inputs, wall seconds.
    """
    failed: list[tuple[str, str]] = []
    names: list[str] = []
    grids: list[np.ndarray] = []  # [1, 3] each
    embs: list[np.ndarray] = []  # [tokens, D] each
    stamps: list[np.ndarray] = []  # [t] each

    def save() -> None:
        new = Embeddings(
            np.concatenate([np.zeros((0, enc.cfg.out_dim), np.float32), *embs]),
            np.concatenate([np.zeros((0, 3), np.int64), *grids]),
            np.concatenate([[0], np.cumsum([len(e) for e in embs])]).astype(np.int64),
            names,
            meta,
            np.concatenate([np.zeros(0), *stamps]),
        )
        write_embeddings(target, new if old is None else Embeddings.concatenate([old, new], meta))

    t0 = last_save = time.perf_counter()
    progress = Progress(len(paths), unit="inputs")
    loads = load_inputs(paths, image_cfg, video_cfg, failed, keep_going)
    batches = prefetch(pack(loads, batch_patches, lambda item: len(item.pixel_values)))
    try:
        for batch in batches:
            grid = np.concatenate([item.grid for item in batch])  # [k, 3]
            emb = enc.encode(np.concatenate([item.pixel_values for item in batch]), grid)
            embs += np.split(emb, np.cumsum([len(item.pixel_values) // enc.cfg.merge_unit for item in batch])[:-1])
            grids += [g[None] for g in grid]
            names += [item.name for item in batch]
            stamps += [item.timestamps for item in batch]
            progress.update_to(len(names) + len(failed))  # failures are counted as processed
            if time.perf_counter() - last_save > SAVE_EVERY_S:  # a crash then costs at most this
                save()
                last_save = time.perf_counter()
        progress.update_to(len(names) + len(failed))
    except KeyboardInterrupt:
        if names:
            save()
            raise EncodeError(
                f"interrupted: {count(len(names), 'new input')} written to {target}; "
                "the same command with --resume continues"
            ) from None
        raise
    finally:
        batches.close()
        progress.close()
    seconds = time.perf_counter() - t0
    if failed and not keep_going:  # the inputs before it are encoded: keep them
        (path, reason), held = failed[0], ""
        if names:
            save()
            held = f"; the {count(len(names), 'input')} before it written to {target}, --resume continues"
        raise EncodeError(
            f"cannot read {path}: {reason}{held or '; nothing written'} (--keep-going skips unreadable inputs)"
        )
    for path, reason in failed:
        print(f"warning: skipped {path}: {reason}", file=sys.stderr)
    if not names and paths and not save_empty:
        raise EncodeError(f"none of the {len(paths)} inputs could be read; nothing written")
    save()
    return Result(names, sum(len(e) for e in embs), failed, seconds)
