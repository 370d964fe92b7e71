"""Videos as users bring them: decode a file (PyAV, streaming), sample frames and size them exactly as
transformers 5.24's `Qwen2VLVideoProcessor` (Qwen2-VL, Qwen2.5-VL) and `Qwen3VLVideoProcessor`
(Qwen3-VL, Qwen3.5) do, then the image pipeline of images.py per frame and HF's video patch layout.

    pv, grid, ts = qvj.preprocess_video("clip.mp4", fps=2.0)                 # a file; ts [0.0, 1.0, ...]
    pv, grid, ts = qvj.preprocess_video(frames, source_fps=30.0, fps=2.0)    # decoded frames
    pv, grid, ts = qvj.preprocess_video("clip.mp4", config=video_config_for(ckpt_dir, variant))  # a checkpoint's

Without `config` a call follows Qwen2.5-VL's video processor (`DEFAULT_CONFIG`: HF's
`Qwen2VLVideoProcessor` class defaults, with Qwen2.5-VL's timestamps), the same default as
`qvj.data.load` and the demo's tower; a Qwen2-VL checkpoint's config gives ts None (its model reads
no time), as does a list of frames without `source_fps`.

Sampling (which frames), per `PreprocessConfig.video_sampler`:
  qwen2-vl / qwen2.5-vl (HF `Qwen2VLVideoProcessor.sample_frames`):
    num_frames: rounded half to even to a multiple of temporal_patch_size T.
    fps: n = total / source_fps * fps, clamped to [min_frames, min(max_frames, total) floored to a
      multiple of T], then floored to a multiple of T.
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
    * max_frames= passed to a call applies to every sampler (HF's Qwen3-VL reads min / max frames
      only from its config: ours equals HF's processor built with that max_frames);
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

Decoding is streaming: frames are decoded in order (the codec needs them all) but only sampled ones
are converted to RGB and resized, decoding stops after the last sampled frame, and memory holds the
resized sampled frames only, whatever the clip's length. The frame count and rate come from the
container as HF's PyAV reader reads them (`stream.frames`, `stream.average_rate`); containers that do
not record the count (WebM, some MKV) are counted by demuxing, without decoding. A file that cannot be
opened, has no video stream or ends before a sampled frame raises VideoError naming it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from qwen_vit_jax.preprocess.config import MAX_VIDEO_TOKENS, PreprocessConfig, video_config_for
from qwen_vit_jax.preprocess.images import patch_bytes, patches_of, resize, smart_resize, smart_resize_3d, to_hwc3

if TYPE_CHECKING:
    from qwen_vit_jax.plan.contract import Patches


# What a call without `config` follows: Qwen2.5-VL's (Qwen2-VL's sampling and sizes, plus timestamps).
# Not Qwen2-VL's VIDEO_DEFAULT: a user passing fps= expects the seconds of each patch back.
DEFAULT_CONFIG = video_config_for(None, "qwen2_5_vl")


class VideoError(ValueError):
    """A video file that cannot be decoded as asked (corrupt, truncated, no video stream)."""


@dataclasses.dataclass(frozen=True)
class VideoInfo:
    """What the container says about a video stream (HF's `VideoMetadata` fields we need)."""

    total_frames: int
    fps: float | None  # stream.average_rate; None when the container has none
    width: int
    height: int


# ---- sampling -------------------------------------------------------------------------------------
def sample_indices(
    total: int, source_fps: float | None, cfg: PreprocessConfig, *, fps: float | None, num_frames: int | None
) -> np.ndarray:
    """The frame indices HF's video processor of `cfg.video_sampler` samples from a `total`-frame video.

    Args:
      total: frames in the video (HF's `total_num_frames`).
      source_fps: its frame rate (HF's `VideoMetadata.fps`); needed for fps sampling.
      cfg: min_frames / max_frames / temporal_patch_size / video_sampler come from here.
      fps, num_frames: the request (at most one); neither: every frame (qwen2) or
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
    else:
        return np.arange(total, dtype=np.int64)
    if n > total:
        raise ValueError(f"cannot sample {n} frames from a {total}-frame video: ask for fewer frames or a lower fps")
    if n <= 0:
        raise ValueError(f"{total} frames at this rate give {n} frames to sample (a multiple of {T}): ask for more")
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


# ---- decoding -------------------------------------------------------------------------------------
def _av():
    try:
        import av
    except ImportError:
        raise ImportError(
            "decoding video files needs PyAV: pip install 'qwen_vit_jax[video]' (or pass decoded frames)"
        ) from None
    return av


def _reason(e) -> str:
    """FFmpeg's words for an error, without its errno ("[Errno 1094995529]") and file name."""
    return getattr(e, "strerror", None) or str(e)


def probe(path: str | os.PathLike) -> VideoInfo:
    """Frame count, rate and size of a video file, from its container (as HF's PyAV reader), the
    frames counted by demuxing where the container does not record them. VideoError if unreadable."""
    av = _av()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such video file: {path}")
    try:
        with av.open(os.fspath(path)) as container:
            if not container.streams.video:
                raise VideoError(f"{path}: no video stream")
            stream = container.streams.video[0]
            total = stream.frames
            if total <= 0:  # not recorded: count packets (no decoding)
                total = sum(1 for p in container.demux(stream) if p.size)
            rate = stream.average_rate
            return VideoInfo(int(total), float(rate) if rate else None, stream.width, stream.height)
    except av.FFmpegError as e:
        raise VideoError(f"{path}: cannot read as a video ({_reason(e)}; truncated, corrupt or not a video?)") from None


def _decode(path, info: VideoInfo, indices: np.ndarray, cfg: PreprocessConfig, size) -> np.ndarray:
    """The frames at `indices` of a file, RGB, each resized as soon as it is decoded.

    Returns uint8 [len(indices), h, w, 3] (h, w the resized size)."""
    av = _av()
    want: dict[int, list[int]] = {}  # frame index -> positions in the output (qwen3 may repeat an index)
    for pos, i in enumerate(indices.tolist()):
        want.setdefault(i, []).append(pos)
    out: np.ndarray | None = None
    last, seen = int(indices[-1]), 0
    try:
        with av.open(os.fspath(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"  # frame / slice threads; frames come out in order all the same
            for i, frame in enumerate(container.decode(stream)):
                seen = i + 1
                if i in want:
                    a = resize(to_hwc3(frame.to_ndarray(format="rgb24"), cfg, f"{path} frame {i}"), cfg, size)
                    if out is None:
                        out = np.empty((len(indices), *a.shape), np.uint8)
                    for pos in want[i]:
                        out[pos] = a
                if i >= last:
                    break
    except av.FFmpegError as e:
        raise VideoError(f"{path}: decoding failed after {seen} frames ({_reason(e)})") from None
    if seen <= last:
        raise VideoError(
            f"{path}: truncated or corrupt: decoded {seen} of the {info.total_frames} frames its container "
            f"announces, frame {last} was to be sampled"
        )
    return out


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
      path_or_frames: a video file (str / PathLike; decoded with PyAV), or decoded frames: a list /
        tuple of PIL images or channels-last arrays of one size, or an [F, H, W, C] array.
      min_pixels, max_pixels: override `config`'s pixel range (per frame; Qwen3-VL: the whole clip).
      fps: sample this many frames per second (needs the source rate: a file's, or `source_fps`).
      num_frames: or sample this many frames, spread evenly (exclusive with fps).
      max_frames: override `config.max_frames`.
      source_fps: the frame rate of decoded frames (ignored for files, whose container says it).
      config: PreprocessConfig (default `DEFAULT_CONFIG`: HF's Qwen2VLVideoProcessor class defaults
        with Qwen2.5-VL's timestamps). A checkpoint's: `preprocess.config.video_config_for(dir,
        variant)` (what an encoder holds).
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
    cfg = DEFAULT_CONFIG if config is None else config
    if not isinstance(cfg, PreprocessConfig):
        raise TypeError(f"config must be a PreprocessConfig, got {type(cfg).__name__}")
    over = {"min_pixels": min_pixels, "max_pixels": max_pixels, "max_frames": max_frames}
    if over := {k: v for k, v in over.items() if v is not None}:
        cfg = dataclasses.replace(cfg, **over)
    if fps is not None and num_frames is not None:
        raise ValueError("fps and num_frames are mutually exclusive: pass one")
    is_file = isinstance(path_or_frames, (str, os.PathLike))
    if is_file:
        info = probe(path_or_frames)
        source_fps, frames = info.fps, None
    else:
        frames = _frames_list(path_or_frames)
        source_fps = None if source_fps is None else float(source_fps)
        if source_fps is not None and not 0 < source_fps < math.inf:
            raise ValueError(f"source_fps must be a positive number, got {source_fps}")
    if fps is None and num_frames is None and cfg.do_sample_frames and (is_file or source_fps is not None):
        fps, num_frames = cfg.fps, cfg.num_frames  # both set: ValueError below, as HF
    total = info.total_frames if is_file else len(frames)
    indices = sample_indices(total, source_fps, cfg, fps=fps, num_frames=num_frames)
    if is_file:
        size = frame_size(len(indices), info.height, info.width, cfg) if cfg.do_resize else None
        video = _decode(path_or_frames, info, indices, cfg, size)
    else:
        hwc = [to_hwc3(frames[i], cfg, f"frame {i}") for i in indices.tolist()]
        if len({a.shape for a in hwc}) != 1:
            raise ValueError(f"all frames of a video must have one size, got {sorted({a.shape[:2] for a in hwc})}")
        h, w = hwc[0].shape[:2]
        size = frame_size(len(indices), h, w, cfg) if cfg.do_resize else None
        video = np.stack([resize(a, cfg, size) for a in hwc])  # [n, h, w, 3] uint8
    T, p = cfg.temporal_patch_size, cfg.patch_size
    if pad := -len(video) % T:  # fill the last run with the last frame
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    gt = len(video) // T
    patches = patches_of(patch_bytes(video.reshape(gt, T, *video.shape[1:]), cfg), cfg)  # [gt, T, h, w, 3] -> rows
    pixel_values = patches if uint8 else patches.to_float()
    grid = np.asarray([[gt, video.shape[1] // p, video.shape[2] // p]], dtype=np.int64)
    return pixel_values, grid, timestamps_of(indices, source_fps, total, cfg)


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
