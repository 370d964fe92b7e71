"""export_hf / `qwen-vit-jax export`: our tower back into a complete HF checkpoint.

The source checkpoints are HF's own `save_pretrained` output (full VL models, random weights),
re-laid the way hub checkpoints are: a shard of text weights only, a shard mixing text and
vision tensors, a vision-only shard, an index, plus tokenizer / processor files. Checked: an
unchanged model round-trips bit for bit (fp32 and bf16, several variants); after a weight change
every non-vision tensor is byte-identical, HF loads the result with no missing / unexpected /
mismatched keys and its tower equals ours at the float32 bar; failures leave nothing behind.
"""

from __future__ import annotations

import copy
import filecmp
import json
import os

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from hf_utils import assert_fp32_close, hf_visual, make_hub_cache, random_pixels
from safetensors.torch import load_file, save_file
from towers import Q2, Q3, Q25

import qwen_vit_jax as qvj
from qwen_vit_jax.weights import export
from qwen_vit_jax.weights.safetensors_io import SafetensorsFile

CONFIGS = {"q25": Q25, "q2": Q2, "q3": Q3}  # the registry's towers (tests/towers.py)
GRID = np.array([[1, 8, 12], [2, 4, 6]])
SIDE_FILES = {  # what a hub checkpoint carries besides weights (contents irrelevant, kept byte for byte)
    "tokenizer.json": '{"version": "1.0", "model": {}}',
    "tokenizer_config.json": '{"model_max_length": 32768}',
    "chat_template.jinja": "{{ messages }}",
    "preprocessor_config.json": '{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14}',
}


def write_hub_layout(model, out):
    """`model` saved by HF, then re-sharded like a hub checkpoint: text-only, mixed, vision-only."""
    model.save_pretrained(out)
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors |= load_file(f)
        f.unlink()
    vision = sorted(k for k in tensors if k.startswith("model.visual.") or k.startswith("visual."))
    text = sorted(set(tensors) - set(vision))
    shards = {
        "model-00001-of-00003.safetensors": text[1:],
        "model-00002-of-00003.safetensors": text[:1] + vision[: len(vision) // 2],
        "model-00003-of-00003.safetensors": vision[len(vision) // 2 :],
    }
    for name, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, out / name, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}}
    index["weight_map"] = {k: name for name, keys in shards.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for name, text_ in SIDE_FILES.items():
        (out / name).write_text(text_)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, towers):
    """(variant, dtype) -> (the tower's HF model in float32, its checkpoint dir in the hub's layout)."""
    root = tmp_path_factory.mktemp("export_src")
    out = {}
    for name in CONFIGS:
        hf = towers[name].hf  # shared: written from a copy in another dtype
        for dtype in ("float32", "bfloat16") if name == "q25" else ("float32",):
            model = hf if dtype == "float32" else copy.deepcopy(hf).to(torch.bfloat16)
            out[name, dtype] = hf, write_hub_layout(model, root / f"{name}-{dtype}")
    return out


def assert_same_files(a, b):
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


@pytest.mark.parametrize(
    "case", [("q25", "float32", "float32"), ("q25", "bfloat16", "float32"), ("q25", "bfloat16", "bfloat16"),
             ("q2", "float32", "float32"), ("q3", "float32", "float32")]
)  # fmt: skip
def test_unchanged_model_round_trips_bit_for_bit(checkpoints, tmp_path, case):
    name, ckpt_dtype, model_dtype = case
    _, src = checkpoints[name, ckpt_dtype]
    model = qvj.load_model(src, dtype=model_dtype)
    out = qvj.export_hf(model, tmp_path / "out", like=src)
    assert_same_files(src, out)
    text_only = "model-00001-of-00003.safetensors"
    assert os.path.samefile(src / text_only, out / text_only)  # linked, not copied
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left


def perturbed(model, seed=0):
    """`model` with every parameter moved (so a wrongly placed or transposed tensor would show)."""
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v = np.asarray(var.get_value())
        var.set_value(jax.numpy.asarray(v + 0.05 * rng.standard_normal(v.shape).astype(v.dtype) * (np.std(v) + 0.1)))
    return model


def tensor_bytes(ckpt):
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        sf = SafetensorsFile(f)
        out |= {k: (f.name, sf.get(k).tobytes()) for k in sf.entries}
    return out


@pytest.mark.parametrize("name", ["q25", "q3"])
def test_export_after_a_change_loads_in_hf_and_matches(checkpoints, tmp_path, name):
    from transformers import AutoModelForImageTextToText

    hf, src = checkpoints[name, "float32"]
    cfg = CONFIGS[name]
    model = perturbed(qvj.load_model(src))
    out = qvj.export_hf(model, tmp_path / "out", like=src)

    before, after = tensor_bytes(src), tensor_bytes(out)
    assert before.keys() == after.keys()
    vision = {k for k in before if k.startswith(("model.visual.", "visual."))}
    assert all(before[k] == after[k] for k in before if k not in vision)  # every other tensor: same bytes
    assert all(before[k][1] != after[k][1] for k in vision)  # every vision tensor: the model's new values
    for f in ["model.safetensors.index.json", "config.json", "generation_config.json", *SIDE_FILES]:
        assert filecmp.cmp(src / f, out / f, shallow=False), f

    mine = qvj.load_model(out)  # our reader gets back exactly what was exported
    flat = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(mine, nnx.Param))}
    for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        np.testing.assert_array_equal(flat[k], np.asarray(v.get_value()))

    theirs, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # no missing / unexpected / mismatched keys, no errors
    px = random_pixels(cfg, GRID, seed=4)
    ref = hf_visual(theirs.float().eval(), px, GRID)
    ours = np.concatenate(
        [plan.unpad(np.asarray(jax.jit(model)(plan.take(px), plan))) for plan in qvj.make_plans(GRID, cfg)]
    )
    assert_fp32_close(ours, ref)
    assert not np.allclose(hf_visual(hf, px, GRID), ref, atol=1e-3)  # the change is visible in HF


def test_cli_export_and_failures(checkpoints, tmp_path, capsys, monkeypatch):
    from qwen_vit_jax.tools import cli

    _, src = checkpoints["q25", "float32"]
    conv = qvj.convert_checkpoint(src, tmp_path / "conv")
    assert cli.main(["export", str(conv), str(tmp_path / "out"), "--like", str(src), "--copy"]) == 0
    assert "exported qwen2_5_vl vision tower" in capsys.readouterr().out
    assert_same_files(src, tmp_path / "out")
    assert not os.path.samefile(
        src / "model-00001-of-00003.safetensors", tmp_path / "out/model-00001-of-00003.safetensors"
    )

    # an existing output: refused, then replaced with --overwrite
    assert cli.main(["export", str(conv), str(tmp_path / "out"), "--like", str(src)]) == 1
    assert "output directory exists" in capsys.readouterr().err
    assert cli.main(["export", str(conv), str(tmp_path / "out"), "--like", str(src), "--overwrite"]) == 0
    # like= must be an HF checkpoint of the same tower
    model = qvj.load_model(src)
    with pytest.raises(ValueError, match="not a converted qwen_vit_jax directory"):
        qvj.export_hf(model, tmp_path / "x", like=conv)
    _, other = checkpoints["q2", "float32"]
    with pytest.raises(ValueError, match="variant: model 'qwen2_5_vl' vs like 'qwen2_vl'"):
        qvj.export_hf(model, tmp_path / "x", like=other)
    with pytest.raises(FileNotFoundError, match="nope"):
        qvj.export_hf(model, tmp_path / "x", like=tmp_path / "nope")

    # a failure half-way (the third vision tensor) leaves nothing behind
    calls = []
    real = export.hf_tensor

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk full")
        return real(*args)

    monkeypatch.setattr(export, "hf_tensor", failing)
    listing = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(RuntimeError, match="disk full"):
        qvj.export_hf(model, tmp_path / "x", like=src)
    assert sorted(p.name for p in tmp_path.iterdir()) == listing


def test_like_may_be_a_cached_hub_id(checkpoints, tmp_path, monkeypatch):
    """like="Org/Name": the snapshot in the local HF cache (symlinks to blobs), followed to the files."""
    _, src = checkpoints["q25", "bfloat16"]
    make_hub_cache(tmp_path / "hub", src, repo="Org/Export-VL")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    out = qvj.export_hf(qvj.load_model("Org/Export-VL", dtype="bfloat16"), tmp_path / "out", like="Org/Export-VL")
    assert_same_files(src, out)
    assert not any(p.is_symlink() for p in out.iterdir())  # real files (links to the blobs' inodes), not symlinks


def test_mlp_padded_for_tpu_is_cropped(checkpoints, tmp_path):
    """A TPU tower holds the MLP hidden width rounded up with zero rows / columns: exported as HF's."""
    from qwen_vit_jax.weights.sources import load_source

    _, src = checkpoints["q25", "float32"]
    cfg, params, _ = load_source(src)
    padded = dict(params)
    for k, v in params.items():
        if k.startswith("blocks.mlp."):  # hidden width 96 -> 128 where it is an axis
            padded[k] = np.pad(v, [(0, 128 - n if n == cfg.intermediate_size else 0) for n in v.shape])
    assert padded["blocks.mlp.up.kernel"].shape == (cfg.depth, cfg.width, 128)
    assert_same_files(src, export.export_params(cfg, padded, tmp_path / "out", like=src))
    padded["blocks.mlp.down.kernel"][1, 100, 0] = 1.0
    with pytest.raises(ValueError, match=r"blocks.mlp.down.kernel\[1\]: shape \(128, 64\) is not \(96, 64\) plus zero"):
        export.export_params(cfg, padded, tmp_path / "out2", like=src)
    assert not (tmp_path / "out2").exists()
