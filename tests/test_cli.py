"""The `qwen-vit-jax` command line: every command's help, happy paths and error paths.

The console script's help, a first `encode` and `demo` run as real subprocesses (the entry point,
exit status, stdout / stderr as a user sees them; encode and demo with torch and transformers made
unimportable, as after a plain `pip install`); the rest call `cli.main` in-process, which
returns the exit status and prints exactly what the command line would (an uncaught exception,
i.e. a traceback, fails the test), without paying for a fresh jax / torch import each time."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from cli_runs import assert_clean_error, main, run, run_processes
from PIL import Image
from sample_images import make_image

from qwen_vit_jax.data.embeddings import read_embeddings
from qwen_vit_jax.data.inputs import load_image
from qwen_vit_jax.data.stream import Progress
from qwen_vit_jax.tools import cli
from qwen_vit_jax.tools import encode as encode_cmd
from qwen_vit_jax.tools.demo import TINY

COMMANDS = ("convert", "export", "encode", "verify", "bench", "demo")


# ---- help -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(capsys, command):
    rc, out, _ = main(capsys, command, "--help")
    assert rc == 0
    assert out.startswith(f"usage: {cli.PROG} {command}")


def test_top_level_help_and_console_script():
    exe = shutil.which("qwen-vit-jax")
    cmd = [exe] if exe else [sys.executable, "-m", "qwen_vit_jax.tools.cli"]  # not pip-installed: the module
    p = subprocess.run([*cmd, "--help"], check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for command in COMMANDS:
        assert f"\n    {command} " in p.stdout


def test_usage_errors(capsys):
    rc, _, err = main(capsys)  # no command: the usage, exit 2
    assert rc == 2 and "usage:" in err
    rc, _, err = main(capsys, "frobnicate")
    assert rc == 2 and "invalid choice" in err
    rc, _, err = main(capsys, "encode", "ckpt", "x.png")  # -o missing
    assert rc == 2 and "-o/--output" in err


# ---- convert ----------------------------------------------------------------------------------------
def test_convert(capsys, tiny_dirs, tmp_path):
    hf, _ = tiny_dirs
    rc, out, _ = main(capsys, "convert", hf, tmp_path / "ours")
    assert rc == 0 and "converted qwen2_5_vl" in out
    assert (tmp_path / "ours" / "params.safetensors").is_file()
    assert (tmp_path / "ours" / "preprocessor_config.json").is_file()

    rc, _, err = main(capsys, "convert", hf, tmp_path / "ours")
    assert_clean_error(rc, err, "exists")
    rc, _, _ = main(capsys, "convert", hf, tmp_path / "ours", "--overwrite", "--dtype", "bfloat16")
    assert rc == 0
    rc, _, err = main(capsys, "convert", tmp_path / "missing", tmp_path / "o2")
    assert_clean_error(rc, err, "missing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    rc, _, err = main(capsys, "convert", tmp_path / "broken", tmp_path / "o3")
    assert_clean_error(rc, err, "config.json")
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


# ---- encode -----------------------------------------------------------------------------------------
@pytest.fixture()
def image_dir(tmp_path):
    """A folder of three small images (PNG, JPEG, WebP) plus files encode must ignore."""
    d = tmp_path / "images"
    d.mkdir()
    make_image(56, 84, seed=1).save(d / "a.png")
    make_image(112, 84, seed=2).save(d / "b.jpg", quality=95)
    make_image(84, 84, seed=3).save(d / "c.webp", lossless=True)
    (d / "notes.txt").write_text("not an image")
    make_image(56, 56).save(d / ".hidden.png")
    return d


def expected(enc, paths):
    return enc.encode_images([load_image(str(p)) for p in paths])


def test_encode_writes_embeddings(tiny_dirs, tiny_encoder, image_dir, tmp_path):
    _, ckpt = tiny_dirs
    out = tmp_path / "emb.safetensors"
    p = run("encode", ckpt, image_dir, "-o", out)
    assert p.returncode == 0, p.stderr
    assert "encoded 3 inputs" in p.stdout and "3/3 inputs" in p.stderr

    e = read_embeddings(out)
    paths = [image_dir / n for n in ("a.png", "b.jpg", "c.webp")]
    assert e.names == [str(p) for p in paths]
    assert e.grid_thw.tolist() == [[1, 4, 6], [1, 8, 6], [1, 6, 6]]
    assert e.offsets.tolist() == [0, 6, 18, 27]
    assert e.embeddings.shape == (27, TINY.out_dim) and e.embeddings.dtype == np.float32
    assert e.metadata["dtype"] == "float32" and e.metadata["checkpoint"] == str(ckpt.resolve())
    for i, ref in enumerate(expected(tiny_encoder, paths)):
        assert np.linalg.norm(e[i] - ref) <= 1e-6 * np.linalg.norm(ref)


def test_encode_resume(capsys, tiny_dirs, tiny_encoder, image_dir, tmp_path):
    """--resume: one more image; the ones already done are skipped and kept bit for bit."""
    _, ckpt = tiny_dirs
    out = tmp_path / "emb.safetensors"
    rc, _, err = main(capsys, "encode", ckpt, image_dir, "-o", out)
    assert rc == 0, err
    e = read_embeddings(out)
    make_image(168, 56, seed=4).save(image_dir / "d.bmp")
    rc, stdout, err = main(capsys, "encode", ckpt, image_dir, "-o", out, "--resume")
    assert rc == 0, err
    assert "3 of 4 inputs already in" in err and "encoded 1 input (" in stdout
    e2 = read_embeddings(out)
    assert e2.names == e.names + [str(image_dir / "d.bmp")]
    assert e2.grid_thw.tolist()[-1] == [1, 12, 4] and e2.offsets[-1] == 27 + 12
    np.testing.assert_array_equal(e2.embeddings[:27], e.embeddings)
    (ref,) = expected(tiny_encoder, [image_dir / "d.bmp"])
    assert np.linalg.norm(e2[3] - ref) <= 1e-6 * np.linalg.norm(ref)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # no temp file left


def test_encode_npz_and_errors(capsys, tiny_dirs, tiny_encoder, image_dir, tmp_path):
    _, ckpt = tiny_dirs
    out = tmp_path / "emb.npz"
    rc, _, err = main(capsys, "encode", ckpt, image_dir / "c.webp", image_dir / "a.png", "-o", out)
    assert rc == 0, err
    with np.load(out, allow_pickle=False) as z:  # plain numpy can read it
        assert sorted(z.files) == ["embeddings", "grid_thw", "metadata", "names", "offsets", "timestamps"]
        assert z["names"].tolist() == [str(image_dir / "c.webp"), str(image_dir / "a.png")]
    e = read_embeddings(out)
    for i, ref in enumerate(expected(tiny_encoder, [image_dir / "c.webp", image_dir / "a.png"])):
        assert np.linalg.norm(e[i] - ref) <= 1e-6 * np.linalg.norm(ref)

    rc, _, err = main(capsys, "encode", ckpt, image_dir / "a.png", "-o", out)
    assert_clean_error(rc, err, "exists", "--resume")
    rc, _, err = main(capsys, "encode", ckpt, image_dir / "a.png", "-o", out, "--resume", "--dtype", "bfloat16")
    assert_clean_error(rc, err, "dtype")
    rc, _, err = main(capsys, "encode", ckpt, tmp_path / "nope.png", "-o", tmp_path / "x.npz")
    assert_clean_error(rc, err, "input not found", "nope.png")
    rc, _, err = main(capsys, "encode", ckpt, image_dir, "-o", tmp_path / "x.h5")
    assert_clean_error(rc, err, ".safetensors, .npz or .parquet")
    rc, _, err = main(capsys, "encode", tmp_path / "no_ckpt", image_dir, "-o", tmp_path / "x.npz")
    assert_clean_error(rc, err, "no_ckpt")
    (tmp_path / "empty").mkdir()
    rc, _, err = main(capsys, "encode", ckpt, tmp_path / "empty", "-o", tmp_path / "x.npz")
    assert_clean_error(rc, err, "no input images")
    assert not (tmp_path / "x.npz").exists()


def test_encode_stops_at_an_unreadable_image(capsys, tiny_dirs, image_dir, tmp_path):
    """Without --keep-going the first unreadable input stops the run, named; the inputs before it are
    written whole, and --resume --keep-going goes on from there."""
    _, ckpt = tiny_dirs
    (image_dir / "b2.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")  # after a.png, b.jpg
    out = tmp_path / "emb.npz"
    rc, _, err = main(capsys, "encode", ckpt, image_dir, "-o", out, "--batch-patches", "24")  # one per call
    assert_clean_error(rc, err, f"cannot read {image_dir / 'b2.png'}: UnidentifiedImageError", "--keep-going")
    assert read_embeddings(out).names == [str(image_dir / n) for n in ("a.png", "b.jpg")]
    rc, _, err = main(capsys, "encode", ckpt, image_dir, "-o", out, "--resume", "--keep-going")
    assert_clean_error(rc, err, "1 of 2 inputs could not be read")
    assert read_embeddings(out).names[-1] == str(image_dir / "c.webp")
    (image_dir / "b2.png").unlink()
    rc, _, err = main(capsys, "encode", ckpt, image_dir / "b2.png", "-o", tmp_path / "x.npz")
    assert_clean_error(rc, err, "input not found")
    (image_dir / "bad.png").write_bytes(b"nope")
    rc, _, err = main(capsys, "encode", ckpt, image_dir / "bad.png", "-o", tmp_path / "x.npz")
    assert_clean_error(rc, err, "bad.png", "nothing written")
    assert not (tmp_path / "x.npz").exists()


def test_encode_skips_unreadable_images(capsys, tiny_dirs, image_dir, tmp_path):
    """--keep-going: a broken file is named in a warning, the rest are written, the exit status is 1;
    after the file is fixed, --resume adds just it."""
    _, ckpt = tiny_dirs
    (image_dir / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    Image.new("RGB", (3000, 10)).save(image_dir / "strip.png")  # aspect ratio 300 > 200: HF refuses too
    out = tmp_path / "emb.safetensors"
    rc, _, err = main(capsys, "encode", ckpt, image_dir, "-o", out, "--keep-going")
    assert_clean_error(rc, err, "2 of 5 inputs could not be read")
    assert f"warning: skipped {image_dir / 'broken.png'}:" in err
    assert f"warning: skipped {image_dir / 'strip.png'}:" in err and "aspect ratio" in err
    assert len(read_embeddings(out).names) == 3

    make_image(56, 56).save(image_dir / "broken.png")
    (image_dir / "strip.png").unlink()
    rc, _, err = main(capsys, "encode", ckpt, image_dir, "-o", out, "--resume")
    assert rc == 0, err
    assert read_embeddings(out).names[-1] == str(image_dir / "broken.png")


def test_encode_interrupted_saves_progress(capsys, tiny_dirs, tiny_encoder, image_dir, tmp_path, monkeypatch):
    """Ctrl-C after the first batch: OUT holds that batch, and --resume finishes the rest."""
    calls = []

    class Interrupted:  # the tiny encoder, with Ctrl-C arriving during the second call
        def __getattr__(self, name):
            return getattr(tiny_encoder, name)

        def encode(self, pixel_values, grid_thw):
            calls.append(len(grid_thw))
            if len(calls) == 2:
                raise KeyboardInterrupt
            return tiny_encoder.encode(pixel_values, grid_thw)

    monkeypatch.setattr(encode_cmd, "load_encoder", lambda checkpoint, dtype, compile_cache: Interrupted())
    out = tmp_path / "emb.npz"
    # one image per call: a.png is 24 patches, the others more
    rc, _, err = main(capsys, "encode", tiny_dirs[1], image_dir, "-o", out, "--batch-patches", "24")
    assert rc == 130
    assert_clean_error(rc, err, "interrupted; 1 new input written")
    assert read_embeddings(out).names == [str(image_dir / "a.png")]
    monkeypatch.undo()
    rc, _, err = main(capsys, "encode", tiny_dirs[1], image_dir, "-o", out, "--resume")
    assert rc == 0, err
    assert len(read_embeddings(out).names) == 3


# ---- several processes -------------------------------------------------------------------------------
def test_encode_two_processes_equals_one(capsys, tiny_dirs, image_dir, tmp_path):
    """Two processes on 127.0.0.1 with 2 host devices each write two shards and an index; the set
    reads back as the single-process file: same names, order, grids, offsets, embeddings (1e-6).
    Then --resume per shard: a lost shard is redone by its process, the other keeps its own."""
    _, ckpt = tiny_dirs
    make_image(168, 56, seed=4).save(image_dir / "d.bmp")
    make_image(252, 280, seed=5).save(image_dir / "e.png")
    ref_path = tmp_path / "ref.safetensors"
    rc, _, err = main(capsys, "encode", ckpt, image_dir, "-o", ref_path)  # one process, one device
    assert rc == 0, err
    ref = read_embeddings(ref_path)

    out = tmp_path / "emb.safetensors"
    results = run_processes(2, "encode", ckpt, image_dir, "-o", out)
    assert [rc for rc, _ in results] == [0, 0], results
    assert "process 1 of 2:" in results[1][1]
    shards = [tmp_path / "emb-00000-of-00002.safetensors", tmp_path / "emb-00001-of-00002.safetensors"]
    assert all(p.is_file() for p in shards) and (tmp_path / "emb.safetensors.index.json").is_file()
    assert not out.exists()
    parts = [read_embeddings(p) for p in shards]
    assert len(parts[0]) and len(parts[1])  # both processes had work
    got = read_embeddings(out)
    assert got.names == ref.names and got.names == parts[0].names + parts[1].names
    np.testing.assert_array_equal(got.grid_thw, ref.grid_thw)
    np.testing.assert_array_equal(got.offsets, ref.offsets)
    for i in range(len(ref)):
        assert np.linalg.norm(got[i] - ref[i]) <= 1e-6 * np.linalg.norm(ref[i])

    shards[1].unlink()  # a lost shard; --resume redoes it, process 0 has nothing left to do
    results = run_processes(2, "encode", ckpt, image_dir, "-o", out, "--resume")
    assert [rc for rc, _ in results] == [0, 0], results
    assert f"resume: {len(parts[0])} of 5 inputs already in" in results[0][1]
    assert "process 0 of 2: 0 of" in results[0][1]
    np.testing.assert_array_equal(read_embeddings(shards[0]).embeddings, parts[0].embeddings)
    again = read_embeddings(out)
    assert again.names == ref.names
    np.testing.assert_array_equal(again.embeddings, got.embeddings)


def test_encode_process_flags(capsys, tiny_dirs, image_dir, tmp_path):
    rc, _, err = main(capsys, "encode", tiny_dirs[1], image_dir, "-o", tmp_path / "e.npz", "--num-processes", "2")
    assert_clean_error(rc, err, "missing --coordinator, --process-id")
    rc, _, err = main(
        capsys,
        "encode",
        tiny_dirs[1],
        image_dir,
        "-o",
        tmp_path / "e.npz",
        "--coordinator",
        "h:1",
        "--num-processes",
        "2",
        "--process-id",
        "5",
    )
    assert_clean_error(rc, err, "--process-id must be in 0 .. 1")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "KUBERNETES_", "TPU_"))}
    p = run("encode", tiny_dirs[1], image_dir, "-o", tmp_path / "e.npz", "--distributed", env=env, timeout=120)
    assert_clean_error(p.returncode, p.stderr, "--distributed: jax.distributed.initialize() found no cluster")


def test_progress_bar_counts_and_rate():
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    s = Tty()
    p = Progress(4, stream=s)
    p.update_to(4)
    p.close()
    assert "\r[" in s.getvalue() and "4/4 images" in s.getvalue() and "images/s" in s.getvalue()
    s = io.StringIO()
    p = Progress(4, stream=s)
    p.update_to(1)  # not a terminal: no line until 10 s have passed or it finishes
    p.update_to(4)
    p.update_to(4)
    assert s.getvalue().count("\n") == 1 and "\r" not in s.getvalue()


# ---- verify -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory):
    """A tiny HF model built and saved by transformers itself (save_pretrained), not by our writer."""
    pytest.importorskip("torch")
    from hf_utils import build_hf_model

    root = tmp_path_factory.mktemp("hf_saved")
    model = build_hf_model(TINY, seed=3)
    model.save_pretrained(root / "hf")
    return model, root / "hf"


def test_verify_passes_on_a_transformers_checkpoint(capsys, hf_saved):
    _, hf_dir = hf_saved
    rc, out, err = main(capsys, "verify", hf_dir, "--bf16")
    assert rc == 0, out + err
    lines = out.splitlines()
    assert lines[-1] == "PASS"
    assert sum(line.startswith("float32 ") and line.endswith("PASS") for line in lines) == 3
    assert sum(line.startswith("bfloat16 ") and line.endswith("PASS") for line in lines) == 3


def test_verify_fails_on_other_weights(capsys, hf_saved, tiny_dirs):
    """The demo checkpoint has the same config but other weights: FAIL, exit 1."""
    _, hf_dir = hf_saved
    rc, out, err = main(capsys, "verify", hf_dir, tiny_dirs[1])
    assert rc == 1, err
    assert out.splitlines()[-1] == "FAIL"


def test_verify_errors(capsys, tmp_path, tiny_dirs, monkeypatch):
    rc, _, err = main(capsys, "verify", tmp_path / "missing")
    assert_clean_error(rc, err, "missing")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    rc, _, err = main(capsys, "verify", tiny_dirs[0])
    assert rc == 2
    assert_clean_error(rc, err, "needs torch and transformers")


def test_random_checkpoint_matches_transformers_layout(hf_saved, tiny_dirs):
    """demo.write_random_hf_checkpoint writes the keys, shapes and config HF itself writes."""
    from transformers import AutoConfig

    from qwen_vit_jax.tools.demo import random_hf_tensors
    from qwen_vit_jax.weights.safetensors_io import read_safetensors

    model, hf_dir = hf_saved
    ours = {k: v.shape for k, v in random_hf_tensors(TINY).items()}
    saved = read_safetensors(hf_dir / "model.safetensors")
    theirs = {k: v.shape for k, v in saved.items() if k.startswith("visual.")}
    assert ours == theirs
    config = AutoConfig.from_pretrained(tiny_dirs[0])
    assert config.model_type == "qwen2_5_vl"
    assert config.vision_config.to_dict() | {"transformers_version": None} == model.config.vision_config.to_dict() | {
        "transformers_version": None
    }


# ---- bench / demo -----------------------------------------------------------------------------------
def test_bench(capsys, tiny_dirs, tmp_path, restore_compilation_cache):
    cache = tmp_path / "xla"
    rc, out, err = main(
        capsys, "bench", tiny_dirs[1], "--sizes", "8x8,2x4x6", "--repeats", "2", "--compile-cache", cache
    )
    assert rc == 0, err
    rows = out.splitlines()[2:]
    assert [r.split()[:2] for r in rows] == [["8x8", "64"], ["2x4x6", "48"]]
    assert any(cache.iterdir())  # the programs of the buckets run
    rc, _, err = main(capsys, "bench", tiny_dirs[1], "--compile-cache", tiny_dirs[1] / "config.json")
    assert_clean_error(rc, err, "not a directory")
    rc, _, err = main(capsys, "bench", tiny_dirs[1], "--sizes", "8x")
    assert_clean_error(rc, err, "'8x'")
    rc, _, err = main(capsys, "bench", tiny_dirs[1], "--sizes", "7x8")
    assert_clean_error(rc, err, "multiples of spatial_merge_size")
    rc, out, err = main(capsys, "bench", tiny_dirs[1], "--sizes", "2x24x24,17x16")  # the odd one is last
    assert_clean_error(rc, err, "17x16", "multiples of spatial_merge_size")
    assert "patches/s" not in out  # rejected before the first size was compiled and timed


def test_demo(tmp_path):
    env = dict(os.environ, QWEN_VIT_JAX_CACHE=str(tmp_path / "unused"))
    out = tmp_path / "pics" / "demo.png"
    p = run("demo", "--size", "tiny", "--cache-dir", tmp_path / "cache", "--out", out, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "second call" in p.stdout and str(out) in p.stdout
    assert "compile count still 1" in p.stdout
    with Image.open(out) as im:
        assert im.format == "PNG" and im.mode == "RGB" and im.width > 400
    assert (tmp_path / "cache" / "demo-tiny" / "converted" / "params.safetensors").is_file()
    assert not (tmp_path / "unused").exists()
    # The README's demo block is this output: the same lines, numbers and paths aside (the numba line
    # shows only on a first run after an install).
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("$ qwen-vit-jax demo\n", 1)[1].split("```", 1)[0]

    def shape(text):
        lines = [ln for ln in text.splitlines() if ln and not ln.startswith("host planner:")]
        # numbers and paths as #, runs of spaces as one (a first call over 10 s is one digit wider)
        return [re.sub(r" +", " ", re.sub(r"\d[\d,.]*|(?:~|/)\S*", "#", ln)) for ln in lines]

    assert shape(block) == shape(p.stdout)


def test_demo_variant_qwen3_vl(tmp_path, capsys):
    """--variant qwen3-vl: the demo runs (without torch) on a random Qwen3-VL checkpoint in its own
    cache folder, with the hub's Qwen3 preprocessor; `verify` checks it against HF's Qwen3-VL
    tower; sizes a variant lacks are a clean error."""
    from qwen_vit_jax.preprocess.config import QWEN3_VL_PREPROCESS, PreprocessConfig
    from qwen_vit_jax.tools.demo import TINY_QWEN3_VL, demo_config, prepare_checkpoint
    from qwen_vit_jax.weights.convert import load_converted

    out = tmp_path / "demo.png"
    p = run("demo", "--variant", "qwen3-vl", "--cache-dir", tmp_path, "--out", out)  # no torch
    assert p.returncode == 0, p.stdout + p.stderr
    assert "qwen3_vl" in p.stdout and "compile count still 1" in p.stdout and out.is_file()
    ours = prepare_checkpoint("tiny", tmp_path, log=lambda *_: None, variant="qwen3-vl")  # cached
    assert ours == tmp_path / "demo-qwen3-vl-tiny" / "converted"
    assert load_converted(ours)[0] == TINY_QWEN3_VL and TINY_QWEN3_VL.num_deepstack == 2
    assert PreprocessConfig.from_hf(ours) == QWEN3_VL_PREPROCESS
    rc, out, err = main(capsys, "verify", ours.parent / "hf", ours)  # HF's Qwen3-VL tower as the reference
    assert rc == 0, err
    assert "qwen3_vl vision tower" in out and out.rstrip().endswith("PASS")
    assert demo_config("qwen2.5-vl", "full") == demo_config("qwen2.5-vl", "3b")
    with pytest.raises(ValueError, match="size must be one of"):
        demo_config("qwen3-vl", "3b")
    rc, _, err = main(capsys, "demo", "--variant", "qwen3-vl", "--size", "3b", "--cache-dir", tmp_path)
    assert_clean_error(rc, err, "'3b'")
