"""The host keeps the device fed: uint8 `Patches` (HF's numbers, an eighth of the bytes, normalised on
the device), the Grain worker pipeline (input order and the same bytes for any worker count), the
decode (HF's pixels; --fast-decode close, not equal), Ctrl-C and a killed worker."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from PIL import Image
from sample_images import make_image

import qwen_vit_jax as qvj
from qwen_vit_jax.data.inputs import load_image
from qwen_vit_jax.preprocess.config import GLM4V_PREPROCESS, PADDLEOCR_PREPROCESS, QWEN3_VL_PREPROCESS, PreprocessConfig
from qwen_vit_jax.tools import cli

IMAGES = [(56, 84), (112, 84), (300, 450), (30, 500)]


def _images(alpha: bool = False) -> list:
    out = [make_image(h, w, seed=i) for i, (h, w) in enumerate(IMAGES)]
    grey = np.asarray(make_image(60, 90, seed=9).convert("L"))
    rgba = np.dstack([np.asarray(make_image(70, 70, seed=8)), np.full((70, 70), 128, np.uint8)])
    return [*out, grey, rgba] if alpha else out


# ---- uint8 patches: the same numbers ----------------------------------------------------------------
@pytest.mark.parametrize(
    "prep, cfg",
    [
        (qvj.preprocess_images, PreprocessConfig()),
        (qvj.preprocess_images, QWEN3_VL_PREPROCESS),
        (qvj.preprocess_paddleocr_images, PADDLEOCR_PREPROCESS),
        (qvj.preprocess_glm4v_images, GLM4V_PREPROCESS),
    ],
    ids=["qwen2", "qwen3", "paddleocr", "glm4v"],
)
def test_patches_expand_to_hfs_pixel_values(prep, cfg):
    images = _images(alpha=True)
    pv, thw = prep(images, config=cfg)
    patches, thw2 = prep(images, config=cfg, uint8=True)
    np.testing.assert_array_equal(thw, thw2)
    assert patches.data.dtype == np.uint8 and patches.frames_per_patch == 1 and len(patches) == len(pv)
    np.testing.assert_array_equal(patches.to_float(), pv)  # bit for bit, and so HF's (test_preprocess)
    assert pv.nbytes / patches.data.nbytes == 4 * cfg.temporal_patch_size


def test_video_patches_carry_every_frame():
    frames = [np.asarray(make_image(64, 96, seed=i)) for i in range(5)]
    pv, grid, _ = qvj.preprocess_video(frames, num_frames=4)
    patches, grid2, _ = qvj.preprocess_video(frames, num_frames=4, uint8=True)
    assert patches.frames_per_patch == 2 and (grid == grid2).all()
    np.testing.assert_array_equal(patches.to_float(), pv)
    both = qvj.Patches.concatenate([qvj.preprocess_images([frames[0]], uint8=True)[0], patches])
    np.testing.assert_array_equal(both.to_float(), np.concatenate([qvj.preprocess_images([frames[0]])[0], pv]))


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_device_map_is_within_one_ulp_of_the_table():
    """On the device a byte becomes its float by the affine map through the table's ends: at most one
    float32 ulp (2.4e-7 at HF's |values| <= 2.2) from HF's value, for every byte and channel."""
    import jax

    for cfg in (PreprocessConfig(), PADDLEOCR_PREPROCESS, GLM4V_PREPROCESS):
        patches, _ = qvj.preprocess_images([np.zeros((28, 28, 3), np.uint8)], config=cfg, uint8=True)
        every = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None, None, None, None], (256, 1, 14, 14, 3))
        one = qvj.Patches(np.ascontiguousarray(every), patches.table, patches.temporal_patch_size)
        host = one.to_float()  # the table's values
        device = np.asarray(jax.jit(qvj.Patches.to_float)(jax.device_put(one)))
        assert np.abs(device - host).max() <= 2.5e-7
        assert np.abs(host).max() < 2.2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_encode_patches_equals_float_rows(tiny_dirs, dtype):
    """The uint8 path vs HF's float rows through the same encoder: within the 1e-6 padding bar in
    float32; in bfloat16 a one-ulp input difference can round an operand the other way."""
    enc = qvj.VisionEncoder.from_pretrained(tiny_dirs[1], dtype=dtype)
    pv, thw = qvj.preprocess_images(_images(), config=enc.preprocess)
    patches, _ = qvj.preprocess_images(_images(), config=enc.preprocess, uint8=True)
    bar = 1e-6 if dtype == "float32" else 2e-2
    ref = enc.encode(pv, thw)
    assert _rel(enc.encode(patches, thw), ref) <= bar
    embs = enc.encode_images(_images())  # the uint8 path, image by image
    np.testing.assert_array_equal(np.concatenate(embs), enc.encode(patches, thw))  # the same bits


def test_patches_against_hf(tmp_path):
    """A tiny Qwen2.5-VL and a Qwen3-VL tower: HF on HF's pixel_values vs ours on the uint8 patches."""
    pytest.importorskip("transformers")
    from hf_utils import assert_fp32_close, build_hf_model, hf_visual

    from qwen_vit_jax.tools.demo import TINY, TINY_QWEN3_VL

    for i, (cfg, pre) in enumerate([(TINY, PreprocessConfig()), (TINY_QWEN3_VL, QWEN3_VL_PREPROCESS)]):
        hf = build_hf_model(cfg, seed=i)
        hf.save_pretrained(tmp_path / f"hf{i}")
        enc = qvj.VisionEncoder.from_pretrained(tmp_path / f"hf{i}")
        pv, thw = qvj.preprocess_images(_images(), config=pre)
        patches, _ = qvj.preprocess_images(_images(), config=pre, uint8=True)
        assert_fp32_close(enc.encode(patches, thw), hf_visual(hf, pv, thw))


def test_the_module_takes_patches(tiny_dirs):
    import jax

    model = qvj.load_model(tiny_dirs[1])
    pv, thw = qvj.preprocess_images(_images()[:2])
    patches, _ = qvj.preprocess_images(_images()[:2], uint8=True)
    (plan,) = qvj.make_plans(thw, model.cfg)
    taken = plan.take(patches)
    assert isinstance(taken, qvj.Patches) and len(taken) == plan.bucket.patches
    f = jax.jit(lambda px, p: model(px, p))
    assert _rel(plan.unpad(f(taken, plan)), plan.unpad(f(plan.take(pv), plan))) <= 1e-6


def test_bad_patches_are_named(tiny_encoder):
    patches, thw = qvj.preprocess_images(_images()[:1], uint8=True)
    with pytest.raises(ValueError, match="must be uint8"):
        tiny_encoder.encode(qvj.Patches(patches.data.astype(np.int16), patches.table), thw)
    with pytest.raises(ValueError, match=r"uint8 \[N, S, p, p, C\]"):
        tiny_encoder.encode(qvj.Patches(patches.data[:, :, :7], patches.table), thw)
    with pytest.raises(ValueError, match="rows but grid_thw implies"):
        tiny_encoder.encode(qvj.Patches(patches.data[:-4], patches.table), thw)
    with pytest.raises(ValueError, match="finite float32"):
        tiny_encoder.encode(qvj.Patches(patches.data, patches.table * np.nan), thw)


def test_host_to_device_bytes(tiny_encoder):
    image = tiny_encoder.cost_report([[1, 36, 36]])
    assert image["host_to_device_bytes"] <= image["hf_pixel_bytes"] / 5  # pixels + plan of the padded bucket
    assert image["host_to_device_bytes_float"] > image["hf_pixel_bytes"]  # float rows of the padded bucket
    video = tiny_encoder.cost_report([[3, 36, 36]])
    assert video["host_to_device_bytes"] <= video["hf_pixel_bytes"] / 3  # T frames per row


# ---- decoders -------------------------------------------------------------------------------------
def _jpeg(tmp_path, name, image, **kw):
    path = tmp_path / name
    image.save(path, "JPEG", **kw)
    return str(path)


def test_load_image_is_hfs(tmp_path):
    """Our decode (simplejpeg for RGB JPEGs, Pillow for the rest, and the allocator settings a worker
    runs with) gives HF's load_image pixels: every EXIF orientation, chroma subsampling, progressive,
    grey and CMYK files, a PNG."""
    pytest.importorskip("transformers")
    from transformers.image_utils import load_image as hf_load_image

    from qwen_vit_jax.data.inputs import _simplejpeg
    from qwen_vit_jax.data.pipeline import tune_allocator

    assert tune_allocator() == sys.platform.startswith("linux")  # glibc: applied
    photo = make_image(333, 517, seed=3)
    cases = {
        "444": _jpeg(tmp_path, "a.jpg", photo, quality=92, subsampling=0),
        "422": _jpeg(tmp_path, "a2.jpg", photo, quality=92, subsampling=1),
        "420": _jpeg(tmp_path, "b.jpg", photo, quality=80, subsampling=2),
        "progressive": _jpeg(tmp_path, "c.jpg", photo, quality=85, progressive=True),
        "odd sides": _jpeg(tmp_path, "c2.jpg", photo.crop((0, 0, 331, 515)), quality=85),
        "grey": _jpeg(tmp_path, "d.jpg", photo.convert("L"), quality=90),
        "cmyk": _jpeg(tmp_path, "d2.jpg", photo.convert("CMYK"), quality=90),
    }
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        cases[f"orientation {orientation}"] = _jpeg(tmp_path, f"e{orientation}.jpg", photo, quality=90, exif=exif)
    photo.save(tmp_path / "f.png")
    cases["png"] = str(tmp_path / "f.png")
    for name, path in cases.items():
        ours = load_image(path)
        if _simplejpeg() is not None:  # RGB JPEGs by simplejpeg, as arrays; the rest by Pillow
            assert isinstance(ours, np.ndarray) == (name not in ("grey", "cmyk", "png")), name
        ours = ours if isinstance(ours, np.ndarray) else np.asarray(ours.convert("RGB"))
        np.testing.assert_array_equal(ours, np.asarray(hf_load_image(path).convert("RGB")), err_msg=name)
        if name.startswith("orientation"):
            assert ours.shape == ((333, 517, 3) if name[-1] not in "5678" else (517, 333, 3)), name
    truncated = tmp_path / "g.jpg"
    truncated.write_bytes(pathlib.Path(cases["420"]).read_bytes()[:3000])
    with pytest.raises(OSError, match="truncated"):  # simplejpeg refuses it; Pillow's error, as before
        load_image(str(truncated))


def test_fast_decode_is_close_not_exact(tmp_path):
    from skimage import data as photos

    prep = qvj.Preprocessing.defaults("qwen2_5_vl").with_limits(max_pixels=300 * 400)
    big = Image.fromarray(photos.astronaut()).resize((1600, 1200), Image.BICUBIC)
    path = _jpeg(tmp_path, "big.jpg", big, quality=90)
    exact = qvj.data.load([path], preprocessing=prep, workers=0)
    fast = qvj.data.load([path], preprocessing=prep, workers=0, fast_decode=True)
    with exact, fast:
        (a,), (b,) = list(exact), list(fast)
    assert (a.grid == b.grid).all()
    diff = np.abs(a.patches.data.astype(int) - b.patches.data.astype(int))
    assert 0 < diff.mean() < 3 and diff.max() < 96, (diff.mean(), diff.max())  # not HF's pixels, but close


# ---- the pipeline ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("feed")
    for i, (h, w) in enumerate([(56, 84), (112, 84), (84, 84), (140, 56), (56, 56), (98, 70)]):
        make_image(h, w, seed=i).save(d / f"im{i}.jpg", quality=90)
    return d


def test_load_keeps_order_and_bytes_for_any_worker_count(folder, tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"not a jpeg")
    inputs = [*sorted(map(str, folder.glob("*.jpg")))[:3], str(tmp_path / "bad.jpg"), make_image(40, 60), "x.jpg"]
    runs = []
    for workers in (0, 1, 2):
        with qvj.data.load(inputs, workers=workers) as items:
            runs.append(list(items))
    for items in runs:
        assert [i.name for i in items] == [*inputs[:4], "image 4", "x.jpg"]
        assert [i.error is None for i in items] == [True, True, True, False, True, False]
        assert "bad.jpg" in items[3].name and "UnidentifiedImageError" in items[3].error
        assert "FileNotFoundError" in items[5].error
    for a, b in zip(runs[0], runs[2]):
        if a.error is None:
            assert (a.grid == b.grid).all() and np.array_equal(a.patches.data, b.patches.data)


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """Enough inputs that both workers are still at work (their buffers full) when a run pauses."""
    d = tmp_path_factory.mktemp("many")
    for i in range(20):
        make_image(56 + 14 * (i % 3), 84, seed=i).save(d / f"im{i:02d}.jpg", quality=90)
    return d


def _args(tiny_dirs, folder, out, *extra) -> list[str]:
    return ["encode", str(tiny_dirs[1]), str(folder), "-o", str(out), "--batch-patches", "40", *map(str, extra)]


def _encode(tiny_dirs, folder, out, *extra, env=None, **kw):
    """The console script's run in a fresh process (its exit: Grain's shared memory freed)."""
    script = "from qwen_vit_jax.tools.cli import run; run()"
    cmd = [sys.executable, "-c", script, *_args(tiny_dirs, folder, out, *extra)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, **kw)


def test_cli_output_is_the_same_file_for_any_worker_count(tiny_dirs, folder, tmp_path):
    outs = []
    for workers in (0, 1, 2):
        out = tmp_path / f"w{workers}.safetensors"
        p = _encode(tiny_dirs, folder, out, "--workers", str(workers))
        assert p.returncode == 0, p.stderr
        assert f"{workers} worker" in p.stdout and "waiting for inputs" in p.stdout
        assert "leaked" not in p.stderr  # Grain's shared memory is freed before the process ends
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] == outs[2]


# A CLI run that pauses at its second batch until `FLAG` exists (then goes on), marked in its environment.
PAUSING = r"""
import os, sys, time
from qwen_vit_jax.runtime import encoder
from qwen_vit_jax.tools import cli

real, calls = encoder.VisionEncoder.encode, []
def encode(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        print("PAUSED", flush=True, file=sys.stderr)
        while not os.path.exists(os.environ["FLAG"]):
            time.sleep(0.05)
    return real(self, *args, **kwargs)
encoder.VisionEncoder.encode = encode
cli.run()
"""


def _marked(marker: str, workers: bool = False) -> list[int]:
    """Pids of the live processes whose environment holds `marker`: this run's CLI and what it started
    (its workers alone with `workers`; multiprocessing's resource tracker besides)."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes() and (
                    not workers or b"spawn_main" in (entry / "cmdline").read_bytes()
                ):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _start_paused(tiny_dirs, folder, out, tmp_path):
    marker = f"QVJ_TEST_RUN={uuid.uuid4().hex}"
    env = dict(os.environ, FLAG=str(tmp_path / "go"), QVJ_TEST_RUN=marker.split("=")[1])
    cmd = [sys.executable, "-c", PAUSING, "encode", str(tiny_dirs[1]), str(folder), "-o", str(out)]
    cmd += ["--batch-patches", "40", "--workers", "2"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if line.startswith("PAUSED"):
            return proc, marker
    proc.kill()
    pytest.fail(f"never paused: {proc.communicate()}")


@pytest.fixture
def cleanup():
    """Kill whatever a test's run left (its process and its workers), whatever the outcome."""
    started = []
    yield started
    for proc, marker in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _marked(marker):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not pathlib.Path("/proc/self/environ").exists(), reason="needs /proc")
def test_ctrl_c_with_workers_saves_and_leaves_no_worker(tiny_dirs, many, tmp_path, cleanup):
    out = tmp_path / "o.safetensors"
    proc, marker = _start_paused(tiny_dirs, many, out, tmp_path)
    cleanup.append((proc, marker))
    workers = _marked(marker, workers=True)
    assert len(workers) == 2
    for pid in [proc.pid, *workers]:  # what a terminal's Ctrl-C does: the signal to every process
        os.kill(pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted; 1 new input written" in err and "Traceback" not in err, err
    assert len(qvj.read_embeddings(out)) == 1
    time.sleep(0.5)
    assert _marked(marker) == []  # no worker left behind
    assert sorted(os.listdir(tmp_path)) == ["o.safetensors"]


@pytest.mark.skipif(not pathlib.Path("/proc/self/environ").exists(), reason="needs /proc")
def test_a_killed_worker_is_a_named_error_and_nothing_is_lost(tiny_dirs, many, tmp_path, cleanup):
    out = tmp_path / "o.safetensors"
    proc, marker = _start_paused(tiny_dirs, many, out, tmp_path)
    cleanup.append((proc, marker))
    workers = _marked(marker, workers=True)
    os.kill(workers[0], signal.SIGKILL)
    (tmp_path / "go").touch()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "a preprocessing worker process died (SIGKILL" in err and "Traceback" not in err, err
    held = qvj.read_embeddings(out)  # the batches before it, whole
    assert 1 <= len(held) < 20
    time.sleep(0.5)
    assert _marked(marker) == []
    # --resume finishes the run: every input once, the bytes of a clean run (both in this process)
    assert cli.main(_args(tiny_dirs, many, out, "--resume", "--workers", "2")) == 0
    clean = tmp_path / "clean.safetensors"
    assert cli.main(_args(tiny_dirs, many, clean, "--workers", "0")) == 0
    assert out.read_bytes() == clean.read_bytes()
