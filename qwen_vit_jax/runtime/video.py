"""A video encoded a group of frames at a time: `VisionEncoder.iter_video` and `encode_video`.

    for chunk in enc.iter_video("clip.mp4", fps=2.0):     # VideoChunk, in order
        chunk.embeddings, chunk.grid_thw, chunk.timestamps, chunk.first_frame

Exact by construction: the tower never lets two frames meet. Full attention is per frame (HF's
cu_seqlens repeat h * w for each temporal patch), windows lie inside a frame and the merger works on
2 x 2 groups of one frame, so encoding a video's temporal patches in consecutive groups computes
what encoding it whole does, the groups' rows concatenated in order (equal within padding
invariance, 1e-6 relative: each group runs in a bucket of its own; tests/test_video_stream.py).
A group holds as many temporal patches as fit `enc.max_batch_patches` (at least one), so memory
follows a group: the decoded frames of one group, its patch rows, its tokens. On several devices a
group's frames are balanced across them as any call's are (docs/multi_device.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from qwen_vit_jax.preprocess.images import patches_of
from qwen_vit_jax.preprocess.video import open_plan, video_config, video_pieces


@dataclasses.dataclass(frozen=True)
class VideoChunk:
    """A run of a video's temporal patches, encoded.

    embeddings: float32 [t * h * w / merge_unit, out_dim], the run's merged tokens in HF's order.
    grid_thw: int64 [1, 3] = [[t, h, w]] of this run (the video's h and w).
    timestamps: float64 [t] seconds of each of its temporal patches (None where the video has none:
      a Qwen2-VL config, or decoded frames without a rate).
    first_frame: the index of its first frame among the video's sampled frames (its first temporal
      patch is first_frame // temporal_patch_size).
    The chunks of a video concatenated (embeddings, grids' t, timestamps) are `encode_video`'s answer.
    """

    embeddings: np.ndarray
    grid_thw: np.ndarray
    timestamps: np.ndarray | None
    first_frame: int


def video_chunks(
    enc, video, *, fps=None, num_frames=None, max_frames=None, source_fps=None, min_pixels=None, max_pixels=None
):
    """`enc.iter_video` with `encode_video`'s other keywords (source_fps, min_pixels, max_pixels).
    The plan (frames, size, grid, timestamps) is made before the first frame is decoded, so a bad
    video fails here, not halfway through the loop."""
    cfg = video_config(enc.video_preprocess, max_frames=max_frames, min_pixels=min_pixels, max_pixels=max_pixels)
    plan = open_plan(video, cfg, fps=fps, num_frames=num_frames, source_fps=source_fps)
    return _chunks(enc, video, plan, cfg)


def _chunks(enc, video, plan, cfg) -> Iterator[VideoChunk]:
    for piece in video_pieces(video, plan, cfg, budget=enc.max_batch_patches):
        grid = np.asarray([piece.grid], np.int64)  # [1, 3]
        tokens = enc.encode(patches_of(piece.rows, cfg), grid)
        yield VideoChunk(tokens, grid, piece.timestamps, piece.first_frame)


def video_tokens(enc, video, **sampling) -> np.ndarray:
    """`VisionEncoder.encode_video`: the chunks' tokens concatenated."""
    return np.concatenate([c.embeddings for c in video_chunks(enc, video, **sampling)])
