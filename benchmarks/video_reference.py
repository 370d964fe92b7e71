"""HF 5.24's video processors on the test clips, in the reference venv (benchmarks/video_reference.sh).

For every clip of benchmarks/workloads/clips.py and every case below, HF's `Qwen2VLVideoProcessor` /
`Qwen3VLVideoProcessor` (torchvision backend) runs on the clip's frames, decoded with PyAV exactly as
HF's PyAV reader decodes them (`frame.to_ndarray(format="rgb24")`), with the container's metadata as
`video_metadata` (total_num_frames, fps) and `do_sample_frames=True`. Recorded per case: HF's sampled
indices, grid and timestamps (Qwen3-VL: `Qwen3VLProcessor._calculate_timestamps`; Qwen2.5-VL:
second_per_grid_ts = T / sampled_fps), frozen in tests/data/video_reference.json for CI.

Pixels, measured in the same run (ours is importable here: video.py needs numpy, PIL and PyAV only):
  hf_video_vs_hf_pil: HF's video processor (torchvision resize) vs HF's torchvision-free image
    processor (`Qwen2VLImageProcessorPil`'s resize / rescale / normalize) on the same sampled frames at
    the same size: how far HF's own two backends lie apart (the bar for "bit for bit where they agree").
  ours_vs_hf_pil: ours vs that PIL reference (expected 0: bit for bit).
  ours_vs_hf_video: ours vs HF's video processor.

    bash benchmarks/video_reference.sh [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import warnings

import av
import numpy as np
import torch
import transformers
from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from benchmarks.workloads import clips as video_samples  # the repository root on PYTHONPATH (video_reference.sh)
from qwen_vit_jax.preprocess.config import PreprocessConfig
from qwen_vit_jax.preprocess.video import preprocess_video

# The hub's files. Qwen2-VL / Qwen2.5-VL ship only preprocessor_config.json (HF's video processor
# falls back to it); Qwen3-VL ships video_preprocessor_config.json.
HUB_QWEN2_VL = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
HUB_QWEN2_5_VL = dict(HUB_QWEN2_VL, processor_class="Qwen2_5_VLProcessor")
HUB_QWEN3_VL_VIDEO = {  # the same temporal patch and merge, 16-pixel patches, its own sizes and normalisation
    **{k: HUB_QWEN2_VL[k] for k in ("temporal_patch_size", "merge_size")},
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "image_mean": [0.5] * 3,
    "image_std": [0.5] * 3,
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}
SMALL = {"min_pixels": 3136, "max_pixels": 96 * 28 * 28}  # frames of these clips get downscaled

# (config name, config dict: given to HF's processor class and to our PreprocessConfig.from_hf(video=True),
#  the call's keywords: fps / num_frames / max_frames / cap_pixels_per_frame)
CASES = [
    ("qwen2-vl hub", HUB_QWEN2_VL, {"fps": 2.0}),
    ("qwen2-vl hub", HUB_QWEN2_VL, {"num_frames": 9}),  # 9 / 2 = 4.5 rounds half to even: 8 frames
    ("qwen2-vl hub", HUB_QWEN2_VL, {"num_frames": 10}),
    ("qwen2-vl hub", HUB_QWEN2_VL, {}),  # no sampling: every frame
    ("qwen2.5-vl hub", HUB_QWEN2_5_VL, {"fps": 2.0}),
    ("qwen2.5-vl hub", HUB_QWEN2_5_VL, {"fps": 0.5}),  # min_frames
    ("qwen2.5-vl hub", HUB_QWEN2_5_VL, {"fps": 4.0, "max_frames": 8}),
    ("qwen2.5-vl small", dict(HUB_QWEN2_5_VL, **SMALL), {"fps": 1.0}),
    ("qwen2.5-vl small capped", dict(HUB_QWEN2_5_VL, **SMALL, max_video_tokens=64), {"fps": 3.0, "cap": True}),
    ("qwen2-vl class defaults", {"video_processor_type": "Qwen2VLVideoProcessor"}, {"fps": 1.0}),
    ("qwen3-vl hub", HUB_QWEN3_VL_VIDEO, {}),  # its default: fps 2
    ("qwen3-vl hub", HUB_QWEN3_VL_VIDEO, {"fps": 1.0}),
    ("qwen3-vl hub", HUB_QWEN3_VL_VIDEO, {"num_frames": 7}),
    ("qwen3-vl max_frames 6", dict(HUB_QWEN3_VL_VIDEO, max_frames=6), {"fps": 2.0}),
    ("qwen3-vl class defaults", {"video_processor_type": "Qwen3VLVideoProcessor"}, {"fps": 3.0}),
    ("qwen3-vl small capped", dict(HUB_QWEN3_VL_VIDEO, max_video_tokens=24), {"fps": 2.0, "cap": True}),
]


def decode_all(path: str) -> tuple[np.ndarray, dict]:
    """Every frame as HF's PyAV reader converts it, and HF's VideoMetadata fields from the container
    (the frame count from decoding where the container records none: HF would get 0)."""
    with av.open(path) as c:
        s = c.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(s)])
        total = s.frames or len(frames)
        return frames, {"total_num_frames": int(total), "fps": float(s.average_rate)}


def hf_processor(config: dict, call: dict):
    kw = {k: v for k, v in config.items() if not k.endswith("_type") and k != "processor_class"}
    qwen3 = config.get("video_processor_type") == "Qwen3VLVideoProcessor" or config.get("patch_size") == 16
    if "max_frames" in call and qwen3:  # HF's Qwen3-VL reads max_frames from its config only
        kw["max_frames"] = call["max_frames"]
    if "num_frames" in call and qwen3:  # else its default fps 2 and num_frames are "mutually exclusive"
        kw["fps"] = None
    return (Qwen3VLVideoProcessor if qwen3 else Qwen2VLVideoProcessor)(**kw), qwen3


def run_case(path: str, frames: np.ndarray, meta: dict, config: dict, call: dict) -> dict:
    proc, qwen3 = hf_processor(config, call)
    hf_kw = {k: call[k] for k in ("fps", "num_frames") if k in call}
    if "max_frames" in call and not qwen3:
        hf_kw["max_frames"] = call["max_frames"]
    sample = bool(hf_kw) or proc.do_sample_frames
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(
            videos=[frames],
            video_metadata=[dict(meta)],
            do_sample_frames=sample,
            cap_pixels_per_frame=bool(call.get("cap")),
            return_metadata=True,
            return_tensors="pt",
            **hf_kw,
        )
    md = out["video_metadata"][0]
    indices = np.arange(len(frames)) if md.frames_indices is None else np.asarray(md.frames_indices)
    grid = out["video_grid_thw"][0].tolist()
    T = proc.temporal_patch_size
    rec = {"indices": indices.tolist(), "grid_thw": grid}
    if qwen3:
        rec["timestamps"] = Qwen3VLProcessor._calculate_timestamps(None, indices, md.fps, T)
    elif config.get("processor_class") == "Qwen2_5_VLProcessor":
        rec["second_per_grid_ts"] = T / md.sampled_fps  # Qwen2_5_VLProcessor._process_videos
    # pixels: HF video (torchvision) vs HF image processor (PIL) vs ours, same frames and size
    hf_video = out["pixel_values_videos"].numpy()
    cfg = PreprocessConfig.from_hf(config, video=True)
    h, w = grid[1] * cfg.patch_size, grid[2] * cfg.patch_size
    hf_pil = video_samples.hf_pil_pixels(frames[indices], h, w, cfg)
    ours_kw = {k: call[k] for k in ("fps", "num_frames", "max_frames") if k in call}
    if call.get("cap"):
        cfg = dataclasses.replace(cfg, cap_pixels_per_frame=True)
    t0 = time.perf_counter()
    ours, our_grid, _ = preprocess_video(path, config=cfg, **ours_kw)
    rec["ours_seconds"] = round(time.perf_counter() - t0, 4)
    rec["ours_grid_equal"] = our_grid[0].tolist() == grid

    def max_abs(a, b):
        return float(np.abs(a.astype(np.float64) - b).max()) if a.shape == b.shape else None

    rec["max_abs"] = {
        "hf_video_vs_hf_pil": max_abs(hf_video, hf_pil),
        "ours_vs_hf_pil": max_abs(ours, hf_pil),
        "ours_vs_hf_video": max_abs(ours, hf_video),
    }
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "data", "video_reference.json"))
    args = ap.parse_args(argv)
    doc = {
        "what": "HF transformers video processors on the clips of benchmarks/workloads/clips.py (video_reference.py)",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "torchvision": __import__("torchvision").__version__,
            "av": av.__version__,
        },
        "clips": {},
        "cases": [],
    }
    with tempfile.TemporaryDirectory(prefix="qvj_video_ref_") as tmp:
        for name, path in video_samples.write_all(tmp).items():
            frames, meta = decode_all(path)
            doc["clips"][name] = dict(meta, height=int(frames.shape[1]), width=int(frames.shape[2]))
            for cname, config, call in CASES:
                try:
                    rec = run_case(path, frames, meta, config, call)
                except Exception as e:  # noqa: BLE001 (HF refuses some: recorded, ours must refuse too)
                    rec = {"error": f"{type(e).__name__}: {e}"}
                doc["cases"].append({"clip": name, "config_name": cname, "config": config, "call": call, **rec})
                m = rec.get("max_abs", {})
                print(
                    f"{name:34} {cname:26} {json.dumps(call):36} "
                    + (
                        f"grid {rec['grid_thw']} n {len(rec['indices'])} same grid {rec['ours_grid_equal']} "
                        f"max|hf video - hf pil| {m['hf_video_vs_hf_pil']} ours-pil {m['ours_vs_hf_pil']} "
                        f"ours-video {m['ours_vs_hf_video']}"
                        if "error" not in rec
                        else rec["error"]
                    ),
                    flush=True,
                )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
