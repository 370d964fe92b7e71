"""A video in groups of frames: exact by construction (the tower never lets two frames meet), so a
clip encoded a group at a time (`VisionEncoder.iter_video`, `encode_video`, the encode loop's pieces)
equals the clip encoded whole and HF's tower on it, for a Qwen2.5-VL and a Qwen3-VL tiny tower; and
the peak memory of `encode` does not follow the clip's length."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import video_streams as vs

from benchmarks.workloads import clips as video_samples
from qwen_vit_jax.preprocess.video import preprocess_video

pytest.importorskip("av")
BUDGET = 1024  # patches per call: a 5 s clip at 4 fps comes in several groups


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """5 s, 330x250, 24 fps (H.264)."""
    return video_samples.write_clip(tmp_path_factory.mktemp("stream") / "clip.mp4", "h264_330x250_24fps_5s")


@pytest.fixture(scope="module", params=["qwen2.5-vl", "qwen3-vl"])
def tower(request, tiny_dirs, towers):
    """(HF's model of a tiny tower, an encoder of ours of BUDGET patches per call): the session's
    demo tower (Qwen2.5-VL) and the registry's Qwen3-VL tower (tests/towers.py)."""
    from qwen_vit_jax import VisionEncoder
    from qwen_vit_jax.tools.hf_reference import load_hf_vision_tower

    if request.param == "qwen2.5-vl":
        hf, ckpt = load_hf_vision_tower(tiny_dirs[0]), tiny_dirs[1]
    else:
        hf, ckpt = towers["q3"].hf, towers["q3"].ours
    return hf, VisionEncoder.from_pretrained(ckpt, max_batch_patches=BUDGET)


def test_groups_equal_the_whole_clip_and_hf(tower, clip):
    from hf_utils import assert_fp32_close

    from qwen_vit_jax.tools.hf_reference import hf_visual

    hf, enc = tower
    pv, grid, ts = preprocess_video(clip, config=enc.video_preprocess, fps=4.0)  # HF's float rows
    t, h, w = grid[0].tolist()
    chunks = list(enc.iter_video(clip, fps=4.0))
    T = enc.video_preprocess.temporal_patch_size
    assert len(chunks) >= 2 and all(c.grid_thw[0, 0] * h * w <= BUDGET for c in chunks)
    assert [c.grid_thw[0, 1:].tolist() for c in chunks] == [[h, w]] * len(chunks)
    assert sum(int(c.grid_thw[0, 0]) for c in chunks) == t
    starts = np.cumsum([0] + [int(c.grid_thw[0, 0]) * T for c in chunks])[:-1]
    assert [c.first_frame for c in chunks] == starts.tolist()
    np.testing.assert_array_equal(np.concatenate([c.timestamps for c in chunks]), ts)  # equal, not close
    ours = np.concatenate([c.embeddings for c in chunks])
    whole = enc.encode(pv, grid)  # in memory, one request (its own buckets: padding invariance, 1e-6)
    assert ours.shape == whole.shape
    assert np.linalg.norm(ours - whole) <= 1e-6 * np.linalg.norm(whole)
    np.testing.assert_array_equal(enc.encode_video(clip, fps=4.0), ours)  # the same groups, the same bits
    assert_fp32_close(ours, hf_visual(hf, pv, grid))


@pytest.mark.parametrize("workers, suffix", [(0, ".safetensors"), (1, ".parquet")])
def test_encode_streams_a_clip_in_groups(capsys, tiny_dirs, tiny_encoder, clip, tmp_path, workers, suffix):
    """`encode` with a patch budget smaller than the clip: its frame groups decoded by a worker
    process of their own (or a thread with --workers 0) as they are encoded; the row equals the
    clip encoded whole (1e-6), its grid and timestamps exactly."""
    from qwen_vit_jax.data.embeddings import read_embeddings

    out = tmp_path / f"e{suffix}"
    args = ("encode", tiny_dirs[1], clip, "-o", out, "--fps", "4", "--batch-patches", BUDGET, "--workers", workers)
    rc, _, err = vs.cli(capsys, *args)
    assert rc == 0, err
    pv, grid, ts = preprocess_video(clip, config=tiny_encoder.video_preprocess, fps=4.0, uint8=True)
    e = read_embeddings(out)
    assert e.grid_thw.tolist() == grid.tolist()
    np.testing.assert_array_equal(e.timestamps_of(0), ts)
    whole = tiny_encoder.encode(pv, grid)
    assert np.linalg.norm(e[0] - whole) <= 1e-6 * np.linalg.norm(whole)
    assert f"{int(grid[0, 0]) * 2}/{int(grid[0, 0]) * 2} frames" in err


PEAKS = """
import json, resource, sys
sys.modules.update(torch=None, transformers=None)  # as the CLI runs: no torch
from qwen_vit_jax.tools.cli import main
ckpt, out, *runs = sys.argv[1:]
peaks = []
for run in runs:
    clip, name = run.split(":")
    args = ["encode", ckpt, clip, "-o", f"{out}/{name}", "--max-frames", "100000", "--batch-patches", "2048"]
    assert main(args) == 0
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
print(json.dumps(peaks))
"""


def test_encode_memory_is_flat_in_the_clips_length(tiny_dirs, tmp_path):
    """Peak RSS of `encode` (one process, .safetensors and .parquet) on a 4 s and a 39 s clip (120
    and 1,170 frames of 160x120, all of them encoded): the longer clip costs at most 200 MB more
    (its frame groups are decoded as they are encoded; the rows it holds are 7 MB). Encoding the
    whole clip at once, as before, cost 290 MB more for .safetensors, 460 MB for both."""
    short = vs.write_frames(tmp_path / "short.mp4", 120, 160, 120)
    long = vs.write_frames(tmp_path / "long.mp4", 1170, 160, 120)
    runs = [f"{short}:a.parquet", f"{short}:a.safetensors", f"{long}:b.safetensors", f"{long}:b.parquet"]
    p = subprocess.run(
        [sys.executable, "-c", PEAKS, str(tiny_dirs[1]), str(tmp_path), *runs],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    peaks = json.loads(p.stdout.strip().splitlines()[-1])
    assert max(peaks[2:]) - max(peaks[:2]) < 200, peaks
