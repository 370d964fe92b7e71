"""What a first trial of the package tripped over, each fixed and kept fixed: `--workers` capped at
the cores, small runs without worker processes, an unreadable file named in its error, no progress
shown for an input that failed, the compilation cache on by default (a second run compiles
nothing), a short `encode --help` by topic, the demo's folders and picture, the license field.
(preprocess_video's timestamps: tests/test_video.py; "1 input": tests/test_embeddings.py.)"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image, UnidentifiedImageError
from sample_images import make_image

from qwen_vit_jax.data.embeddings import read_embeddings
from qwen_vit_jax.data.inputs import load_image
from qwen_vit_jax.tools import cli
from qwen_vit_jax.tools import encode as encode_cmd

ROOT = pathlib.Path(__file__).parents[1]


def main(capsys, *args) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


@pytest.fixture()
def jax_cache_settings():
    """The CLI switches JAX's process-wide compilation cache on (or off): put the session's back."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs", "jax_enable_compilation_cache")
    saved = {k: getattr(jax.config, k) for k in keys}
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


# ---- workers ----------------------------------------------------------------------------------------
def test_workers_capped_at_the_cores(capsys, monkeypatch):
    monkeypatch.setattr(encode_cmd, "cores", lambda: 2)
    assert encode_cmd.capped_workers(99) == 2
    err = capsys.readouterr().err
    assert err == "warning: --workers 99 is more than the cores this process may use (2): 2 workers instead\n"
    assert [encode_cmd.capped_workers(n) for n in (None, 0, 1, 2)] == [None, 0, 1, 2]
    assert capsys.readouterr().err == ""  # no warning where the cores suffice


def test_small_runs_start_no_workers():
    small = encode_cmd.SMALL_RUN
    assert encode_cmd.choose_workers(None, 1, default=3) == 0
    assert encode_cmd.choose_workers(None, small - 1, default=3) == 0
    assert encode_cmd.choose_workers(None, small, default=3) == 3
    assert encode_cmd.choose_workers(2, 1, default=3) == 2  # asked for: as asked (capped before)
    assert encode_cmd.choose_workers(0, 10 * small, default=3) == 0


def test_encode_run_capped_and_small(capsys, tiny_dirs, tmp_path, monkeypatch):
    """The command: --workers 99 warns before anything else happens (here: an empty folder, the next
    error); the default for two inputs runs without worker processes (the summary line says so)."""
    monkeypatch.setattr(encode_cmd, "cores", lambda: 1)
    (tmp_path / "empty").mkdir()
    out = tmp_path / "e.npz"
    rc, _, err = main(capsys, "encode", tiny_dirs[1], tmp_path / "empty", "-o", out, "--workers", "99")
    assert rc == 1 and err.startswith("warning: --workers 99 is more than the cores this process may use (1): ")
    assert "error: no input images" in err
    make_image(56, 56).save(tmp_path / "a.png")
    make_image(56, 84, seed=1).save(tmp_path / "b.png")
    rc, stdout, err = main(capsys, "encode", tiny_dirs[1], tmp_path / "a.png", tmp_path / "b.png", "-o", out)
    assert rc == 0 and "warning" not in err, err
    assert ", 0 workers, " in stdout and read_embeddings(out).names == [str(tmp_path / n) for n in ("a.png", "b.png")]


# ---- an unreadable input ----------------------------------------------------------------------------
def test_unidentified_image_names_its_file(tmp_path):
    notes = tmp_path / "notes.jpg"
    notes.write_text("hello, not a photo")
    for source, kw in ((str(notes), {}), (notes.read_bytes(), {"name": "notes.jpg"})):
        with pytest.raises(UnidentifiedImageError) as e:
            load_image(source, **kw)
        msg = str(e.value)
        assert "notes.jpg is not an image file Pillow can read" in msg and "b'hello, not a pho'" in msg, msg
        assert "BytesIO" not in msg and " at 0x" not in msg
    with pytest.raises(UnidentifiedImageError, match="the input is not an image file"):
        load_image(b"GIF? no")  # bytes with no name


def test_failed_input_named_and_never_shown_done(capsys, tiny_dirs, tmp_path):
    """A text file named .jpg after a good image: the error names it (no `<_io.BytesIO ...>`), and the
    progress bar never counts it (it showed 2/2 before the error); with --keep-going the bar counts
    the readable inputs only."""
    make_image(56, 56).save(tmp_path / "a.png")
    (tmp_path / "notes.jpg").write_text("hello, not a photo")
    inputs = (tmp_path / "a.png", tmp_path / "notes.jpg")
    out = tmp_path / "e.npz"
    rc, _, err = main(capsys, "encode", tiny_dirs[1], *inputs, "-o", out, "--workers", "0")
    assert rc == 1
    assert f"error: cannot read {inputs[1]}: UnidentifiedImageError: {inputs[1]} is not an image file" in err, err
    assert "BytesIO" not in err and "2/2" not in err and "/2 inputs" not in err.split("error:")[1]
    assert read_embeddings(out).names == [str(inputs[0])]  # the input before it, written
    rc, _, err = main(capsys, "encode", tiny_dirs[1], *inputs, "-o", out, "--overwrite", "--keep-going")
    assert rc == 1 and f"warning: skipped {inputs[1]}: UnidentifiedImageError" in err
    bars = re.findall(r"\] (\d+)/(\d+) inputs", err)
    assert bars and bars[-1] == ("1", "1") and ("2", "2") not in bars, err


# ---- the compilation cache ----------------------------------------------------------------------------
def _cached_programs(folder: pathlib.Path) -> set[str]:
    return {p.name for p in folder.rglob("*-cache")} if folder.is_dir() else set()


def test_compile_cache_on_by_default(capsys, tmp_path, tiny_dirs, monkeypatch, jax_cache_settings):
    """Two runs of the same command in fresh processes: the first stores its programs in the user's
    cache folder (here $QWEN_VIT_JAX_CACHE, a temporary one: never the real home), the second stores
    none (it compiled nothing: every program was loaded). --no-compile-cache creates no folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(QWEN_VIT_JAX_CACHE=str(tmp_path / "user_cache"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    make_image(56, 84).save(tmp_path / "a.png")
    cache = tmp_path / "user_cache" / "jax"
    args = ["encode", str(tiny_dirs[1]), str(tmp_path / "a.png"), "-o", str(tmp_path / "e.npz"), "--overwrite"]

    def encode() -> str:
        cmd = [sys.executable, "-m", "qwen_vit_jax.tools.cli", *args]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert p.returncode == 0, p.stderr
        return p.stdout

    assert "loaded from the compile cache" not in encode()
    first = _cached_programs(cache)
    assert first, f"nothing stored in {cache}"
    loaded = r"(\d+) program\(s\) compiled in [\d.]+ s, (\d+) of them loaded from the compile cache"
    second = re.search(loaded, encode())
    assert second and second[1] == second[2]  # the second run compiled nothing: it loaded every program
    assert _cached_programs(cache) == first
    assert not (tmp_path / "xdg").exists()
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("QWEN_VIT_JAX_CACHE", str(tmp_path / "off"))
    rc, _, err = main(capsys, *args, "--no-compile-cache")
    assert rc == 0, err
    assert not (tmp_path / "off").exists()


def test_compile_cache_flags(capsys, tmp_path, monkeypatch, jax_cache_settings):
    from qwen_vit_jax.tools.args import compile_cache_dir, default_cache_dir

    parser = cli.build_parser()

    def resolved(*flags):
        return compile_cache_dir(parser.parse_args(["bench", "ckpt", *map(str, flags)]))

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("QWEN_VIT_JAX_CACHE", str(tmp_path / "q"))
    assert resolved() == str(tmp_path / "q" / "jax") == str(default_cache_dir() / "jax")
    monkeypatch.delenv("QWEN_VIT_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolved() == str(tmp_path / "xdg" / "qwen_vit_jax" / "jax")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "j"))  # JAX's own variable wins
    assert resolved() == str(tmp_path / "j")
    assert resolved("--compile-cache", tmp_path / "c") == str(tmp_path / "c")  # the flag over both
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    demo = parser.parse_args(["demo", "--cache-dir", str(tmp_path / "d")])
    assert compile_cache_dir(demo, demo.cache_dir) == str(tmp_path / "d" / "jax")  # demo keeps all under it
    import jax

    assert resolved("--no-compile-cache") is None and jax.config.jax_enable_compilation_cache is False
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "ckpt", "--compile-cache", "x", "--no-compile-cache"])
    capsys.readouterr()


def test_unwritable_default_cache_is_a_warning(capsys, tiny_dirs, tmp_path, jax_cache_settings):
    from qwen_vit_jax.tools.args import load_encoder

    (tmp_path / "file").write_text("")
    enc = load_encoder(str(tiny_dirs[1]), "float32", str(tmp_path / "file" / "jax"))  # cannot be created
    assert enc.cfg.depth == 4
    assert "warning: compiled programs are not kept: " in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a directory"):  # a file named as the folder: a usage error
        load_encoder(str(tiny_dirs[1]), "float32", str(tmp_path / "file"))


# ---- encode --help ------------------------------------------------------------------------------------
def test_encode_help_short_and_by_topic(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width
    rc, text, _ = main(capsys, "encode", "--help")
    assert rc == 0
    lines = text.splitlines()
    assert len(lines) <= 65 and max(map(len, lines)) <= 80, text
    for group in ("output:", "inputs:", "preprocessing", "compute:", "several processes"):
        assert f"\n{group}" in text, group
    assert "docs/encode.md" in text


def test_every_encode_flag_still_parses():
    args = cli.build_parser().parse_args(
        ["encode", "ck", "a.png", "b/", "-o", "o.parquet", "--resume", "--keep-going", "--cache", "c", "--recursive"]
        + ["--image-column", "jpg", "--key-column", "url", "--allow-duplicate-keys", "--min-pixels", "3136"]
        + ["--max-pixels", "9999", "--fps", "2", "--max-frames", "8", "--fast-decode", "--workers", "3"]
        + ["--dtype", "bfloat16", "--batch-patches", "4096", "--compile-cache", "x", "--coordinator", "h:1"]
        + ["--num-processes", "2", "--process-id", "1", "--distributed"]
        + ["--vllm-store", "s", "--vllm-ids", "vllm", "--vllm-model", "m"]
    )
    got = {k: v for k, v in vars(args).items() if k != "func"}
    assert got == {
        "command": "encode",
        "checkpoint": "ck",
        "inputs": ["a.png", "b/"],
        "output": "o.parquet",
        "resume": True,
        "overwrite": False,
        "keep_going": True,
        "cache": "c",
        "save_every": 600.0,
        "recursive": True,
        "image_column": "jpg",
        "key_column": "url",
        "allow_duplicate_keys": True,
        "min_pixels": 3136,
        "max_pixels": 9999,
        "fps": 2.0,
        "num_frames": None,
        "max_frames": 8,
        "fast_decode": True,
        "workers": 3,
        "dtype": "bfloat16",
        "batch_patches": 4096,
        "compile_cache": "x",
        "no_compile_cache": False,
        "coordinator": "h:1",
        "num_processes": 2,
        "process_id": 1,
        "distributed": True,
        "vllm_store": "s",
        "vllm_ids": "vllm",
        "vllm_model": "m",
    }


# ---- the demo -----------------------------------------------------------------------------------------
def test_demo_folders_and_picture(tmp_path, monkeypatch):
    """A warm demo names both folders (verify needs the HF one); the picture goes beside them unless
    --out says otherwise (never silently into the working directory), is named by its absolute path,
    and says on itself that the weights are random."""
    from qwen_vit_jax.tools.demo import TITLE, prepare_checkpoint, run_demo, title_strip

    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    cold: list[str] = []
    prepare_checkpoint("tiny", tmp_path / "cache", log=cold.append)
    root = tmp_path / "cache" / "demo-tiny"
    assert [line.rsplit(" -> ", 1)[1] for line in cold] == [str(root / "hf"), str(root / "converted")]
    warm: list[str] = []
    png = run_demo("tiny", tmp_path / "cache", log=warm.append)
    assert warm[0] == f"checkpoint: cached, HF layout {root / 'hf'}, converted {root / 'converted'}"
    assert png == root / "demo.png" and png.is_absolute() and warm[-1].endswith(f"-> {png}")
    assert list((tmp_path / "work").iterdir()) == []  # nothing in the working directory
    assert "RANDOM WEIGHTS" in TITLE[0]
    with Image.open(png) as im:
        assert "RANDOM WEIGHTS" in im.text["Description"]
        top = np.asarray(im.convert("RGB"))[: 20 * len(TITLE)]
        np.testing.assert_array_equal(top, np.asarray(title_strip(im.width)))  # drawn on the picture


# ---- packaging ----------------------------------------------------------------------------------------
def test_license_is_an_spdx_string():
    """setuptools deprecates `license = {text = ...}` (removed after Feb 2027): the SPDX form, which
    needs setuptools >= 77 to build."""
    tomllib = pytest.importorskip("tomllib")
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert doc["project"]["license"] == "Apache-2.0"
    (req,) = [r for r in doc["build-system"]["requires"] if r.startswith("setuptools")]
    assert re.fullmatch(r"setuptools>=(\d+)", req) and int(req.split(">=")[1]) >= 77
