"""Test videos written with PyAV: moving shapes over a gradient, odd sizes and frame rates.

Shared by the tests and by benchmarks/video_reference.py (HF's video processors in their own venv),
so both see clips with the same frame counts, rates and sizes, and compare pixels with the same
HF reference (`hf_pil_pixels`). Pixels may differ between PyAV builds
(the encoders are not bit-stable across versions), so frozen results hold only what the container's
metadata decides: sampled indices, grids and timestamps; pixels are compared within one run.
"""

from __future__ import annotations

import fractions
import os

import numpy as np

# name -> (codec, pixel format, container suffix, width, height, fps as (num, den), frames)
CLIPS = {
    "h264_330x250_24fps_5s": ("libx264", "yuv420p", ".mp4", 330, 250, (24, 1), 120),
    "h264_640x360_2997fps_2s": ("libx264", "yuv420p", ".mp4", 640, 360, (30000, 1001), 61),
    "h264_462f_24fps": ("libx264", "yuv420p", ".mp4", 160, 120, (24, 1), 462),  # the float32 arange case
    "h264_portrait_180x322_25fps_3s": ("libx264", "yuv420p", ".mp4", 180, 322, (25, 1), 75),
    "vp9_232x174_12.5fps_10s_no_count": ("libvpx-vp9", "yuv420p", ".webm", 232, 174, (25, 2), 125),
    "mjpeg_odd_213x157_23.976fps_2s": ("mjpeg", "yuvj444p", ".avi", 213, 157, (24000, 1001), 47),
    "png_odd_97x61_7fps_3s": ("png", "rgb24", ".mov", 97, 61, (7, 1), 21),
}


def frame_pixels(i: int, n: int, width: int, height: int) -> np.ndarray:
    """Frame i of n: a diagonal gradient that drifts, a red box moving left to right and a blue
    disc moving top to bottom; uint8 [height, width, 3]."""
    y, x = np.mgrid[0:height, 0:width]
    t = i / max(n - 1, 1)
    img = np.empty((height, width, 3), np.uint8)
    img[..., 0] = (x * 255 // max(width - 1, 1) + i * 3) % 256
    img[..., 1] = (y * 255 // max(height - 1, 1)) % 256
    img[..., 2] = ((x + y + i * 5) * 2) % 256
    bw, bh = max(width // 5, 2), max(height // 4, 2)
    bx, by = int(t * (width - bw)), height // 3
    img[by : by + bh, bx : bx + bw] = (230, 30, 30)
    r = max(min(width, height) // 8, 2)
    cx, cy = width // 2, int(r + t * (height - 2 * r))
    img[(x - cx) ** 2 + (y - cy) ** 2 <= r * r] = (20, 40, 220)
    return img


def write_clip(path: str | os.PathLike, name: str) -> str:
    """Write clip `name` of CLIPS to `path` (its suffix is the clip's container). Returns the path."""
    import av

    codec, pix_fmt, _, width, height, (num, den), frames = CLIPS[name]
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fractions.Fraction(num, den))
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if codec == "libx264":
            stream.options = {"crf": "18", "preset": "ultrafast"}
        elif codec == "libvpx-vp9":
            stream.options = {"crf": "30", "b": "0", "deadline": "realtime", "cpu-used": "8"}
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, frames, width, height), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return str(path)


def write_all(folder: str | os.PathLike) -> dict[str, str]:
    """Every clip of CLIPS into `folder`: name -> path."""
    return {name: write_clip(os.path.join(folder, name + spec[2]), name) for name, spec in CLIPS.items()}


def hf_pil_pixels(frames: np.ndarray, h: int, w: int, cfg) -> np.ndarray:
    """HF's torchvision-free image processor (`Qwen2VLImageProcessorPil`'s resize / rescale /
    normalize) on each frame at size (h, w), then HF's video patchify (Qwen2VLVideoProcessor.patchify
    transcribed in torch): float32 [gt * gh * gw, patch_dim]. `cfg`: a PreprocessConfig. Needs torch
    and transformers (imported here: clip writing does not)."""
    import warnings

    import torch
    from transformers import Qwen2VLImageProcessorPil
    from transformers.image_utils import SizeDict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proc = Qwen2VLImageProcessorPil(image_mean=list(cfg.image_mean), image_std=list(cfg.image_std))
    chw = []
    for f in frames:
        x = proc.process_image(f, do_convert_rgb=True)
        x = super(Qwen2VLImageProcessorPil, proc).resize(x, size=SizeDict(height=h, width=w), resample=proc.resample)
        chw.append(proc.normalize(proc.rescale(x, proc.rescale_factor), proc.image_mean, proc.image_std))
    v = torch.from_numpy(np.stack(chw))[None]  # [1, F, C, h, w]
    T, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -v.shape[1] % T:
        v = torch.cat((v, v[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
    gt, c, gh, gw = v.shape[1] // T, v.shape[2], h // p, w // p
    x = v.view(1, gt, T, c, gh // m, m, p, gw // m, m, p).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape(gt * gh * gw, c * T * p * p).numpy()  # [gt*gh*gw, C*T*p*p]
