"""video.py: decoding, frame sampling, sizing and timestamps vs transformers 5.24's video processors.

HF's Qwen2VLVideoProcessor / Qwen3VLVideoProcessor need torchvision, which does not load beside the
CPU torch of the test extra; benchmarks/video_reference.sh runs them in a venv of their own on the
clips of benchmarks/workloads/clips.py and freezes what the containers' metadata decides (sampled
indices, grids, timestamps) in tests/data/video_reference.json. Here the same clips are written again with PyAV and
ours must give exactly those; each sampled frame's pixels must equal HF's torchvision-free image
processor's (PIL) bit for bit. (HF's torchvision resize differs from its own PIL one by up to the
`hf_video_vs_hf_pil` values recorded in the JSON: the bar where HF's backends disagree.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest
import torch

from benchmarks.workloads import clips as video_samples
from qwen_vit_jax.preprocess.config import QWEN3_VL_VIDEO, VIDEO_DEFAULT, PreprocessConfig
from qwen_vit_jax.preprocess.images import smart_resize_3d
from qwen_vit_jax.preprocess.video import VideoError, frame_size, preprocess_video, probe, sample_indices

av = pytest.importorskip("av")
REFERENCE = json.loads((pathlib.Path(__file__).parent / "data" / "video_reference.json").read_text())


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return video_samples.write_all(tmp_path_factory.mktemp("clips"))


def decode_all(path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def config_of(case) -> PreprocessConfig:
    cfg = PreprocessConfig.from_hf(case["config"], video=True)
    return dataclasses.replace(cfg, cap_pixels_per_frame=True) if case["call"].get("cap") else cfg


def call_of(case) -> dict:
    return {k: case["call"][k] for k in ("fps", "num_frames", "max_frames") if k in case["call"]}


# ---- vs the frozen HF reference ------------------------------------------------------------------
def test_reference_covers_the_clips_and_variants():
    assert REFERENCE["versions"]["transformers"] == "5.24.0"
    assert set(REFERENCE["clips"]) == set(video_samples.CLIPS)
    names = {c["config_name"].split()[0] for c in REFERENCE["cases"]}
    assert names == {"qwen2-vl", "qwen2.5-vl", "qwen3-vl"}
    done = [c for c in REFERENCE["cases"] if "error" not in c]
    assert len(done) == len(REFERENCE["cases"])
    # where HF's own backends (torchvision video processor vs PIL image processor) disagree, ours is
    # the PIL one bit for bit
    assert all(c["max_abs"]["ours_vs_hf_pil"] == 0.0 for c in done)
    assert max(c["max_abs"]["hf_video_vs_hf_pil"] for c in done) > 0


@pytest.mark.parametrize("name", sorted(video_samples.CLIPS))
def test_metadata_matches_hf_reader(clips, name):
    info, ref = probe(clips[name]), REFERENCE["clips"][name]
    assert (info.total_frames, info.fps, info.width, info.height) == (
        ref["total_num_frames"],
        ref["fps"],
        ref["width"],
        ref["height"],
    )


@pytest.mark.parametrize("name", sorted(video_samples.CLIPS))
def test_indices_grid_timestamps_match_hf(clips, name):
    info = probe(clips[name])
    for case in [c for c in REFERENCE["cases"] if c["clip"] == name]:
        cfg, call = config_of(case), call_of(case)
        what = f"{case['config_name']} {case['call']}"
        if "max_frames" in call:
            cfg = dataclasses.replace(cfg, max_frames=call["max_frames"])
        fps, num = call.get("fps"), call.get("num_frames")
        if fps is None and num is None and cfg.do_sample_frames:
            fps, num = cfg.fps, cfg.num_frames
        idx = sample_indices(info.total_frames, info.fps, cfg, fps=fps, num_frames=num)
        assert idx.tolist() == case["indices"], what
        _, grid, ts = preprocess_video(clips[name], config=config_of(case), **call)
        assert grid[0].tolist() == case["grid_thw"], what
        if "timestamps" in case:  # Qwen3-VL: what HF's processor prints in the prompt
            np.testing.assert_array_equal(ts, case["timestamps"], err_msg=what)
        elif "second_per_grid_ts" in case:  # Qwen2.5-VL
            assert len(ts) == grid[0, 0] and ts[0] == 0.0
            if len(ts) > 1:
                assert ts[1] - ts[0] == case["second_per_grid_ts"], what
        else:
            assert ts is None, what


@pytest.mark.parametrize(
    "name, case_index",
    [("h264_330x250_24fps_5s", 0), ("mjpeg_odd_213x157_23.976fps_2s", 10), ("png_odd_97x61_7fps_3s", 8)],
)
def test_frames_match_hf_pil_image_processor(clips, name, case_index):
    """Each sampled frame's pixels equal HF's torchvision-free image processor at the video's size."""
    case = [c for c in REFERENCE["cases"] if c["clip"] == name][case_index]
    cfg = config_of(case)
    pv, grid, _ = preprocess_video(clips[name], config=cfg, **call_of(case))
    frames = decode_all(clips[name])[case["indices"]]
    ref = video_samples.hf_pil_pixels(frames, int(grid[0, 1]) * cfg.patch_size, int(grid[0, 2]) * cfg.patch_size, cfg)
    assert pv.dtype == np.float32 and pv.shape == ref.shape
    np.testing.assert_array_equal(pv, ref)
    # decoded frames with their rate sample and size the same way
    pv2, grid2, ts2 = preprocess_video(
        list(decode_all(clips[name])), config=cfg, source_fps=REFERENCE["clips"][name]["fps"], **call_of(case)
    )
    np.testing.assert_array_equal(pv2, pv)
    assert grid2.tolist() == grid.tolist()


# ---- sampling rules ------------------------------------------------------------------------------
def test_qwen2_arange_is_torch_float32():
    """HF's torch.arange(0, total, total / n).int(): 462 frames at 24 fps, fps 2 -> frame 231 (float64: 230)."""
    idx = sample_indices(462, 24.0, VIDEO_DEFAULT, fps=2.0, num_frames=None)
    assert len(idx) == 38 and idx[19] == 231
    assert int(19 * (462 / 38)) == 230
    for total in range(2, 1200, 13):
        for n in range(2, min(total, 300) + 1, 2):
            ref = torch.arange(0, total, total / n).int().numpy()
            got = sample_indices(total, None, VIDEO_DEFAULT, fps=None, num_frames=n)
            np.testing.assert_array_equal(got, ref, err_msg=f"{total} frames, {n} sampled")


def test_qwen2_num_frames_rounds_half_to_even():
    for asked, got in ((5, 4), (7, 8), (9, 8), (11, 12), (1, 0)):
        if got == 0:
            with pytest.raises(ValueError, match="ask for more"):
                sample_indices(100, None, VIDEO_DEFAULT, fps=None, num_frames=asked)
        else:
            assert len(sample_indices(100, None, VIDEO_DEFAULT, fps=None, num_frames=asked)) == got
    with pytest.raises(ValueError, match="cannot sample"):
        sample_indices(10, None, VIDEO_DEFAULT, fps=None, num_frames=12)


def test_qwen3_linspace_and_bounds():
    idx = sample_indices(3, 30.0, QWEN3_VL_VIDEO, fps=None, num_frames=None)  # min_frames 4 > 3 frames
    assert idx.tolist() == [0, 1, 1, 2]  # np.linspace(0, 2, 4).round(): repeats, half to even
    assert sample_indices(1000, 25.0, QWEN3_VL_VIDEO, fps=2.0, num_frames=None).tolist() == list(
        np.linspace(0, 999, 80).round().astype(int)
    )
    few = dataclasses.replace(QWEN3_VL_VIDEO, max_frames=6)
    assert len(sample_indices(1000, 25.0, few, fps=2.0, num_frames=None)) == 6


def test_fps_needs_a_rate_and_excludes_num_frames():
    frames = np.zeros((10, 32, 32, 3), np.uint8)
    with pytest.raises(ValueError, match="source_fps"):
        preprocess_video(frames, fps=2.0)
    with pytest.raises(ValueError, match="mutually exclusive"):
        preprocess_video(frames, fps=2.0, num_frames=4, source_fps=10)
    # decoded frames without a rate: taken as they are (the config's default fps is not applied)
    _, grid, ts = preprocess_video(frames, config=QWEN3_VL_VIDEO)
    assert grid[0, 0] == 5 and ts is None


def test_qwen3_call_max_frames_equals_configured(clips):
    path = clips["h264_330x250_24fps_5s"]
    a = preprocess_video(path, config=QWEN3_VL_VIDEO, max_frames=6)
    b = preprocess_video(path, config=dataclasses.replace(QWEN3_VL_VIDEO, max_frames=6))
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1].tolist() == b[1].tolist() == [[3, 16, 20]]


def test_smart_resize_3d_budget_is_the_whole_clip():
    h, w = smart_resize_3d(8, 360, 640, 2, 32, 4096, 8 * 64 * 32 * 32)  # 64 merge units per frame
    assert (h // 32) * (w // 32) <= 64 and h % 32 == w % 32 == 0
    assert smart_resize_3d(2, 20, 40, 2, 32, 1, 10**9) == (32, 64)  # scaled up to one merge unit first
    with pytest.raises(ValueError, match="at least"):
        smart_resize_3d(1, 100, 100, 2, 32, 1, 10**9)
    cfg = dataclasses.replace(QWEN3_VL_VIDEO, max_pixels=2 * 64 * 32 * 32)
    assert frame_size(8, 360, 640, cfg) < frame_size(2, 360, 640, cfg)


def test_default_config_gives_timestamps(clips, tiny_encoder):
    """A call without config follows a released Qwen2.5-VL checkpoint (the hub's pixel range, HF's
    video processor, Qwen2.5-VL's timestamps): what `encode` holds for the demo's tower, which ships
    that preprocessor_config.json. A file at fps 2 comes back with the seconds of each temporal patch
    (HF's second_per_grid_ts apart), where Qwen2-VL's sampler gives None; frames and sizes the same."""
    from qwen_vit_jax.preprocess.video import DEFAULT_CONFIG

    assert DEFAULT_CONFIG == tiny_encoder.video_preprocess
    assert (DEFAULT_CONFIG.min_pixels, DEFAULT_CONFIG.max_pixels, DEFAULT_CONFIG.video_sampler) == (
        3136,
        12845056,
        "qwen2.5-vl",
    )
    (case,) = [
        c
        for c in REFERENCE["cases"]
        if c["clip"] == "h264_330x250_24fps_5s" and c["config_name"] == "qwen2.5-vl hub" and c["call"] == {"fps": 2.0}
    ]
    path = clips["h264_330x250_24fps_5s"]
    pv, grid, ts = preprocess_video(path, fps=2.0)
    assert grid[0].tolist() == case["grid_thw"] and grid[0, 0] == 5  # the hub's config: HF's grid
    assert ts.tolist() == [i * case["second_per_grid_ts"] for i in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    qwen2 = dataclasses.replace(DEFAULT_CONFIG, video_sampler="qwen2-vl")  # Qwen2-VL: the model reads no time
    pv2, grid2, ts2 = preprocess_video(path, fps=2.0, config=qwen2)
    assert ts2 is None and grid2.tolist() == grid.tolist()
    np.testing.assert_array_equal(pv, pv2)
    frames = decode_all(path)  # decoded frames: the seconds need their rate
    assert preprocess_video(frames, num_frames=4)[2] is None
    assert preprocess_video(frames, source_fps=24.0, fps=2.0)[2].tolist() == ts.tolist()


# ---- files: streaming, errors --------------------------------------------------------------------
def test_truncated_and_corrupt_files_are_named_errors(clips, tmp_path):
    data = pathlib.Path(clips["h264_462f_24fps"]).read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) // 3])  # the moov atom is at the end: unreadable
    with pytest.raises(VideoError, match="cut.mp4") as e:
        preprocess_video(str(cut), fps=2.0)
    assert "Errno" not in str(e.value)  # FFmpeg's words, not its error number
    mjpeg = pathlib.Path(clips["mjpeg_odd_213x157_23.976fps_2s"]).read_bytes()
    short = tmp_path / "short.avi"  # index says 47 frames, the data stops after a third
    short.write_bytes(mjpeg[: len(mjpeg) // 3])
    with pytest.raises(VideoError, match="short.avi"):
        preprocess_video(str(short), num_frames=8)
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video at all" * 100)
    with pytest.raises(VideoError, match="junk.mp4"):
        preprocess_video(junk)
    with pytest.raises(FileNotFoundError, match="missing.mp4"):
        preprocess_video(str(tmp_path / "missing.mp4"))


def test_container_without_frame_count_is_counted(clips):
    info = probe(clips["vp9_232x174_12.5fps_10s_no_count"])
    with av.open(clips["vp9_232x174_12.5fps_10s_no_count"]) as c:
        assert c.streams.video[0].frames == 0  # WebM records no count: HF's PyAV reader would see 0
    assert info.total_frames == 125 and math.isclose(info.fps, 12.5)


def test_config_from_hf_reads_video_configs(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    v = PreprocessConfig.from_hf(tmp_path, video=True)  # HF's fallback: the image file, video defaults
    assert (v.min_pixels, v.max_pixels, v.video_sampler, v.do_sample_frames) == (3136, 12845056, "qwen2-vl", False)
    assert PreprocessConfig.from_hf(tmp_path) == PreprocessConfig(min_pixels=3136, max_pixels=12845056)
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"video_processor_type": "Qwen3VLVideoProcessor", "size": {"shortest_edge": 4096}, "fps": 1})
    )
    v = PreprocessConfig.from_hf(tmp_path, video=True)
    assert (v.video_sampler, v.patch_size, v.min_pixels, v.max_pixels, v.fps) == ("qwen3-vl", 16, 4096, 786432, 1.0)
    assert PreprocessConfig.from_hf({"processor_class": "Qwen2_5_VLProcessor"}).video_sampler == "qwen2.5-vl"
    assert PreprocessConfig.from_hf(v.to_dict()) == v
    with pytest.raises(ValueError, match="video_sampler"):
        PreprocessConfig(video_sampler="qwen9")
    with pytest.raises(ValueError, match="fps"):
        PreprocessConfig(fps=0)


# ---- encode ----------------------------------------------------------------------------------------
def test_encode_video_matches_hf_video_features(clips, tiny_dirs, tiny_encoder):
    """A decoded, sampled clip through our tiny Qwen2.5-VL tower vs HF's (the same weights, float32):
    HF's `get_video_features` is its vision tower on pixel_values_videos, split per video; the fp32
    bars of docs/numerics.md."""
    from hf_utils import assert_fp32_close

    from qwen_vit_jax.tools.hf_reference import hf_visual, load_hf_vision_tower

    path = clips["h264_330x250_24fps_5s"]
    pv, grid, ts = preprocess_video(path, fps=2.0, config=tiny_encoder.video_preprocess)
    assert grid.tolist() == [[5, 18, 24]] and len(ts) == 5  # the reference's grid for this clip at fps 2
    ours = tiny_encoder.encode_video(path, fps=2.0)
    direct = tiny_encoder.encode(pv, grid)  # another call may land in another bucket: 1e-6 (numerics.md)
    assert np.linalg.norm(ours - direct) <= 1e-6 * np.linalg.norm(direct)
    ref = hf_visual(load_hf_vision_tower(tiny_dirs[0]), pv, grid)
    assert ours.shape == ref.shape == (5 * 18 * 24 // 4, tiny_encoder.cfg.out_dim)
    assert_fp32_close(ours, ref)


def test_qwen3_checkpoint_video_config_and_features(clips, tmp_path):
    """A Qwen3-VL checkpoint with the hub's video_preprocessor_config.json: the converter keeps it,
    the encoder samples by it (fps 2 by default, 3-D budget, timestamps as the frozen reference) and
    its tokens equal HF's video features (the tiny tower, fp32 bars)."""
    from hf_utils import assert_fp32_close

    from qwen_vit_jax import VisionEncoder, convert_checkpoint
    from qwen_vit_jax.tools.demo import TINY_QWEN3_VL, write_random_hf_checkpoint
    from qwen_vit_jax.tools.hf_reference import hf_visual, load_hf_vision_tower

    (case,) = [
        c
        for c in REFERENCE["cases"]
        if c["clip"] == "h264_330x250_24fps_5s" and c["config_name"] == "qwen3-vl hub" and not c["call"]
    ]
    hf_dir = write_random_hf_checkpoint(TINY_QWEN3_VL, tmp_path / "hf", seed=3)
    (hf_dir / "video_preprocessor_config.json").write_text(json.dumps(case["config"]))
    enc = VisionEncoder.from_pretrained(convert_checkpoint(hf_dir, tmp_path / "ours"))
    vp = enc.video_preprocess
    assert (vp.video_sampler, vp.fps, vp.min_pixels, vp.max_pixels) == ("qwen3-vl", 2.0, 4096, 25165824)
    path = clips["h264_330x250_24fps_5s"]
    pv, grid, ts = preprocess_video(path, config=vp)
    assert grid[0].tolist() == case["grid_thw"] and ts.tolist() == case["timestamps"]
    ours = enc.encode_video(path)
    assert_fp32_close(ours, hf_visual(load_hf_vision_tower(hf_dir), pv, grid))
