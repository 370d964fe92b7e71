"""The bad-input matrix (docs/hardening.md): one test per row not already covered elsewhere; each
checks the error names the offending value. Rows covered by other files name their test in
the doc; the NaN / Inf pixel rows belong to the non-finite check in `encode` (tested there)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from sample_images import make_image

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.data.embeddings import read_embeddings
from qwen_vit_jax.plan import make_plans
from qwen_vit_jax.presets import QWEN2_5_VL_3B
from qwen_vit_jax.tools import cli
from qwen_vit_jax.weights.convert import convert_checkpoint
from qwen_vit_jax.weights.hf_read import read_hf_vision_params
from qwen_vit_jax.weights.safetensors_io import CheckpointError, SafetensorsFile, read_safetensors, write_safetensors

P = 1176  # patch_dim of the tiny tower (3 * 2 * 14 * 14)


def _pixels(n, dtype=np.float32):
    return np.random.default_rng(0).standard_normal((n, P)).astype(dtype)


# ---- grids ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "grid, needle",
    [
        ([[1, 4, 4], [0, 4, 4]], r"row 1 = \[0, 4, 4\]: t must be positive, got 0"),  # zero
        ([[1, -4, 4]], r"row 0 = \[1, -4, 4\]: h must be positive, got -4"),  # negative
        ([[1, 4, 5]], r"row 0 = \[1, 4, 5\].*multiples of spatial_merge_size 2 \(odd"),  # odd
        (np.array([[1.0, 4.0, 4.0]]), "must hold integers, got dtype float64"),  # float
        ([1, 4, 4], r"shape \[k, 3\].*got shape \(3,\)"),  # wrong ndim
        ([[[1, 4, 4]]], r"shape \[k, 3\].*got shape \(1, 1, 3\)"),  # wrong ndim
        ([[1 << 12, 1 << 9, 1 << 10]], f"describes {1 << 31} patches, more than {1 << 30}"),  # too large
    ],
    ids=["zero", "negative", "odd", "float", "ndim1", "ndim3", "too_large"],
)
def test_bad_grid(tiny_encoder, grid, needle):
    with pytest.raises(ValueError, match=needle):
        tiny_encoder.encode(_pixels(16), grid)


def test_grid_not_a_multiple_of_the_merge_size():
    cfg = dataclasses.replace(QWEN2_5_VL_3B, spatial_merge_size=4, window_size=112)
    with pytest.raises(ValueError, match=r"row 0 = \[1, 8, 6\].*multiples of spatial_merge_size 4"):
        make_plans([[1, 8, 6]], cfg)


# ---- pixel_values ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pixels, needle",
    [
        (_pixels(15), r"has 15 rows but grid_thw implies sum\(t\*h\*w\) = 16"),  # row count
        (_pixels(16)[:, :1000], "rows have 1000 values, expected 1176"),  # row width
        (_pixels(16).astype(np.complex64), "must be numeric, got dtype complex64"),  # dtype
        (_pixels(16) > 0, "must be numeric, got dtype bool"),  # dtype
        (_pixels(16).reshape(16, 2, 588), r"must be 2-D \[N, 1176\], got shape \(16, 2, 588\)"),  # ndim
    ],
    ids=["rows", "width", "complex", "bool", "ndim"],
)
def test_bad_pixel_values(tiny_encoder, pixels, needle):
    with pytest.raises(ValueError, match=needle):
        tiny_encoder.encode(pixels, [[1, 4, 4]])


def test_rows_of_another_towers_preprocessing_say_how_to_fix_it(tiny_encoder):
    """Pixels preprocessed with another tower's defaults (Qwen3's 16-pixel patches for a 14-pixel
    tower): the error names the checkpoint's own settings."""
    from qwen_vit_jax.preprocess.config import QWEN3_VL_PREPROCESS
    from qwen_vit_jax.preprocess.images import preprocess_images

    pv, thw = preprocess_images([make_image(64, 64)], config=QWEN3_VL_PREPROCESS)
    with pytest.raises(ValueError, match="rows have 1536 values, expected 1176") as e:
        tiny_encoder.encode(pv, thw)
    assert "config=enc.preprocess" in str(e.value) and "config=enc.video_preprocess" in str(e.value)


def test_non_contiguous_pixel_values_are_accepted(tiny_encoder):
    """Any layout (a strided view, Fortran order, float64, big-endian) is the same input."""
    px = _pixels(32)
    ref = tiny_encoder.encode(px, [[1, 4, 8]])
    wide = np.zeros((32, 2 * P), np.float32)
    wide[:, ::2] = px
    for view in (wide[:, ::2], np.asfortranarray(px), px.astype(np.float64), px.astype(">f4")):
        np.testing.assert_array_equal(tiny_encoder.encode(view, [[1, 4, 8]]), ref)


# ---- configs --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llava", "hidden_size": 1024},
        {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32},  # a text-only model
        {"model_type": "clip", "vision_config": {"model_type": "clip_vision_model", "num_hidden_layers": 2}},
    ],
    ids=["llava", "llama", "clip"],
)
def test_another_architecture_is_named_first(config):
    """model_type is read before any field: a Llama or CLIP checkpoint is named as what it is, not as
    a Qwen tower with odd sizes."""
    with pytest.raises(ValueError, match=f"model_type '{config['model_type']}' is not a vision-language model") as e:
        VisionConfig.from_hf(config)
    assert "qwen2_5_vl" in str(e.value) and "glm4v" in str(e.value)  # the supported ones are listed


def test_vision_config_without_model_type():
    with pytest.raises(ValueError, match="cannot tell Qwen2-VL from Qwen2.5-VL \\(model_type=''"):
        VisionConfig.from_hf({"hidden_size": 1024})


def test_missing_field_takes_hf_default_and_the_weights_then_disagree(tiny_dirs, tmp_path):
    """A missing field gets transformers' default for it (as transformers does); a default that
    does not fit the weights fails the conversion, naming the tensor and both shapes."""
    hf = tmp_path / "hf"
    shutil.copytree(tiny_dirs[0], hf)
    config = json.loads((hf / "config.json").read_text())
    del config["vision_config"]["intermediate_size"]  # tiny: 256; transformers' default: 3420
    (hf / "config.json").write_text(json.dumps(config))
    assert VisionConfig.from_hf(hf / "config.json").intermediate_size == 3420
    with pytest.raises(
        CheckpointError, match=r"visual\.blocks\.\d+\.mlp\.\w+\.weight.: shape \(\d+, \d+\), expected .*3420"
    ):
        convert_checkpoint(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_head_count_not_dividing_width():
    with pytest.raises(ValueError, match="width 1280 is not divisible by num_heads 7"):
        dataclasses.replace(QWEN2_5_VL_3B, num_heads=7)
    with pytest.raises(ValueError, match="width 1280 is not divisible by num_heads 7"):
        VisionConfig.from_hf({"model_type": "qwen2_5_vl", "vision_config": {"num_heads": 7, "hidden_size": 1280}})


def test_window_not_a_multiple_of_the_merged_patch():
    with pytest.raises(
        ValueError,
        match=r"window_size 100 must be a positive multiple of patch_size \* "
        r"spatial_merge_size = 28",
    ):
        VisionConfig.from_hf({"model_type": "qwen2_5_vl", "vision_config": {"window_size": 100}})


# ---- checkpoints: sharded indexes ----------------------------------------------------------------
def _sharded(tiny_dirs, root, edit=None, raw=None):
    """The tiny HF checkpoint as one shard plus an index (edited by `edit(weight_map)`)."""
    d = root / "hf"
    shutil.copytree(tiny_dirs[0], d)
    (d / "model.safetensors").rename(d / "shard-1.safetensors")
    wm = dict.fromkeys(SafetensorsFile(d / "shard-1.safetensors").entries, "shard-1.safetensors")
    if edit:
        edit(wm)
    (d / "model.safetensors.index.json").write_text(raw or json.dumps({"weight_map": wm}))
    return d


def test_index_naming_a_missing_shard(tiny_dirs, tmp_path):
    d = _sharded(tiny_dirs, tmp_path, lambda wm: wm.update({"visual.merger.ln_q.weight": "shard-2.safetensors"}))
    with pytest.raises(FileNotFoundError, match="shard-2.safetensors"):
        read_hf_vision_params(d)


@pytest.mark.parametrize("shard", ["../hf/shard-1.safetensors", "/etc/passwd", "sub/shard-1.safetensors", ".."])
def test_index_naming_a_path_outside_the_directory(tiny_dirs, tmp_path, shard):
    d = _sharded(tiny_dirs, tmp_path, lambda wm: wm.update({"visual.merger.ln_q.weight": shard}))
    with pytest.raises(CheckpointError, match=f"shard names must be plain file names, got \\['{shard}'\\]"):
        read_hf_vision_params(d)


def test_index_with_a_duplicated_tensor(tiny_dirs, tmp_path):
    raw = (
        '{"weight_map": {"visual.merger.ln_q.weight": "shard-1.safetensors", '
        '"visual.merger.ln_q.weight": "shard-1.safetensors"}}'
    )
    d = _sharded(tiny_dirs, tmp_path, raw=raw)
    with pytest.raises(CheckpointError, match="duplicate key 'visual.merger.ln_q.weight'"):
        read_hf_vision_params(d)


def test_tensor_in_a_shard_the_index_does_not_name(tiny_dirs, tmp_path):
    """The index maps a tensor to a shard that does not hold it: an error naming both."""
    d = _sharded(tiny_dirs, tmp_path)
    # copies: the reader memory-maps the file that is rewritten next
    tensors = {k: np.array(v) for k, v in read_safetensors(d / "shard-1.safetensors").items()}
    del tensors["visual.merger.ln_q.weight"]
    (d / "shard-1.safetensors").unlink()
    write_safetensors(d / "shard-1.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"shard-1\.safetensors.*'visual\.merger\.ln_q\.weight'"):
        read_hf_vision_params(d)


# ---- command line ---------------------------------------------------------------------------------
def _main(capsys, *args):
    rc = cli.main([str(a) for a in args])
    _, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, err


def test_cli_missing_checkpoint_and_input(capsys, tiny_dirs, tmp_path):
    make_image(56, 56).save(tmp_path / "a.png")
    rc, err = _main(capsys, "encode", tmp_path / "nope", tmp_path / "a.png", "-o", tmp_path / "e.npz")
    assert rc == 1 and "error: " in err and str(tmp_path / "nope") in err
    rc, err = _main(capsys, "convert", tmp_path / "nope", tmp_path / "out")
    assert rc == 1 and f"HF checkpoint directory not found: {tmp_path / 'nope'}" in err


def test_cli_unreadable_file(capsys, tiny_dirs, tmp_path):
    """/proc/self/mem: a file whose read fails (EIO) even for root. Named in a warning (--keep-going);
    exit 1."""
    make_image(56, 56).save(tmp_path / "a.png")
    out = tmp_path / "e.npz"
    rc, err = _main(capsys, "encode", tiny_dirs[1], tmp_path / "a.png", "/proc/self/mem", "-o", out, "--keep-going")
    assert rc == 1 and "warning: skipped /proc/self/mem: " in err and "1 of 2 inputs could not be read" in err
    assert read_embeddings(out).names == [str(tmp_path / "a.png")]


def test_cli_not_an_image(capsys, tiny_dirs, tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    rc, err = _main(capsys, "encode", tiny_dirs[1], tmp_path / "notes.png", "-o", tmp_path / "e.npz")
    assert rc == 1 and f"error: cannot read {tmp_path / 'notes.png'}: UnidentifiedImageError" in err
    assert "nothing written" in err and "--keep-going" in err
    assert not (tmp_path / "e.npz").exists()
    rc, err = _main(capsys, "encode", tiny_dirs[1], tmp_path / "notes.png", "-o", tmp_path / "e.npz", "--keep-going")
    assert rc == 1 and "none of the 1 inputs could be read; nothing written" in err
    assert not (tmp_path / "e.npz").exists()


def test_cli_output_folder_not_writable(capsys, tiny_dirs, tmp_path):
    """/proc: a folder nobody, root included, can create files in. encode fails before encoding."""
    make_image(56, 56).save(tmp_path / "a.png")
    rc, err = _main(capsys, "encode", tiny_dirs[1], tmp_path / "a.png", "-o", "/proc/e.npz")
    assert rc == 1 and "error: output folder /proc is not writable" in err
    rc, err = _main(capsys, "convert", tiny_dirs[0], "/proc/qvj_out")
    assert rc == 1 and "error: " in err and "/proc/" in err


def test_cli_existing_output(capsys, tiny_dirs, tmp_path):
    make_image(56, 56).save(tmp_path / "a.png")
    out = tmp_path / "e.npz"
    out.write_bytes(b"precious")
    rc, err = _main(capsys, "encode", tiny_dirs[1], tmp_path / "a.png", "-o", out)
    assert rc == 1 and f"{out} exists: --resume adds the missing inputs to it, --overwrite replaces it" in err
    assert out.read_bytes() == b"precious"
    conv = tmp_path / "conv"
    conv.mkdir()
    (conv / "keep.txt").write_text("precious")
    rc, err = _main(capsys, "convert", tiny_dirs[0], conv)
    assert rc == 1 and f"output directory exists: {conv}" in err
    rc, err = _main(capsys, "convert", tiny_dirs[0], conv, "--overwrite")
    assert rc == 1 and f"{conv} exists and is not a qwen_vit_jax output directory" in err
    assert (conv / "keep.txt").read_text() == "precious"
