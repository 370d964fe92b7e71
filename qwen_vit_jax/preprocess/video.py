"""Videos as users bring them: decode a file (PyAV, streaming), sample frames and size them exactly as
transformers 5.24's `Qwen2VLVideoProcessor` (Qwen2-VL, Qwen2.5-VL) and `Qwen3VLVideoProcessor`
(Qwen3-VL, Qwen3.5) do, then the image pipeline of images.py per frame and HF's video patch layout.

    pv, grid, ts = qvj.preprocess_video("clip.mp4", fps=2.0)                 # a file; ts [0.0, 1.0, ...]
    pv, grid, ts = qvj.preprocess_video(frames, source_fps=30.0, fps=2.0)    # decoded frames
    pv, grid, ts = qvj.preprocess_video("clip.mp4", config=video_config_for(ckpt_dir, variant))  # a checkpoint's

Without `config` a call follows a released Qwen2.5-VL checkpoint (`DEFAULT_CONFIG`: HF's video
processor as `AutoProcessor.from_pretrained("Qwen/Qwen2.5-VL-...")` builds it from the hub's
preprocessor_config.json: pixels 3,136 .. 12,845,056 per frame, Qwen2.5-VL's timestamps), what
`encode` and `enc.encode_video` give with such a checkpoint (and with the demo's tower). A Qwen2-VL
checkpoint's config gives ts None (its model reads no time), as does a list of frames without
`source_fps`.

Sampling (which frames), per `PreprocessConfig.video_sampler`:
  qwen2-vl / qwen2.5-vl (HF `Qwen2VLVideoProcessor.sample_frames`):
    num_frames: rounded half to even to a multiple of temporal_patch_size T.
    fps: n = total / source_fps * fps, clamped to [min_frames, min(max_frames, total) floored to a
      multiple of T], then floored to a multiple of T.
    neither: every frame (HF), or, past max_frames, max_frames floored to a multiple of T, spread
      as num_frames spreads them (HF takes every frame: ours bounds every video, on purpose).
    indices: `torch.arange(0, total, total / n).int()`: i * (total / n) in float64, rounded to float32,
      truncated. The float32 rounding matters: 462 frames at 24 fps, fps 2 -> n 38, and index 19 is
      231 (float64 would give 230).
  qwen3-vl (HF `Qwen3VLVideoProcessor.sample_frames`):
    fps: n = int(total / source_fps * fps), clamped to [min_frames, max_frames] and to total;
    num_frames: used as given; neither: min(max(total, min_frames), max_frames).
    indices: `np.linspace(0, total - 1, n).round()` (half to even; repeats when n > total).
  The config's fps / num_frames apply when `do_sample_frames` is set (HF: Qwen3-VL yes, Qwen2-VL no:
  all frames) and the call passes neither. Arguments differ from HF in three places, on purpose:
    * fps= / num_frames= passed to a call always sample (HF ignores them when do_sample_frames is off);
    * max_frames (a call's max_frames=, else the config's) bounds every video, with or without fps
      and num_frames: a longer clip without sampling gets max_frames frames spread evenly, and
      num_frames= over it is lowered to it (HF takes every frame, and any num_frames; HF's Qwen3-VL
      reads min / max frames only from its config: ours equals HF's processor built with that
      max_frames). `plan_video` says when the bound changed what was asked (`VideoPlan.capped`);
    * decoded frames without source_fps are taken as they are unless num_frames= is given (HF's
      Qwen3-VL would sample them at its default fps, assuming a 24 fps source).

Sizing (one size for the whole video): qwen2 samplers smart_resize each frame's (H, W) within
[min_pixels, max_pixels]; qwen3-vl applies a 3-D smart_resize: max_pixels bounds frames x pixels
(t rounded to T), and frames under one merge unit are first scaled up. With `cap_pixels_per_frame`
(HF's per-frame share of `max_video_tokens`, as qwen-vl-utils) the bound is tightened as HF does.

Pixels: HF's video processors resize with torchvision, whose bicubic differs from PIL's; ours resize
each frame with PIL exactly as HF's torchvision-free image processor (`Qwen2VLImageProcessorPil`) does,
bit for bit, and equal HF's video processors' sampled indices, grid and timestamps exactly. How far
the two HF backends' pixels lie apart is measured by benchmarks/video_reference.py.

Timestamps (seconds, float64 [grid_t], one per temporal patch; None when the source fps is unknown):
  qwen2-vl: None (the model reads no time).
  qwen2.5-vl: patch i at i * second_per_grid_ts, where HF's second_per_grid_ts = T / sampled_fps and
    sampled_fps = frames sampled / total * source_fps: so second_per_grid_ts = ts[1] - ts[0] (a
    one-patch video has no second patch, and its positions do not depend on it).
  qwen3-vl: the mean of the first and last frame time of each patch (index / source_fps), the last
    sampled frame repeated to fill the last patch: HF's `_calculate_timestamps`, what the prompt prints.

Decoding is streaming (video_io.py: the one file or bytes given, containers on an allow-list):
frames are decoded in order (the codec needs them all) but only sampled ones are converted to RGB
and resized, and decoding stops after the last sampled frame. Everything a video becomes (indices,
size, grid, timestamps) is decided from its container before a frame is decoded (`plan_video`);
`video_pieces` then yields its patch rows a group of temporal patches at a time, so memory follows
the group, not the video (`VisionEncoder.iter_video`, `encode` and the service stream so;
`preprocess_video` returns the whole video in one piece). The frame count and rate come from the
container as HF's PyAV reader reads them (`stream.frames`, `stream.average_rate`); containers that do
not record the count (WebM, some MKV) are counted by demuxing, without decoding. A file that cannot
be opened, has no video stream or ends before a sampled frame raises VideoError naming it; a
container off the allow-list Unsupported; frames over Pillow's MAX_IMAGE_PIXELS (the bound images
get) TooLarge, before any is decoded.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from qwen_vit_jax.preprocess.config import MAX_VIDEO_TOKENS, PreprocessConfig
from qwen_vit_jax.preprocess.images import patch_bytes, patches_of, resize, smart_resize, smart_resize_3d, to_hwc3
from qwen_vit_jax.preprocess.video_io import (
    VideoError,
    VideoInfo,
    check_frame_pixels,
    decode,
    probe,
    source_name,
)

if TYPE_CHECKING:
    from qwen_vit_jax.plan.contract import Patches

__all__ = ["DEFAULT_CONFIG", "VideoError", "VideoInfo", "VideoPlan", "plan_video", "preprocess_video", "probe"]

# What a call without `config` follows: a released Qwen2.5-VL checkpoint's video processor (its
# preprocessor_config.json's pixel range, HF's Qwen2VLVideoProcessor otherwise, Qwen2.5-VL's
# timestamps): what `encode` gives with such a checkpoint. A user passing fps= gets seconds back.
DEFAULT_CONFIG = dataclasses.replace(
    PreprocessConfig.from_hf({"min_pixels": 3136, "max_pixels": 12845056}, video=True), video_sampler="qwen2.5-vl"
)


def max_frame_pixels() -> int | None:
    """The library's bound on a video frame's pixels: what Pillow warns about for an image
    (`Image.MAX_IMAGE_PIXELS`, read at each call; None: no bound). 8K video is a third of it."""
    return Image.MAX_IMAGE_PIXELS


# ---- sampling -------------------------------------------------------------------------------------
def sample_indices(
    total: int, source_fps: float | None, cfg: PreprocessConfig, *, fps: float | None, num_frames: int | None
) -> np.ndarray:
    """The frame indices HF's video processor of `cfg.video_sampler` samples from a `total`-frame video,
    never more than `cfg.max_frames` (module docstring: where that differs from HF).

    Args:
      total: frames in the video (HF's `total_num_frames`).
      source_fps: its frame rate (HF's `VideoMetadata.fps`); needed for fps sampling.
      cfg: min_frames / max_frames / temporal_patch_size / video_sampler come from here.
      fps, num_frames: the request (at most one); neither: every frame up to max_frames (qwen2) or
        min(max(total, min_frames), max_frames) spread evenly (qwen3).
    Returns:
      int64 [n] frame indices, non-decreasing.
    """
    if fps is not None and num_frames is not None:
        raise ValueError("fps and num_frames are mutually exclusive: pass one")
    if total <= 0:
        raise ValueError(f"the video has no frames (total {total})")
    if fps is not None and not source_fps:
        raise ValueError(f"sampling at fps={fps} needs the video's frame rate: pass source_fps= with decoded frames")
    T = cfg.temporal_patch_size
    if num_frames is not None:
        num_frames = min(num_frames, cfg.max_frames)
    if cfg.video_sampler == "qwen3-vl":
        if fps is not None:
            n = int(total / source_fps * fps)
            n = min(max(n, cfg.min_frames), cfg.max_frames, total)
        elif num_frames is not None:
            n = num_frames
        else:
            n = min(max(total, cfg.min_frames), cfg.max_frames)
        return np.linspace(0, total - 1, n).round().astype(np.int64)
    if num_frames is not None:
        n = round(num_frames / T) * T  # Python round: half to even, as HF
    elif fps is not None:
        most = math.floor(min(cfg.max_frames, total) / T) * T
        n = min(max(total / source_fps * fps, cfg.min_frames), most, total)
        n = math.floor(n / T) * T
    elif total <= cfg.max_frames:
        return np.arange(total, dtype=np.int64)
    else:  # every frame would be over max_frames: that many, spread evenly
        n = math.floor(cfg.max_frames / T) * T
    if n > total:
        raise ValueError(f"cannot sample {n} frames from a {total}-frame video: ask for fewer frames or a lower fps")
    if n <= 0:
        raise ValueError(
            f"{total} frames at this rate, at most max_frames {cfg.max_frames}, give {n} frames to sample "
            f"(a multiple of {T}): ask for more"
        )
    step = total / n  # float64, as the Python scalar torch.arange receives
    count = math.ceil(total / step)  # torch's arange length
    # torch.arange(0, total, step) in float32: each value computed in float64, then rounded to float32
    return (np.arange(count, dtype=np.float64) * step).astype(np.float32).astype(np.int64)


def frame_size(n: int, height: int, width: int, cfg: PreprocessConfig) -> tuple[int, int]:
    """The (height, width) every frame of an n-frame video is resized to, as HF's video processor sizes it."""
    factor, lo, hi = cfg.factor, cfg.min_pixels, cfg.max_pixels
    tokens = cfg.max_video_tokens or MAX_VIDEO_TOKENS[cfg.video_sampler]
    T = cfg.temporal_patch_size
    if cfg.video_sampler != "qwen3-vl":
        if cfg.cap_pixels_per_frame:  # an even share of 90% of `tokens` merged tokens' pixels per frame
            total_pixels = int(tokens * factor * factor * 0.9)
            hi = max(min(hi, total_pixels * T // n), int(lo * 1.05))
        return smart_resize(height, width, factor, lo, hi)
    if cfg.cap_pixels_per_frame:  # per frame at most `tokens` merge units, or an even share of the budget
        hi = max(min(tokens * factor * factor, hi // n), int(lo * 1.05)) * n
    return smart_resize_3d(n, height, width, T, factor, lo, hi)


def timestamps_of(indices: np.ndarray, source_fps: float | None, total: int, cfg: PreprocessConfig):
    """Seconds per temporal patch for `cfg.video_sampler` (module docstring), or None."""
    if cfg.video_sampler == "qwen2-vl" or not source_fps:
        return None
    T = cfg.temporal_patch_size
    gt = -(-len(indices) // T)
    if cfg.video_sampler == "qwen2.5-vl":
        sampled_fps = len(indices) / total * source_fps
        return np.arange(gt, dtype=np.float64) * (T / sampled_fps)
    # [gt, T] frame indices, the last one repeated to fill the last patch
    idx = np.concatenate([indices, np.repeat(indices[-1:], gt * T - len(indices))]).reshape(gt, T)
    return (idx[:, 0] / source_fps + idx[:, -1] / source_fps) / 2


# ---- a video's plan -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class VideoPlan:
    """What a video becomes, decided from its container (or its decoded frames) before a frame is
    decoded: the one place a video's sampling is applied.

    info: what its container says. indices: int64 [n] sampled frame indices. size: (height, width)
    in pixels every frame is resized to (None: as decoded, do_resize off). grid: (t, h, w) in patches.
    timestamps: float64 [t] seconds per temporal patch, or None. capped: a line when max_frames
    changed what was asked (the fps it gives instead, or the frames left out), else None.
    """

    info: VideoInfo
    indices: np.ndarray
    size: tuple[int, int] | None
    grid: tuple[int, int, int]
    timestamps: np.ndarray | None
    capped: str | None = None

    @property
    def frames(self) -> int:
        """Frames sampled (before the last temporal patch is filled by repeating its last frame)."""
        return len(self.indices)

    @property
    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


def sampling(cfg: PreprocessConfig, fps: float | None, num_frames: int | None, rate_known: bool):
    """(fps, num_frames) a video is sampled with: the call's, else the config's when it samples by
    default (`do_sample_frames`, HF's rule) and the source's rate is known; both None: every frame
    up to max_frames."""
    if fps is not None and num_frames is not None:
        raise ValueError("fps and num_frames are mutually exclusive: pass one")
    if fps is None and num_frames is None and cfg.do_sample_frames and rate_known:
        return cfg.fps, cfg.num_frames  # both set: ValueError in sample_indices, as HF
    return fps, num_frames


def plan_video(
    info: VideoInfo, cfg: PreprocessConfig, *, fps: float | None = None, num_frames: int | None = None
) -> VideoPlan:
    """The plan of a video whose container says `info`, under `cfg` (its max_frames included) and
    a call's fps / num_frames (`sampling`)."""
    fps, num_frames = sampling(cfg, fps, num_frames, info.fps is not None)
    indices = sample_indices(info.total_frames, info.fps, cfg, fps=fps, num_frames=num_frames)
    n, T, p = len(indices), cfg.temporal_patch_size, cfg.patch_size
    size = frame_size(n, info.height, info.width, cfg) if cfg.do_resize else None
    h, w = size if size is not None else (info.height, info.width)
    if size is None and (h % cfg.factor or w % cfg.factor):
        raise ValueError(f"do_resize=False needs sides that are multiples of {cfg.factor}, got {h}x{w}")
    capped = None
    if (free := _unbounded(info, cfg, fps, num_frames)) is not None and free > n:
        rate = f", {n / info.total_frames * info.fps:.3g} fps" if info.fps else ""
        capped = f"{n} of the {free} frames asked{rate}: at most max_frames {cfg.max_frames} per video"
    ts = timestamps_of(indices, info.fps, info.total_frames, cfg)
    return VideoPlan(info, indices, size, (-(-n // T), h // p, w // p), ts, capped)


def _unbounded(info: VideoInfo, cfg: PreprocessConfig, fps, num_frames) -> int | None:
    """How many frames the sampling would take without max_frames (None: it would fail)."""
    try:
        free = dataclasses.replace(cfg, max_frames=max(info.total_frames, cfg.min_frames, num_frames or 0))
        return len(sample_indices(info.total_frames, info.fps, free, fps=fps, num_frames=num_frames))
    except ValueError:
        return None


# ---- pieces: a video's patch rows, a group of temporal patches at a time -------------------------------
@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of a video's temporal patches (or a whole image): uint8 patch rows [t * h * w, S, p, p, 3]
    in HF's order (S = T frames of a video, 1 for an image), its grid (t, h, w), its timestamps
    float64 [t] (None: none) and the index of its first frame among the sampled frames (its first
    temporal patch is first_frame // T). A video's pieces concatenated are its rows."""

    rows: np.ndarray
    grid: tuple[int, int, int]
    timestamps: np.ndarray | None
    first_frame: int = 0


def group_size(plan: VideoPlan, budget: int | None, T: int) -> int:
    """Temporal patches per piece: as many frames as fit `budget` patches (at least one temporal
    patch; None: the whole video)."""
    t, h, w = plan.grid
    return t if budget is None else max(1, min(t, budget // (h * w)))


def video_pieces(
    source,
    plan: VideoPlan,
    cfg: PreprocessConfig,
    *,
    budget: int | None = None,
    name: str | None = None,
    max_pixels: int | None = None,
) -> Iterator[Piece]:
    """A video's patch rows as `Piece`s of at most `budget` patches (a whole number of temporal
    patches; None: one piece), decoded, converted and resized as they come: memory holds one piece.

    source: what `plan` was made of: a file path, bytes or a binary file object (decoded once, in
      order; no frame over `max_pixels` decoded), or the decoded frames (a list / array).
    """
    T = cfg.temporal_patch_size
    t, h, w = plan.grid
    g = group_size(plan, budget, T)
    name = "frame" if not is_stream(source) else (source_name(source) if name is None else name)
    positions: dict[int, list[int]] = {}  # frame index -> its positions among the sampled (qwen3 may repeat)
    for pos, i in enumerate(plan.indices.tolist()):
        positions.setdefault(i, []).append(pos)
    buf, first = None, 0  # the group being filled: uint8 [g * T, H, W, 3]

    def piece(frames: np.ndarray, first: int) -> Piece:  # [k * T, H, W, 3] -> rows
        k = len(frames) // T
        stamps = None if plan.timestamps is None else plan.timestamps[first // T : first // T + k]
        rows = patch_bytes(frames.reshape(k, T, *frames.shape[1:]), cfg)  # [k, T, H, W, 3] -> [k * h * w, T, p, p, 3]
        return Piece(rows, (k, h, w), stamps, first)

    filled = 0
    for i, frame in _frames_at(source, plan, cfg, name, max_pixels):
        for pos in positions[i]:
            if buf is None:
                buf = np.empty((g * T, *frame.shape), np.uint8)
            buf[pos - first] = frame
            filled += 1
            if filled == g * T:
                yield piece(buf, first)
                first, filled = first + g * T, 0
                buf = np.empty_like(buf) if first < plan.frames else None  # the piece keeps its own rows
    if filled:
        last = buf[filled - 1]
        pad = -filled % T
        frames = np.concatenate([buf[:filled], np.repeat(last[None], pad, axis=0)]) if pad else buf[:filled]
        yield piece(frames, first)


def is_stream(source) -> bool:
    """Whether a video source is read by PyAV (a path, bytes, a binary file object), not decoded frames."""
    return isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)) or hasattr(source, "read")


def _frames_at(source, plan: VideoPlan, cfg: PreprocessConfig, name: str, max_pixels: int | None):
    """(index, resized uint8 [H, W, 3]) of each distinct sampled index, in order."""
    size = plan.size
    if not is_stream(source):
        for i in sorted(set(plan.indices.tolist())):
            a = to_hwc3(source[i], cfg, f"frame {i}")
            if a.shape[:2] != (plan.info.height, plan.info.width):
                raise ValueError(
                    f"all frames of a video must have one size, got {a.shape[:2]} at frame {i} and "
                    f"{(plan.info.height, plan.info.width)} at frame 0"
                )
            yield i, resize(a, cfg, size)
        return
    for i, frame in decode(source, plan.indices, name=name, max_pixels=max_pixels):
        yield i, resize(to_hwc3(frame.to_ndarray(format="rgb24"), cfg, f"{name} frame {i}"), cfg, size)


def open_plan(
    source,
    cfg: PreprocessConfig,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    source_fps: float | None = None,
    name: str | None = None,
    max_pixels: int | None | str = "default",
) -> VideoPlan:
    """The plan of a video: a file path, bytes or a binary file object (probed: its container's
    metadata, no frame decoded, frames over `max_pixels` refused: TooLarge; "default":
    `max_frame_pixels()`), or decoded frames (a list / tuple of frames of one size or an
    [F, H, W, C] array; `source_fps` their rate, if known)."""
    if not is_stream(source):
        frames = _frames_list(source)
        if source_fps is not None and not 0 < float(source_fps) < math.inf:
            raise ValueError(f"source_fps must be a positive number, got {source_fps}")
        h, w = to_hwc3(frames[0], cfg, "frame 0").shape[:2]
        info = VideoInfo(len(frames), None if source_fps is None else float(source_fps), w, h, "frames")
    else:
        name = source_name(source) if name is None else name
        info = probe(source, name)
        bound = max_frame_pixels() if max_pixels == "default" else max_pixels
        check_frame_pixels(info, bound, name)
    return plan_video(info, cfg, fps=fps, num_frames=num_frames)


# ---- the entry point ------------------------------------------------------------------------------
def preprocess_video(
    path_or_frames,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    max_frames: int | None = None,
    source_fps: float | None = None,
    config: PreprocessConfig | None = None,
    uint8: bool = False,
) -> tuple[np.ndarray | Patches, np.ndarray, np.ndarray | None]:
    """One video -> vision-tower input, sampled and sized as HF's video processor for `config`.

    Args:
      path_or_frames: a video file (str / PathLike; decoded with PyAV), its bytes, or decoded frames:
        a list / tuple of PIL images or channels-last arrays of one size, or an [F, H, W, C] array.
      min_pixels, max_pixels: override `config`'s pixel range (per frame; Qwen3-VL: the whole clip).
      fps: sample this many frames per second (needs the source rate: a file's, or `source_fps`).
      num_frames: or sample this many frames, spread evenly (exclusive with fps).
      max_frames: override `config.max_frames`: at most this many frames, with or without fps.
      source_fps: the frame rate of decoded frames (ignored for files, whose container says it).
      config: PreprocessConfig (default `DEFAULT_CONFIG`: a released Qwen2.5-VL checkpoint's). A
        checkpoint's: `preprocess.config.video_config_for(dir, variant)` (what an encoder holds).
      uint8: return `Patches` (the T frames of each row as decoded; the device rescales and
        normalises them) instead of HF's float32 rows: the same numbers once expanded.

    Returns:
      pixel_values: float32 [gt * h * w, 3 * T * p * p]: sampled frames in runs of T (the last frame
        repeated to fill the last run), HF's row layout; with uint8, `Patches` of those rows.
      grid_thw: int64 [1, 3] = [[gt, h, w]] in patches.
      timestamps: float64 [gt] seconds per temporal patch (module docstring): with the default config
        and a file (or source_fps=), patch i at i * T / sampled fps, e.g. [0, 1, 2, 3, 4] for a 5 s clip
        at fps=2.0; None for a Qwen2-VL config, or frames without source_fps.
    """
    cfg = video_config(config, min_pixels=min_pixels, max_pixels=max_pixels, max_frames=max_frames)
    plan = open_plan(path_or_frames, cfg, fps=fps, num_frames=num_frames, source_fps=source_fps)
    (piece,) = video_pieces(path_or_frames, plan, cfg)
    patches = patches_of(piece.rows, cfg)
    return patches if uint8 else patches.to_float(), np.asarray([plan.grid], np.int64), plan.timestamps


def video_config(config: PreprocessConfig | None = None, **over) -> PreprocessConfig:
    """`config` (default DEFAULT_CONFIG) with the overrides that are not None."""
    cfg = DEFAULT_CONFIG if config is None else config
    if not isinstance(cfg, PreprocessConfig):
        raise TypeError(f"config must be a PreprocessConfig, got {type(cfg).__name__}")
    over = {k: v for k, v in over.items() if v is not None}
    return dataclasses.replace(cfg, **over) if over else cfg


def _frames_list(frames) -> list | np.ndarray:
    """Decoded frames as given, checked: a list / tuple of frames or an [F, H, W, C] array."""
    if isinstance(frames, np.ndarray):
        if frames.ndim != 4:
            raise ValueError(
                f"a video array must be [F, H, W, C], got shape {frames.shape}; pass a list for a list of frames"
            )
    elif isinstance(frames, Image.Image) or not isinstance(frames, (list, tuple)):
        raise TypeError(
            f"expected a video file path, a list of frames or an [F, H, W, C] array, got {type(frames).__name__}"
        )
    if len(frames) == 0:
        raise ValueError("video has no frames")
    return frames
