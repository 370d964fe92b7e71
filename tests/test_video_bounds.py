"""Every video bounded, and said so: max_frames holds with or without fps (API, `encode`, the
service), `encode` never takes an unbounded number of frames silently, a frame announcing 12000 x
12000 pixels is refused before any frame is decoded, the service bounds a 2,000-frame clip sent
without fps in frames and in patches, the progress counts a long video's frames, and `--resume`
names the settings that differ."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import video_streams as vs

from qwen_vit_jax.errors import TooLarge
from qwen_vit_jax.preprocess.config import QWEN3_VL_VIDEO
from qwen_vit_jax.preprocess.video import DEFAULT_CONFIG, open_plan, preprocess_video

pytest.importorskip("av")


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """60 frames at 30 fps (2 s), 800 frames (over the checkpoint's 768), 2,000 frames: 96x64 pixels."""
    d = tmp_path_factory.mktemp("bounded")
    return {n: vs.write_frames(d / f"c{n}.mp4", n, 96, 64) for n in (60, 800, 2000)}


@pytest.fixture()
def no_decoding(monkeypatch):
    """Any frame decoded fails the test (what 'before decoding' means)."""
    import qwen_vit_jax.preprocess.video as video

    def decode(*a, **k):
        raise AssertionError("a frame was decoded")
        yield

    monkeypatch.setattr(video, "decode", decode)


def test_max_frames_holds_without_fps(clips):
    clip = clips[60]
    pv, grid, ts = preprocess_video(clip, max_frames=8)
    spread = preprocess_video(clip, num_frames=8)  # the same frames: max_frames spread evenly
    assert grid.tolist() == spread[1].tolist() == [[4, 4, 6]]
    np.testing.assert_array_equal(pv, spread[0])
    np.testing.assert_array_equal(ts, spread[2])
    assert preprocess_video(clip, fps=30.0, max_frames=8)[1][0, 0] == 4  # with fps too
    assert preprocess_video(clip, num_frames=20, max_frames=8)[1][0, 0] == 4  # and num_frames
    qwen3 = dataclasses.replace(QWEN3_VL_VIDEO, do_sample_frames=False)
    assert preprocess_video(clip, config=qwen3, max_frames=6)[1][0, 0] == 3
    # the plan says when the bound changed what was asked; every frame under it, as HF
    capped = open_plan(clip, dataclasses.replace(DEFAULT_CONFIG, max_frames=8))
    assert capped.capped == "8 of the 60 frames asked, 4 fps: at most max_frames 8 per video"
    whole = open_plan(clip, DEFAULT_CONFIG)
    assert whole.frames == 60 and whole.capped is None


def test_encode_max_frames_and_its_default(capsys, clips, tiny_dirs, tmp_path):
    from qwen_vit_jax.data.embeddings import read_embeddings

    out = tmp_path / "a.npz"
    rc, _, err = vs.cli(capsys, "encode", tiny_dirs[1], clips[60], "-o", out, "--max-frames", "8")
    assert rc == 0, err
    assert read_embeddings(out).grid_thw.tolist() == [[4, 4, 6]]
    assert f"note: {clips[60]}: 8 of the 60 frames asked, 4 fps: at most max_frames 8 per video" in err
    assert "(--max-frames N raises it)" in err
    # no flags on a clip longer than the checkpoint's max_frames (768): capped, with a line that says so
    out = tmp_path / "b.npz"
    rc, _, err = vs.cli(capsys, "encode", tiny_dirs[1], clips[800], "-o", out)
    assert rc == 0, err
    assert read_embeddings(out).grid_thw.tolist() == [[384, 4, 6]]
    assert "videos use every frame up to --max-frames 768" in err
    assert f"{clips[800]}: 768 of the 800 frames asked, 28.8 fps: at most max_frames 768 per video" in err


def test_a_huge_frame_is_refused_before_decoding(capsys, no_decoding, tiny_dirs, tiny_encoder, tmp_path):
    """A GIF of a few hundred bytes announcing a 12000x12000 canvas (144 MP: 576 MB a frame decoded)."""
    from qwen_vit_jax.serve.settings import Settings

    gif = vs.huge_gif(12000, 12000)
    with pytest.raises(TooLarge, match="12000x12000 = 144,000,000 pixels; at most"):
        preprocess_video(gif)
    path = tmp_path / "huge.mp4"  # a GIF container by its content (a .gif name is read as an image)
    path.write_bytes(gif)
    with pytest.raises(TooLarge):
        tiny_encoder.encode_video(str(path))
    (r,) = vs.post_items(Settings(checkpoint=str(tiny_dirs[1]), workers=0), tiny_encoder, [{"video": gif}])
    assert r.status_code == 413, r.text
    assert r.json()["error"]["message"] == (
        "input[0]: its frames are 12000x12000 = 144,000,000 pixels; at most 50,000,000 per frame"
    )
    rc, _, err = vs.cli(capsys, "encode", tiny_dirs[1], path, "-o", tmp_path / "e.npz")
    assert rc == 1 and "TooLarge" in err and "12000x12000" in err and "Traceback" not in err, err


def test_the_service_bounds_a_long_clip_without_fps(clips, tiny_dirs, tiny_encoder, monkeypatch):
    """A 2,000-frame clip sent without fps: at most the checkpoint's max_frames (768) frames, fewer
    with --max-frames; past --max-video-patches refused with 413 before a frame is decoded."""
    from qwen_vit_jax.serve.settings import Settings

    data = open(clips[2000], "rb").read()
    base = {"checkpoint": str(tiny_dirs[1]), "workers": 0}
    (few,) = vs.post_items(Settings(**base, max_frames=8), tiny_encoder, [{"video": data}])
    assert few.status_code == 200 and few.json()["data"][0]["grid_thw"] == [4, 4, 6], few.text
    (most,) = vs.post_items(Settings(**base, cache_bytes=0), tiny_encoder, [{"video": data}])
    assert most.status_code == 200 and most.json()["data"][0]["grid_thw"] == [384, 4, 6], most.text
    want = tiny_encoder.encode_video(clips[2000])
    got = np.asarray(most.json()["data"][0]["embedding"], np.float32)
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)

    import qwen_vit_jax.preprocess.video as video

    monkeypatch.setattr(video, "decode", lambda *a, **k: pytest.fail("a frame was decoded"))
    (over,) = vs.post_items(Settings(**base, max_video_patches=2048), tiny_encoder, [{"video": data}])
    assert over.status_code == 413, over.text
    assert over.json()["error"]["message"] == (
        "input[0]: 768 frames of 4x6 = 9,216 patches; at most 2,048 per video (fewer frames: fps or max_frames)"
    )


def test_progress_counts_a_long_videos_frames(capsys, clips, tiny_dirs, tiny_encoder, tmp_path):
    """A video larger than the patch budget goes through in frame groups: the progress says how
    many of its frames are done as it goes, and the bar ends at all of them."""
    from qwen_vit_jax.data.embeddings import run_metadata
    from qwen_vit_jax.data.encode_files import encode_files

    updates = []
    meta = run_metadata("ckpt", tiny_encoder.dtype, tiny_encoder.preprocessing)
    out = tmp_path / "p.safetensors"
    encode_files(tiny_encoder, [clips[60]], out, meta, batch_patches=96, progress=updates.append)
    frames = [u.frames for u in updates if u.frames is not None]
    assert frames[0] == (0, 60) and frames[-1] == (60, 60) and len(frames) == 9  # 8 groups of 4 temporal patches
    assert frames == sorted(frames)
    rc, _, err = vs.cli(capsys, "encode", tiny_dirs[1], clips[60], "-o", tmp_path / "q.npz", "--batch-patches", "96")
    assert rc == 0 and "60/60 frames" in err and "frames/s" in err, err


def test_resume_names_the_settings_that_differ(capsys, clips, tiny_dirs, tmp_path):
    out = tmp_path / "r.npz"
    rc, _, err = vs.cli(capsys, "encode", tiny_dirs[1], clips[60], "-o", out, "--fps", "2")
    assert rc == 0, err
    rc, _, err = vs.cli(capsys, "encode", tiny_dirs[1], clips[60], "-o", out, "--num-frames", "4", "--resume")
    assert rc == 1 and "video_preprocess differing in" in err, err
    assert "fps 2.0 (this run: None)" in err and "num_frames None (this run: 4)" in err
    assert "do_sample_frames" not in err  # the same in both runs: not named
