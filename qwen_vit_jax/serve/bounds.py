"""The per-item bound: what one item may cost the device. An image, or each frame of a video, holds at
most `patches` patches (default: the patch budget of one device call), and a video at most
`max_frames` frames.

    bound = ItemBound.of(enc.preprocessing, patches=16384, max_frames=None, resize=True)
    bound.preprocessing          # the service's Preprocessing: what the workers and the cache use
    bound.image_over(w, h)       # None, or why an image of w x h pixels is refused (413)

The bound is applied where the checkpoint's own limit is: its max_pixels, lowered so that the resize
every image goes through (smart_resize, aspect kept as well as multiples of the merge size allow)
lands within `patches`. An image over it is then resized down to fit, as it would be by a smaller
max_pixels, and the answer's grid says what it got (`resize=False` keeps the checkpoint's
preprocessing and refuses such an image instead, before it is decoded). Videos: the video config's
max_pixels is per frame on the Qwen2 samplers and lowered the same way; Qwen3-VL's bounds the whole
clip (frames x pixels), so it is left as it is and a frame that still exceeds the bound (a short
clip at a high resolution) is refused after preparation (`grid_over`), as is any item whose
configuration does not resize (do_resize false).
"""

from __future__ import annotations

import dataclasses

from qwen_vit_jax.families import GLM4V
from qwen_vit_jax.preprocess.config import Preprocessing


@dataclasses.dataclass(frozen=True)
class ItemBound:
    """`patches` per image or video frame at most; `preprocessing` the service's (the checkpoint's
    with the bound applied when `resize`); `checkpoint` the checkpoint's own."""

    patches: int
    resize: bool
    checkpoint: Preprocessing
    preprocessing: Preprocessing

    @classmethod
    def of(cls, checkpoint: Preprocessing, patches: int, max_frames: int | None, resize: bool) -> ItemBound:
        """The bound of `patches` per frame (and `max_frames` per video, None: the checkpoint's) on a
        checkpoint's preprocessing."""
        if patches <= 0:
            raise ValueError(f"the per-item bound must be a positive number of patches, got {patches}")
        image, video = checkpoint.image, checkpoint.video
        if resize:
            # GLM-4V counts an image as one temporal patch of frames in its pixel budget
            frames = image.temporal_patch_size if checkpoint.variant == GLM4V else 1
            image = _capped(image, patches * image.patch_size**2 * frames)
            if video.video_sampler != "qwen3-vl":
                video = _capped(video, patches * video.patch_size**2)
        if max_frames is not None and max_frames < video.max_frames:
            video = dataclasses.replace(video, max_frames=max_frames, min_frames=min(video.min_frames, max_frames))
        return cls(patches, resize, checkpoint, dataclasses.replace(checkpoint, image=image, video=video))

    def image_patches(self, width: int, height: int, preprocessing: Preprocessing | None = None) -> int:
        """Patches per frame of a width x height image under `preprocessing` (default: the service's)."""
        from qwen_vit_jax.preprocess.images import target_size

        p = preprocessing or self.preprocessing
        h, w = target_size(height, width, p.image, p.variant)
        return (h // p.image.patch_size) * (w // p.image.patch_size)

    def image_over(self, width: int, height: int) -> str | None:
        """Why a width x height image is refused (its frame over the bound), or None."""
        n = self.image_patches(width, height)
        if n <= self.patches:
            return None
        return f"the image is {width}x{height}: {n:,} patches; at most {self.patches:,} per item (--max-item-patches)"

    def resized(self, width: int, height: int) -> bool:
        """Whether the bound made a width x height image smaller than the checkpoint would."""
        return self.preprocessing != self.checkpoint and self.image_patches(
            width, height, self.checkpoint
        ) > self.image_patches(width, height)

    def grid_over(self, kind: str, grid) -> str | None:
        """Why a prepared item of grid (t, h, w) is refused (a frame over the bound), or None."""
        t, h, w = (int(v) for v in grid)
        if h * w <= self.patches:
            return None
        what = "the image" if kind == "image" else "each frame"
        return f"{what} is {h}x{w} = {h * w:,} patches; at most {self.patches:,} per frame (--max-item-patches)"


def _capped(cfg, max_pixels: int):
    """`cfg` with max_pixels lowered to `max_pixels` (never raised), min_pixels with it."""
    if max_pixels >= cfg.max_pixels:
        return cfg
    return dataclasses.replace(cfg, max_pixels=max_pixels, min_pixels=min(cfg.min_pixels, max_pixels))
