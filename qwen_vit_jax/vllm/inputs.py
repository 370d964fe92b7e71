"""Our embeddings in the form vLLM's Qwen models take them in a request's `multi_modal_data`.

    llm = LLM(model=HF_DIR, enable_mm_embeds=True, ...)
    mm = qv.mm_data(enc, images=[img], videos=["clip.mp4"], fps=2.0)
    llm.generate({"prompt": prompt, "multi_modal_data": mm})

The layout is vLLM's own (vllm/model_executor/models/qwen2_vl.py, qwen2_5_vl.py, qwen3_vl.py of the
version in ids.VLLM_TESTED: their data parsers and `_get_mm_fields_config`):

  every family   "image": {"image_embeds": float [tokens, width], "image_grid_thw": int64 [n, 3]}
                 "video": {"video_embeds": float [tokens, width], "video_grid_thw": int64 [n, 3]}
                 embeddings of all items of a modality concatenated in order, split by their grids
  Qwen2.5-VL     "video" also "second_per_grid_ts": float32 [n] (vLLM assumes 1.0 without it: right
                 only at 2 fps; it sets the videos' M-RoPE time positions)
  Qwen3-VL, 3.5  width = out_dim * (1 + deepstack layers): the deepstack features after the tokens
                 (store.vllm_layout); "video" also "timestamps": one list of seconds per temporal
                 patch per video (the prompt's "<t seconds>" text is built from them)

torch is imported here, at call time: it is wherever vLLM is, and never in the core runtime.
"""

from __future__ import annotations

import os

import numpy as np

from qwen_vit_jax.errors import BadInput, Unsupported
from qwen_vit_jax.vllm.store import vllm_layout

# The HF families whose vLLM model takes the layout above, by how their videos are timed.
SECONDS_PER_GRID = ("qwen2_5_vl",)
TIMESTAMPS = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
FAMILIES = ("qwen2_vl", *SECONDS_PER_GRID, *TIMESTAMPS)


def mm_data(enc, images=(), videos=(), **sampling) -> dict:
    """The `multi_modal_data` entries of one vLLM prompt, with embeddings encoded by `enc`.

    Args:
      enc: a VisionEncoder of a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 checkpoint (the one
        vLLM serves: its language model reads these embeddings).
      images: PIL images, HxWx3 uint8 arrays, image files' paths or their bytes (EXIF orientation
        applied, as vLLM does), in the prompt's order.
      videos: video files' paths or decoded frames, in the prompt's order.
      sampling: the videos' sampling, as `preprocess_video` takes it (fps, num_frames, max_frames,
        source_fps for decoded frames, min_pixels, max_pixels); unused without videos.

    Returns:
      {"image": {...}, "video": {...}} (only the modalities given) with torch tensors: pass it as
      `multi_modal_data`, the prompt holding one placeholder per item (vLLM expands each to its
      tokens from the grid). The engine needs `enable_mm_embeds=True`.
    """
    family = enc.cfg.hf_family
    if family not in FAMILIES:
        raise Unsupported(
            f"vLLM embedding inputs are written for {', '.join(FAMILIES)}; this checkpoint is {family}", what=family
        )
    import torch

    deep = bool(enc.cfg.deepstack_layers)
    out = {}
    if len(images):
        emb, grids, _ = _encode(enc, [_image_item(enc, im) for im in images], deep)
        out["image"] = {"image_embeds": torch.from_numpy(emb), "image_grid_thw": torch.from_numpy(grids)}
    if len(videos):
        items = [_video_item(enc, v, sampling) for v in videos]
        emb, grids, stamps = _encode(enc, items, deep)
        entry = {"video_embeds": torch.from_numpy(emb), "video_grid_thw": torch.from_numpy(grids)}
        if family in SECONDS_PER_GRID:
            entry["second_per_grid_ts"] = torch.tensor([_seconds_per_grid(ts) for ts in stamps], dtype=torch.float32)
        elif family in TIMESTAMPS:
            if any(ts is None for ts in stamps):
                raise BadInput("a Qwen3-VL video's timestamps need its frame rate: pass source_fps= with frames")
            entry["timestamps"] = [[float(t) for t in ts] for ts in stamps]
        out["video"] = entry
    return out


def _image_item(enc, image):
    """(uint8 Patches, grid [1, 3], None) of one image as encode_images prepares it."""
    from qwen_vit_jax.preprocess.images import image_preprocessor

    if isinstance(image, (str, os.PathLike, bytes, bytearray, memoryview)):
        from qwen_vit_jax.data.inputs import load_image

        image = load_image(bytes(image) if not isinstance(image, (str, os.PathLike)) else image)
    px, grid = image_preprocessor(enc.cfg.variant)([image], config=enc.preprocess, uint8=True)
    return px, grid, None


def _video_item(enc, video, sampling: dict):
    """(uint8 Patches, grid [1, 3], timestamps or None) of one video as encode_video prepares it."""
    from qwen_vit_jax.preprocess.video import preprocess_video

    return preprocess_video(video, config=enc.video_preprocess, uint8=True, **sampling)


def _encode(enc, items, deepstack: bool):
    """One encode of the items (in order): (embeddings in vLLM's layout [tokens, width], grids int64
    [n, 3], each item's timestamps)."""
    from qwen_vit_jax.runtime.batching import join

    grids = np.concatenate([g for _, g, _ in items]).astype(np.int64)  # [n, 3]
    out = enc.encode(join([px for px, _, _ in items]), grids, return_deepstack=deepstack)
    emb = vllm_layout(*out) if deepstack else np.ascontiguousarray(out, np.float32)
    return emb, grids, [ts for _, _, ts in items]


def _seconds_per_grid(ts) -> float:
    """Qwen2.5-VL's second_per_grid_ts (temporal_patch_size / sampled fps) from the temporal
    patches' start times: their spacing. A one-patch video's positions do not depend on it."""
    if ts is None:
        raise BadInput("a Qwen2.5-VL video's second_per_grid_ts needs its frame rate: pass source_fps= with frames")
    ts = np.asarray(ts, np.float64)
    return float(ts[1] - ts[0]) if len(ts) > 1 else 1.0
