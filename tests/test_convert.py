"""qwen_vit_jax.convert: tiny HF checkpoints from transformers -> our params, and every way it must fail.

Expected params are built key by key from the HF tensors here (not through the converter's table), so a
wrong rule cannot agree with itself.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import types

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file as torch_load_file  # noqa: E402

from qwen_vit_jax.config import VisionConfig  # noqa: E402
from qwen_vit_jax.presets import QWEN2_5_VL_3B, QWEN2_VL_7B  # noqa: E402
from qwen_vit_jax.weights import convert, hf_read, keys  # noqa: E402
from qwen_vit_jax.weights.convert import convert_checkpoint, load_converted  # noqa: E402
from qwen_vit_jax.weights.hf_read import read_hf_vision_params  # noqa: E402
from qwen_vit_jax.weights.keys import expected_param_shapes  # noqa: E402
from qwen_vit_jax.weights.safetensors_io import (  # noqa: E402
    CheckpointError,
    SafetensorsFile,
    read_safetensors,
    write_safetensors,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = ("qwen2_5_vl", "qwen2_vl")
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=128,
    bos_token_id=0,
    eos_token_id=1,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
)
VISION = {
    "qwen2_5_vl": dict(
        depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48, fullatt_block_indexes=[1]
    ),
    "qwen2_vl": dict(depth=2, embed_dim=64, num_heads=4, hidden_size=48),
}
# What users download from the hub (written by transformers 4.4x): text fields at the top level, no
# vision model_type, in_chans / spatial_patch_size, and Qwen2-VL without hidden_act.
HUB_CONFIG = {
    "qwen2_5_vl": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "vocab_size": 128,
        "torch_dtype": "bfloat16",
        "vision_config": {
            "depth": 2,
            "hidden_act": "silu",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_heads": 4,
            "in_chans": 3,
            "out_hidden_size": 48,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
    },
    "qwen2_vl": {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "vocab_size": 128,
        "torch_dtype": "bfloat16",
        "vision_config": {
            "depth": 2,
            "embed_dim": 64,
            "mlp_ratio": 4,
            "num_heads": 4,
            "in_chans": 3,
            "hidden_size": 48,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        },
    },
}


def _hf_model(variant: str):
    if variant == "qwen2_5_vl":
        cls, config_cls = transformers.Qwen2_5_VLForConditionalGeneration, transformers.Qwen2_5_VLConfig
    else:
        cls, config_cls = transformers.Qwen2VLForConditionalGeneration, transformers.Qwen2VLConfig
    torch.manual_seed(VARIANTS.index(variant))
    model = cls(config_cls(text_config=TEXT, vision_config=VISION[variant])).eval()
    with torch.no_grad():  # random everywhere: norm weights != 1, biases != 0, so a swap shows
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Per variant: the model (float32), and dirs saved float32, sharded float32 and bfloat16."""
    out = {}
    for variant in VARIANTS:
        root = tmp_path_factory.mktemp(variant)
        model = _hf_model(variant)
        model.save_pretrained(root / "f32")
        model.save_pretrained(root / "sharded", max_shard_size="50KB")
        _hf_model(variant).to(torch.bfloat16).save_pretrained(root / "bf16")
        # HF tensors as saved (in memory transformers 5.x names them model.visual.*; on disk visual.*),
        # read by safetensors' own torch loader; bf16 as raw bits
        sd32 = {k: v.numpy() for k, v in torch_load_file(root / "f32" / "model.safetensors").items()}
        sd16 = {
            k: v.view(torch.int16).numpy().view(np.uint16)
            for k, v in torch_load_file(root / "bf16" / "model.safetensors").items()
        }
        out[variant] = types.SimpleNamespace(
            model=model, f32=root / "f32", sharded=root / "sharded", bf16=root / "bf16", sd32=sd32, sd16_bits=sd16
        )
    (out["qwen2_5_vl"].f32 / "preprocessor_config.json").write_text('{"max_pixels": 12845056}\n')
    return out


def expected_ours(sd: dict, variant: str, depth: int = 2, width: int = 64, prefix: str = "visual.") -> dict:
    """Our params written out key by key from HF tensors (torch Linear [out, in] -> kernel [in, out])."""

    def g(k):
        return sd[prefix + k]

    def blocks(name, transpose=False):
        per_block = [g(f"blocks.{i}.{name}") for i in range(depth)]
        return np.stack([w.T for w in per_block] if transpose else per_block)

    ours = {
        "patch_embed.kernel": g("patch_embed.proj.weight").reshape(width, -1).T,
        "blocks.norm1.scale": blocks("norm1.weight"),
        "blocks.norm2.scale": blocks("norm2.weight"),
        "blocks.attn.qkv.kernel": blocks("attn.qkv.weight", transpose=True),
        "blocks.attn.qkv.bias": blocks("attn.qkv.bias"),
        "blocks.attn.proj.kernel": blocks("attn.proj.weight", transpose=True),
        "blocks.attn.proj.bias": blocks("attn.proj.bias"),
        "merger.norm.scale": g("merger.ln_q.weight"),
        "merger.fc1.kernel": g("merger.mlp.0.weight").T,
        "merger.fc1.bias": g("merger.mlp.0.bias"),
        "merger.fc2.kernel": g("merger.mlp.2.weight").T,
        "merger.fc2.bias": g("merger.mlp.2.bias"),
    }
    if variant == "qwen2_5_vl":
        ours |= {
            "blocks.mlp.gate.kernel": blocks("mlp.gate_proj.weight", transpose=True),
            "blocks.mlp.gate.bias": blocks("mlp.gate_proj.bias"),
            "blocks.mlp.up.kernel": blocks("mlp.up_proj.weight", transpose=True),
            "blocks.mlp.up.bias": blocks("mlp.up_proj.bias"),
            "blocks.mlp.down.kernel": blocks("mlp.down_proj.weight", transpose=True),
            "blocks.mlp.down.bias": blocks("mlp.down_proj.bias"),
        }
    else:
        ours |= {
            "blocks.norm1.bias": blocks("norm1.bias"),
            "blocks.norm2.bias": blocks("norm2.bias"),
            "merger.norm.bias": g("merger.ln_q.bias"),
            "blocks.mlp.fc1.kernel": blocks("mlp.fc1.weight", transpose=True),
            "blocks.mlp.fc1.bias": blocks("mlp.fc1.bias"),
            "blocks.mlp.fc2.kernel": blocks("mlp.fc2.weight", transpose=True),
            "blocks.mlp.fc2.bias": blocks("mlp.fc2.bias"),
        }
    return ours


def assert_params_equal(got: dict, want: dict, bits: bool = False):
    assert sorted(got) == sorted(want)
    for k in want:
        g = np.asarray(got[k]).view(np.uint16) if bits else got[k]
        assert g.shape == want[k].shape, k
        np.testing.assert_array_equal(g, want[k], err_msg=k)


def assert_nothing_left(parent: pathlib.Path, before: list[str]):
    assert sorted(os.listdir(parent)) == before, "a failed conversion left files behind"


# ---- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip(ckpts, tmp_path, variant):
    c = ckpts[variant]
    out = convert_checkpoint(c.f32, tmp_path / "out")
    cfg, params, meta = load_converted(out)
    assert cfg == VisionConfig.from_hf(c.f32) and cfg.variant == variant
    assert_params_equal(params, expected_ours(c.sd32, variant))
    assert {k: v.shape for k, v in params.items()} == expected_param_shapes(cfg)
    assert all(v.dtype == np.float32 for v in params.values())
    assert meta["format"] == "qwen_vit_jax" and meta["format_version"] == 1 and meta["dtype"] == "float32"
    assert meta["source"] == {"hf_dir": str(c.f32.resolve()), "keys_prefix": "visual."}
    assert VisionConfig.from_dict(meta["vision_config"]) == cfg
    pre = c.f32 / "preprocessor_config.json"
    if pre.exists():
        assert (out / "preprocessor_config.json").read_bytes() == pre.read_bytes()
    else:
        assert not (out / "preprocessor_config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dir left
    umask = os.umask(0o22)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700


def test_load_converted_reads_tensors_only_when_used(ckpts, tmp_path, monkeypatch):
    """Its checks of names, shapes and dtypes read the header; each tensor is read when looked up."""
    out = convert_checkpoint(ckpts["qwen2_5_vl"].f32, tmp_path / "out")
    reads, get = [], SafetensorsFile.get
    monkeypatch.setattr(SafetensorsFile, "get", lambda self, name: reads.append(name) or get(self, name))
    cfg, params, _ = load_converted(out)
    assert all(k in params for k in expected_param_shapes(cfg)) and "blocks.attn.extra" not in params
    assert reads == []
    assert params["merger.fc2.bias"].shape == (cfg.out_dim,) and reads == ["merger.fc2.bias"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernels_compute_what_torch_computes(ckpts, variant):
    """The transforms mean what they should: conv == rows @ kernel, Linear == x @ kernel + bias."""
    c = ckpts[variant]
    _, p = read_hf_vision_params(c.f32)
    vis = c.model.model.visual
    rows = torch.randn(6, 1176)
    x = torch.randn(5, 64)
    with torch.no_grad():
        ref_patch = vis.patch_embed(rows).numpy()
        ref_qkv = vis.blocks[1].attn.qkv(x).numpy()
    np.testing.assert_allclose(rows.numpy() @ p["patch_embed.kernel"], ref_patch, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(
        x.numpy() @ p["blocks.attn.qkv.kernel"][1] + p["blocks.attn.qkv.bias"][1], ref_qkv, rtol=1e-5, atol=1e-4
    )


def test_expected_shapes_of_released_towers():
    s = expected_param_shapes(QWEN2_5_VL_3B)
    assert sum(int(np.prod(v)) for v in s.values()) == 668_684_288  # the 3B tower's 669M
    assert s["patch_embed.kernel"] == (1176, 1280) and s["blocks.mlp.gate.kernel"] == (32, 1280, 3420)
    assert s["merger.fc1.kernel"] == (5120, 5120) and s["merger.fc2.kernel"] == (5120, 2048)
    assert "blocks.norm1.bias" not in s and "blocks.mlp.fc1.kernel" not in s
    s2 = expected_param_shapes(QWEN2_VL_7B)
    assert s2["blocks.mlp.fc1.kernel"] == (32, 1280, 5120) and s2["merger.norm.bias"] == (1280,)
    assert len(s) == 18 and len(s2) == 19


# ---- layouts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_sharded_reads_only_vision_shards(ckpts, tmp_path, monkeypatch, variant):
    c = ckpts[variant]
    weight_map = json.loads((c.sharded / "model.safetensors.index.json").read_text())["weight_map"]
    vision_files = {f for k, f in weight_map.items() if k.startswith("visual.")}
    text_only = set(weight_map.values()) - vision_files
    assert len(vision_files) > 2 and text_only  # really sharded, with shards holding no vision tensor
    d = shutil.copytree(c.sharded, tmp_path / "sharded")
    for f in text_only:  # conversion must not need them
        (d / f).unlink()
    opened = []

    class Spy(hf_read.SafetensorsFile):
        def __init__(self, path):
            opened.append(pathlib.Path(path).name)
            super().__init__(path)

    monkeypatch.setattr(hf_read, "SafetensorsFile", Spy)
    cfg, params = read_hf_vision_params(d)
    assert sorted(opened) == sorted(vision_files)
    assert_params_equal(params, expected_ours(c.sd32, variant))

    # a shard named by the index that holds vision tensors must exist
    (d / sorted(vision_files)[0]).unlink()
    with pytest.raises(FileNotFoundError, match=sorted(vision_files)[0]):
        read_hf_vision_params(d)


def _write_ckpt(d: pathlib.Path, tensors: dict, config: dict) -> pathlib.Path:
    d.mkdir()
    write_safetensors(d / "model.safetensors", tensors, {"format": "pt"})
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefixes_and_config_layouts(ckpts, tmp_path, variant):
    c = ckpts[variant]
    full_config = json.loads((c.f32 / "config.json").read_text())
    sd = c.sd32
    want = expected_ours(sd, variant)
    ref_cfg = VisionConfig.from_hf(c.f32)

    # transformers 4.5x layout: model.visual.* next to model.language_model.*, hub-style config
    renamed = {
        (
            "model." + k
            if k.startswith("visual.")
            else k.replace("model.", "model.language_model.", 1)
            if k.startswith("model.")
            else k
        ): v
        for k, v in sd.items()
    }
    d = _write_ckpt(tmp_path / "model_visual", renamed, HUB_CONFIG[variant])
    cfg, params = read_hf_vision_params(d)
    assert cfg == ref_cfg
    assert_params_equal(params, want)
    meta = load_converted(convert_checkpoint(d, tmp_path / "out1"))[2]
    assert meta["source"]["keys_prefix"] == "model.visual."

    # vision-only checkpoint: bare keys, config.json = the vision_config alone
    bare = {k.removeprefix("visual."): v for k, v in sd.items() if k.startswith("visual.")}
    d = _write_ckpt(tmp_path / "bare", bare, full_config["vision_config"])
    cfg, params = read_hf_vision_params(d)
    assert cfg == ref_cfg
    assert_params_equal(params, want)
    assert load_converted(convert_checkpoint(d, tmp_path / "out2"))[2]["source"]["keys_prefix"] == ""

    # hub file: visual.* keys with a 4.4x config
    d = _write_ckpt(tmp_path / "hub", sd, HUB_CONFIG[variant])
    assert read_hf_vision_params(d)[0] == ref_cfg


def test_both_prefixes_or_none_is_an_error(ckpts, tmp_path):
    sd = ckpts["qwen2_5_vl"].sd32
    config = json.loads((ckpts["qwen2_5_vl"].f32 / "config.json").read_text())
    both = dict(sd) | {"model.visual.merger.ln_q.weight": sd["visual.merger.ln_q.weight"]}
    with pytest.raises(CheckpointError, match=r"model\.visual\.merger\.ln_q\.weight"):
        read_hf_vision_params(_write_ckpt(tmp_path / "both", both, config))
    text = {k: v for k, v in sd.items() if not k.startswith("visual.")}
    with pytest.raises(CheckpointError, match="no vision tensors"):
        read_hf_vision_params(_write_ckpt(tmp_path / "text", text, config))


# ---- bfloat16 and the safetensors reader / writer -----------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_bit_exact_and_cast(ckpts, tmp_path, variant):
    c = ckpts[variant]
    cfg, params, meta = load_converted(convert_checkpoint(c.bf16, tmp_path / "keep"))
    assert meta["dtype"] == "bfloat16"
    assert all(v.dtype == ml_dtypes.bfloat16 for v in params.values())
    want_bits = expected_ours(c.sd16_bits, variant)
    assert_params_equal(params, want_bits, bits=True)

    _, p32, meta = load_converted(convert_checkpoint(c.bf16, tmp_path / "f32", dtype="float32"))
    assert meta["dtype"] == "float32"
    for k, v in p32.items():  # bf16 -> f32 is exact
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, want_bits[k].view(ml_dtypes.bfloat16).astype(np.float32), err_msg=k)

    _, pbf, _ = load_converted(convert_checkpoint(c.f32, tmp_path / "bf16", dtype="bfloat16"))
    want = expected_ours(c.sd32, variant)
    for k, v in pbf.items():
        np.testing.assert_array_equal(v, want[k].astype(ml_dtypes.bfloat16), err_msg=k)

    with pytest.raises(ValueError, match="float16"):
        convert_checkpoint(c.f32, tmp_path / "x", dtype="float16")
    assert not (tmp_path / "x").exists()


def _torch_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


@pytest.mark.parametrize("kind", ["f32", "bf16", "sharded"])
def test_reader_agrees_with_safetensors_torch(ckpts, kind):
    files = sorted(getattr(ckpts["qwen2_vl"], kind).glob("*.safetensors"))
    for path in files:
        ours, ref = read_safetensors(path), torch_load_file(path)
        assert sorted(ours) == sorted(ref)
        for k, t in ref.items():
            assert ours[k].shape == tuple(t.shape)
            assert ours[k].dtype.name == str(t.dtype).removeprefix("torch.")
            np.testing.assert_array_equal(ours[k].reshape(-1).view(np.uint8), _torch_bytes(t), err_msg=k)
    some = sorted(torch_load_file(files[0]))[:2]
    assert list(read_safetensors(files[0], keys=some)) == some


def test_writer_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "b.bf16": rng.standard_normal((4, 2, 3)).astype(ml_dtypes.bfloat16),
        "c.f16": rng.standard_normal(7).astype(np.float16),
        "d.f64": rng.standard_normal((2, 2)),
        "e.i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "f.bool": np.array([True, False, True]),
        "g.scalar": np.float32(3.5),
        "h.empty": np.zeros((0, 4), np.float32),
        "i.transposed": rng.standard_normal((3, 4)).astype(np.float32).T,
        "j.bigendian": np.arange(4, dtype=">f4"),
    }
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, {"format": "qwen_vit_jax"})
    ours, ref = read_safetensors(path), torch_load_file(path)
    with safe_open(path, "np") as f:
        assert f.metadata() == {"format": "qwen_vit_jax"}
    for k, v in tensors.items():
        assert ours[k].dtype == v.dtype.newbyteorder("=") and ours[k].shape == v.shape, k
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
        assert tuple(ref[k].shape) == v.shape
        np.testing.assert_array_equal(_torch_bytes(ref[k]), ours[k].reshape(-1).view(np.uint8), err_msg=k)
    with pytest.raises(ValueError, match="complex"):
        write_safetensors(tmp_path / "bad.safetensors", {"x": np.zeros(2, np.complex64)})


def test_writer_is_deterministic_across_processes(tmp_path):
    """The same tensors and metadata give the same bytes in another process (the package's own
    writer orders metadata by a per-process hash seed; ours sorts it)."""
    code = (
        "import sys, numpy as np; from qwen_vit_jax.weights.safetensors_io import write_safetensors; "
        "write_safetensors(sys.argv[1], {'b': np.ones(3), 'a': np.zeros(2, np.float32)}, "
        "{k: str(i) for i, k in enumerate('zyxwvuts')} | {'names': chr(233) + chr(34)})"
    )
    paths = [tmp_path / f"{i}.safetensors" for i in range(3)]
    for p in paths:
        subprocess.run([sys.executable, "-c", code, str(p)], check=True)
    assert len({p.read_bytes() for p in paths}) == 1
    meta = SafetensorsFile(paths[0]).metadata  # parsed in the file's order
    assert list(meta) == sorted(meta) and meta["names"] == '\u00e9"'


def _raw_safetensors(path, header, data=b"", length=None):
    raw = json.dumps(header).encode() if isinstance(header, dict) else header
    path.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize(
    "case, needle",
    [
        ("truncated_data", "'z.last': data [0, 16) runs past the end"),
        ("truncated_header", "does not fit"),
        ("tiny_file", "too short"),
        ("corrupt_json", "corrupt header"),
        ("huge_header_length", "header length"),
        ("size_mismatch", "'x': data_offsets [0, 8) hold 8 bytes, but F32 [3] needs 12"),
        ("overlap", "gap or overlap"),
        ("trailing_bytes", "4 bytes after the last tensor"),
        ("duplicate_name", "duplicate key 'x'"),
        ("bad_entry", "'x': corrupt header entry"),
    ],
)
def test_reader_rejects_bad_files(tmp_path, case, needle):
    p = tmp_path / "bad.safetensors"
    x = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    if case == "truncated_data":
        _raw_safetensors(p, {"z.last": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 10)
    elif case == "truncated_header":
        _raw_safetensors(p, {"x": x}, length=1000)
    elif case == "tiny_file":
        p.write_bytes(b"\1\0\0")
    elif case == "corrupt_json":
        _raw_safetensors(p, b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]', b"\0" * 8)
    elif case == "huge_header_length":
        _raw_safetensors(p, {"x": x}, b"\0" * 8, length=1 << 40)
    elif case == "size_mismatch":
        _raw_safetensors(p, {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8)
    elif case == "overlap":
        y = {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}
        _raw_safetensors(p, {"x": x, "y": y}, b"\0" * 12)
    elif case == "trailing_bytes":
        _raw_safetensors(p, {"x": x}, b"\0" * 12)
    elif case == "duplicate_name":
        _raw_safetensors(p, b'{"x": %s, "x": %s}' % ((json.dumps(x).encode(),) * 2), b"\0" * 8)
    elif case == "bad_entry":
        _raw_safetensors(p, {"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(CheckpointError) as e:
        read_safetensors(p)
    assert str(p) in str(e.value) and needle in str(e.value)
    assert isinstance(e.value, ValueError)


def test_reader_unknown_dtype_fails_only_when_read(tmp_path):
    p = _raw_safetensors(
        tmp_path / "u.safetensors",
        {
            "text.fp4": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
            "x": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]},
        },
        b"\0\0" + np.float32(2).tobytes(),
    )
    assert read_safetensors(p, ["x"])["x"].tolist() == [2.0]
    with pytest.raises(CheckpointError, match="'text.fp4': unsupported dtype 'F4'"):
        read_safetensors(p)
    with pytest.raises(CheckpointError, match="'nope': no such tensor"):
        read_safetensors(p, ["nope"])
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        read_safetensors(tmp_path / "missing.safetensors")


# ---- failures leave nothing behind --------------------------------------------------------------
@pytest.fixture
def make_ckpt(ckpts, tmp_path):
    """make(edit) -> an HF dir holding the float32 Qwen2.5-VL checkpoint after `edit(tensors)`."""
    base = ckpts["qwen2_5_vl"]
    tensors = read_safetensors(base.f32 / "model.safetensors")
    config = json.loads((base.f32 / "config.json").read_text())

    def make(edit=None, name="hf"):
        t = dict(tensors)
        if edit:
            edit(t)
        return _write_ckpt(tmp_path / name, t, config)

    return make


def _expect_failure(hf_dir, parent: pathlib.Path, exc, *needles, **kw):
    parent.mkdir(exist_ok=True)
    before = sorted(os.listdir(parent))
    with pytest.raises(exc) as e:
        convert_checkpoint(hf_dir, parent / "out", **kw)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    assert_nothing_left(parent, before)
    return e.value


def _del(key):
    return lambda t: t.pop(key)


def _set(key, value):
    return lambda t: t.__setitem__(key, value)


ROW = np.zeros(64, np.float32)
TENSOR_CASES = {
    "missing": (_del("visual.blocks.1.norm2.weight"), ["visual.blocks.1.norm2.weight (-> blocks.norm2.scale[1])"]),
    "missing_merger": (_del("visual.merger.mlp.2.bias"), ["visual.merger.mlp.2.bias (-> merger.fc2.bias)"]),
    "unknown": (_set("visual.blocks.0.attn.extra.weight", ROW), ["'visual.blocks.0.attn.extra.weight' in"]),
    "other_variant": (_set("visual.blocks.0.mlp.fc1.weight", ROW), ["'visual.blocks.0.mlp.fc1.weight'"]),
    "leading_zero": (_set("visual.blocks.01.norm1.weight", ROW), ["'visual.blocks.01.norm1.weight'"]),
    "block_out_of_range": (
        _set("visual.blocks.2.norm1.weight", ROW),
        ["'visual.blocks.2.norm1.weight'", "block 2 >= depth 2"],
    ),
    "wrong_shape": (
        _set("visual.blocks.0.attn.qkv.weight", np.zeros((191, 64), np.float32)),
        ["'visual.blocks.0.attn.qkv.weight'", "(191, 64)", "(192, 64)"],
    ),
    "wrong_conv_shape": (
        _set("visual.patch_embed.proj.weight", np.zeros((64, 3, 2, 16, 16), np.float32)),
        ["'visual.patch_embed.proj.weight'", "(64, 3, 2, 14, 14)"],
    ),
    "mixed_block_dtypes": (
        _set("visual.blocks.1.norm1.weight", np.ones(64, np.float16)),
        ["'visual.blocks.1.norm1.weight'", "float16"],
    ),
    "int_param": (_set("visual.merger.mlp.2.bias", np.zeros(48, np.int32)), ["'visual.merger.mlp.2.bias'", "I32"]),
}


@pytest.mark.parametrize("case", TENSOR_CASES)
def test_bad_tensors(make_ckpt, tmp_path, case):
    edit, needles = TENSOR_CASES[case]
    d = make_ckpt(edit)
    _expect_failure(
        d,
        tmp_path / "parent",
        CheckpointError,
        "model.safetensors" if case not in ("missing", "missing_merger") else str(d),
        *needles,
    )


def test_a_param_filled_twice_is_an_error(make_ckpt, tmp_path, monkeypatch):
    alias = keys.Rule(keys._B + r"norm1\.alias", "blocks.norm1.scale", keys._identity, "D", "D")
    monkeypatch.setattr(hf_read, "RULES", keys.RULES + (alias,))
    monkeypatch.setattr(keys, "RULES", keys.RULES + (alias,))
    d = make_ckpt(_set("visual.blocks.1.norm1.alias", ROW))
    _expect_failure(d, tmp_path / "parent", CheckpointError, "blocks.norm1.scale[1] already filled")


@pytest.mark.parametrize("case", ["truncated", "corrupt_header"])
def test_bad_files(make_ckpt, tmp_path, case):
    d = make_ckpt()
    f = d / "model.safetensors"
    raw = f.read_bytes()
    if case == "truncated":
        f.write_bytes(raw[:-100])  # the last tensor in the data is the conv weight (sorted names)
        needles = ["model.safetensors", "'visual.patch_embed.proj.weight'", "truncated"]
    else:
        n = int.from_bytes(raw[:8], "little")
        f.write_bytes(raw[:8] + b"{" + b"#" * (n - 1) + raw[8 + n :])
        needles = ["model.safetensors", "corrupt header"]
    _expect_failure(d, tmp_path / "parent", CheckpointError, *needles)


def test_missing_paths(make_ckpt, tmp_path):
    parent = tmp_path / "parent"
    _expect_failure(tmp_path / "nowhere", parent, FileNotFoundError, "nowhere")
    d = make_ckpt()
    (d / "config.json").unlink()
    _expect_failure(d, parent, FileNotFoundError, str(d / "config.json"))
    d = make_ckpt(name="noweights")
    (d / "model.safetensors").unlink()
    _expect_failure(d, parent, FileNotFoundError, "model.safetensors.index.json")
    d = make_ckpt(name="badconfig")
    (d / "config.json").write_text("{not json")
    _expect_failure(d, parent, ValueError, "config.json")


def test_existing_output_and_overwrite(ckpts, make_ckpt, tmp_path):
    c = ckpts["qwen2_5_vl"]
    parent = tmp_path / "parent"
    out = convert_checkpoint(c.f32, parent / "out")
    stamp = (out / "params.safetensors").stat().st_mtime_ns
    before = sorted(os.listdir(parent))
    with pytest.raises(FileExistsError, match="out"):
        convert_checkpoint(c.f32, out)
    assert_nothing_left(parent, before)
    assert (out / "params.safetensors").stat().st_mtime_ns == stamp

    # overwrite replaces it; a failing overwrite keeps the old output intact
    _, params, meta = load_converted(convert_checkpoint(c.bf16, out, overwrite=True))
    assert meta["dtype"] == "bfloat16" and sorted(os.listdir(parent)) == ["out"]
    bad = make_ckpt(_del("visual.merger.ln_q.weight"))
    with pytest.raises(CheckpointError):
        convert_checkpoint(bad, out, overwrite=True)
    assert sorted(os.listdir(parent)) == ["out"] and load_converted(out)[2]["dtype"] == "bfloat16"

    # never delete a directory that is not ours
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(FileExistsError, match="not a qwen_vit_jax output"):
        convert_checkpoint(c.f32, foreign, overwrite=True)
    assert (foreign / "thesis.tex").read_text() == "precious"
    with pytest.raises(FileExistsError):
        convert_checkpoint(c.f32, c.f32, overwrite=True)
    link = tmp_path / "link"
    link.symlink_to(out)
    with pytest.raises(FileExistsError, match="not a qwen_vit_jax output"):
        convert_checkpoint(c.f32, link, overwrite=True)
    assert load_converted(link)[2]["dtype"] == "bfloat16"


def test_failure_while_writing_leaves_nothing(ckpts, tmp_path, monkeypatch):
    c = ckpts["qwen2_5_vl"]

    def write_then_fail(path, tensors, metadata=None):
        pathlib.Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(convert, "write_safetensors", write_then_fail)
    _expect_failure(c.f32, tmp_path / "parent", OSError, "disk full")


# ---- load_converted -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case, exc, needle",
    [
        ("drop_param", CheckpointError, "missing merger.fc2.bias"),
        ("extra_param", CheckpointError, "unexpected blocks.attn.extra"),
        ("wrong_shape", CheckpointError, "blocks.attn.qkv.kernel: shape (2, 64, 191)"),
        ("int_param", CheckpointError, "merger.fc2.bias: dtype int32"),
        ("format", CheckpointError, "not a qwen_vit_jax config"),
        ("version", CheckpointError, "format_version 2"),
        ("vision_config", CheckpointError, "bad vision_config"),
        ("no_params", FileNotFoundError, "params.safetensors"),
        ("no_dir", FileNotFoundError, "gone"),
    ],
)
def test_load_converted_rejects_tampering(ckpts, tmp_path, case, exc, needle):
    out = convert_checkpoint(ckpts["qwen2_5_vl"].f32, tmp_path / "out")
    params = {k: np.array(v) for k, v in read_safetensors(out / "params.safetensors").items()}
    meta = json.loads((out / "config.json").read_text())
    if case == "drop_param":
        del params["merger.fc2.bias"]
    elif case == "extra_param":
        params["blocks.attn.extra"] = np.zeros(3, np.float32)
    elif case == "wrong_shape":
        params["blocks.attn.qkv.kernel"] = params["blocks.attn.qkv.kernel"][..., :191]
    elif case == "int_param":
        params["merger.fc2.bias"] = params["merger.fc2.bias"].astype(np.int32)
    elif case == "format":
        meta["format"] = "something_else"
    elif case == "version":
        meta["format_version"] = 2
    elif case == "vision_config":
        meta["vision_config"]["depth"] = -1
    elif case == "no_params":
        (out / "params.safetensors").unlink()
    elif case == "no_dir":
        out = tmp_path / "gone"
    if case in ("drop_param", "extra_param", "wrong_shape", "int_param"):
        write_safetensors(out / "params.safetensors", params)
    elif case in ("format", "version", "vision_config"):
        (out / "config.json").write_text(json.dumps(meta))
    with pytest.raises(exc) as e:
        load_converted(out)
    assert needle in str(e.value)


# ---- the script ---------------------------------------------------------------------------------
def _script(*args, cwd):
    return subprocess.run(
        [sys.executable, str(REPO / "convert_weights.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_convert_weights_script(ckpts, tmp_path):
    r = _script(ckpts["qwen2_vl"].f32, tmp_path / "out", "--dtype", "bfloat16", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and "253,488 params" in lines[0] and "bfloat16" in lines[0], r.stdout
    assert load_converted(tmp_path / "out")[2]["dtype"] == "bfloat16"

    for args in [
        (tmp_path / "nowhere", tmp_path / "out2"),  # missing input
        (ckpts["qwen2_vl"].f32, tmp_path / "out"),
    ]:  # existing output
        r = _script(*args, cwd=tmp_path)
        assert r.returncode == 1 and r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out2").exists()
