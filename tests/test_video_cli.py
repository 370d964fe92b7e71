"""`qwen-vit-jax encode` with videos beside images: told apart by extension and content, sampled by
--fps / --num-frames / --max-frames, one progress line per video, grids and timestamps in the file,
corrupt or truncated videos named, --keep-going, nothing half-written."""

from __future__ import annotations

import os
import pathlib
import shutil

import numpy as np
import pytest
from cli_runs import assert_clean_error, main, run
from sample_images import make_image

from benchmarks.workloads import clips as video_samples
from qwen_vit_jax.data.embeddings import read_embeddings
from qwen_vit_jax.preprocess.video import preprocess_video

pytest.importorskip("av")


@pytest.fixture()
def mixed_dir(tmp_path):
    """a.png, b_clip.mp4 (5 s, 24 fps), c.jpg, d_clip (a 2 s MJPEG AVI without an extension)."""
    d = tmp_path / "inputs"
    d.mkdir()
    make_image(56, 84, seed=1).save(d / "a.png")
    video_samples.write_clip(d / "b_clip.mp4", "h264_330x250_24fps_5s")
    make_image(112, 84, seed=2).save(d / "c.jpg", quality=95)
    video_samples.write_clip(d / "d_clip.avi", "mjpeg_odd_213x157_23.976fps_2s")
    os.rename(d / "d_clip.avi", d / "d_clip")  # found by name only when given by name
    return d


def test_encode_images_and_videos(capsys, tiny_dirs, tiny_encoder, mixed_dir, tmp_path):
    _, ckpt = tiny_dirs
    out = tmp_path / "emb.safetensors"
    args = ("encode", ckpt, mixed_dir, mixed_dir / "d_clip", "-o", out, "--fps", "2", "--max-pixels", "50000")
    rc, stdout, err = main(capsys, *args)
    assert rc == 0, err
    assert "encoded 4 inputs" in stdout and "4/4 inputs" in err
    assert err.count("video ") == 2 and f"video {mixed_dir / 'b_clip.mp4'}: 5 x " in err  # one line per video

    e = read_embeddings(out)
    names = [mixed_dir / n for n in ("a.png", "b_clip.mp4", "c.jpg", "d_clip")]
    assert e.names == [str(p) for p in names]
    vcfg = tiny_encoder.video_preprocess
    assert e.metadata["video_preprocess"]["fps"] == 2.0 and e.metadata["video_preprocess"]["max_pixels"] == 50000
    for i in (1, 3):
        pv, grid, ts = preprocess_video(str(names[i]), fps=2.0, max_pixels=50000, config=vcfg)
        assert e.grid_thw[i].tolist() == grid[0].tolist()
        np.testing.assert_array_equal(e.timestamps_of(i), ts)  # Qwen2.5-VL: i * second_per_grid_ts
        ref = tiny_encoder.encode(pv, grid)
        assert np.linalg.norm(e[i] - ref) <= 1e-6 * np.linalg.norm(ref)
    assert e.grid_thw[1, 0] == 5 and e.timestamps_of(1)[1] == 2 / (10 / 120 * 24)
    assert e.timestamps_of(0) is None and e.timestamps_of(2) is None and e.grid_thw[0, 0] == 1
    assert any("timestamp" in f for f in vars(e))

    # --resume with other sampling is refused: one file, one sampling
    rc, _, err = main(capsys, *args[:6], "--num-frames", "4", "--max-pixels", "50000", "--resume")
    assert_clean_error(rc, err, "video_preprocess")


def test_corrupt_and_truncated_videos(capsys, tiny_dirs, mixed_dir, tmp_path):
    _, ckpt = tiny_dirs
    data = (mixed_dir / "b_clip.mp4").read_bytes()
    (mixed_dir / "b_clip.mp4").write_bytes(data[: len(data) // 2])  # moov atom at the end: unreadable
    avi = (mixed_dir / "d_clip").read_bytes()
    (mixed_dir / "e_short.avi").write_bytes(avi[: len(avi) // 3])  # index promises 47 frames
    out = tmp_path / "emb.npz"
    rc, _, err = main(capsys, "encode", ckpt, mixed_dir, "-o", out, "--num-frames", "8")
    assert_clean_error(rc, err, f"cannot read {mixed_dir / 'b_clip.mp4'}", "VideoError", "--keep-going")
    assert read_embeddings(out).names == [str(mixed_dir / "a.png")]  # whole: the inputs before it

    out2 = tmp_path / "emb2.npz"
    rc, _, err = main(capsys, "encode", ckpt, mixed_dir, "-o", out2, "--num-frames", "8", "--keep-going")
    assert_clean_error(rc, err, "2 of 4 inputs could not be read")
    assert f"warning: skipped {mixed_dir / 'b_clip.mp4'}: VideoError" in err
    assert f"warning: skipped {mixed_dir / 'e_short.avi'}: VideoError" in err and "truncated" in err
    assert read_embeddings(out2).names == [str(mixed_dir / n) for n in ("a.png", "c.jpg")]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]

    rc, _, err = main(capsys, "encode", ckpt, mixed_dir, "-o", tmp_path / "x.npz", "--fps", "2", "--num-frames", "4")
    assert_clean_error(rc, err, "mutually exclusive")
    rc, _, err = main(capsys, "encode", ckpt, mixed_dir, "-o", tmp_path / "x.npz", "--max-frames", "0")
    assert_clean_error(rc, err, "--max-frames must be positive")
    assert not (tmp_path / "x.npz").exists()


def test_encode_video_without_torch(tiny_dirs, tmp_path):
    """The whole video path (PyAV decode, sampling, encode, write) in a process where torch and
    transformers cannot be imported."""
    clip = video_samples.write_clip(tmp_path / "clip.webm", "vp9_232x174_12.5fps_10s_no_count")
    shutil.copy(clip, tmp_path / "copy.webm")
    out = tmp_path / "e.npz"
    p = run("encode", tiny_dirs[1], tmp_path, "-o", out, "--num-frames", "4")
    assert p.returncode == 0, p.stderr
    e = read_embeddings(out)
    assert e.grid_thw[:, 0].tolist() == [2, 2] and len(e.timestamps_of(0)) == 2
    assert pathlib.Path(e.names[0]).name == "clip.webm"


def test_every_frame_without_sampling(capsys, tiny_dirs, tmp_path):
    """The tiny checkpoint ships Qwen2.5-VL's preprocessor_config.json: HF's video processor samples
    nothing by default, so every frame is used, with a note that says so."""
    clip = video_samples.write_clip(tmp_path / "c.mov", "png_odd_97x61_7fps_3s")  # 21 frames at 7 fps
    out = tmp_path / "e.npz"
    rc, _, err = main(capsys, "encode", tiny_dirs[1], clip, "-o", out)
    assert rc == 0, err
    assert err.count("note: videos use every frame") == 1
    e = read_embeddings(out)
    assert e.grid_thw[0, 0] == 11 and e.timestamps_of(0)[1] == 2 / 7  # second_per_grid_ts = T / 7 fps


def test_input_patches_from_headers(mixed_dir, tmp_path):
    """What several processes balance: a video's patch count from its container's metadata, equal
    to what preprocess_video makes of it; an unreadable file counts 0 (its owner reports it)."""
    import dataclasses

    from qwen_vit_jax.data.inputs import input_patches
    from qwen_vit_jax.preprocess.config import QWEN3_VL_VIDEO, VIDEO_DEFAULT, PreprocessConfig

    image_cfg = PreprocessConfig()
    for cfg in (QWEN3_VL_VIDEO, dataclasses.replace(VIDEO_DEFAULT, do_sample_frames=True, fps=2.0), VIDEO_DEFAULT):
        for name in ("b_clip.mp4", "d_clip"):
            rows = len(preprocess_video(str(mixed_dir / name), config=cfg)[0])
            assert input_patches(str(mixed_dir / name), image_cfg, cfg) == rows
    assert input_patches(str(mixed_dir / "a.png"), image_cfg, VIDEO_DEFAULT) == 6 * 4
    (tmp_path / "bad.mp4").write_bytes(b"nope")
    assert input_patches(str(tmp_path / "bad.mp4"), image_cfg, VIDEO_DEFAULT) == 0
