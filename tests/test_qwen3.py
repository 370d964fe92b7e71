"""Qwen3-VL / Qwen3.5 groundwork vs transformers: config reading, the position-table interpolation
plan (indices equal, weights bit-identical to HF's helper), the weighted gather vs HF's own model,
and the converter's key table for both variants."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from hf_utils import build_hf_model
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.families import QWEN3_5, QWEN3_VL
from qwen_vit_jax.plan.posembed import interpolation_indices_weights, pos_embed_reference
from qwen_vit_jax.presets import PRESETS, QWEN2_5_VL_3B, QWEN3_5_27B, QWEN3_VL_8B
from qwen_vit_jax.weights import convert, hf_read, keys
from qwen_vit_jax.weights.safetensors_io import CheckpointError, write_safetensors

# head_dim 16, patch 4 (patch_dim 96), a 6 x 6 position table, deepstack after both blocks
TINY_Q3 = dataclasses.replace(
    QWEN3_VL_8B,
    depth=2,
    width=32,
    num_heads=2,
    intermediate_size=64,
    out_dim=48,
    patch_size=4,
    num_position_embeddings=36,
    deepstack_layers=(0, 1),
)
TINY_Q35 = dataclasses.replace(TINY_Q3, variant=QWEN3_5, depth=3, deepstack_layers=())

# The hub's Qwen3-VL-8B config.json vision part (transformers 4.57 layout; note model_type "qwen3_vl").
HUB_QWEN3_VL_8B = {
    "model_type": "qwen3_vl",
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}


def hf_interp(grid, side, merge=2):
    idx, w = get_vision_interpolation_indices_and_weights(
        torch.tensor(grid, dtype=torch.int64), side, mode="bilinear", align_corners=True, spatial_merge_size=merge
    )
    return idx.numpy(), w.numpy()


def with_side(cfg, side, merge=2):
    return dataclasses.replace(cfg, num_position_embeddings=side * side, spatial_merge_size=merge)


# ---- config --------------------------------------------------------------------------------------
def test_config_from_hf_both_layouts_and_vision_only():
    from transformers import Qwen3_5Config, Qwen3VLConfig

    assert VisionConfig.from_hf(HUB_QWEN3_VL_8B) == QWEN3_VL_8B
    assert VisionConfig.from_hf(HUB_QWEN3_VL_8B["vision_config"]) == QWEN3_VL_8B
    saved = Qwen3VLConfig(vision_config=HUB_QWEN3_VL_8B["vision_config"] | {"model_type": "qwen3_vl_vision"})
    for d in (saved.to_dict(), saved.vision_config.to_dict()):  # 5.x save_pretrained layout
        assert VisionConfig.from_hf(d) == dataclasses.replace(QWEN3_VL_8B, out_dim=4096)
    default = VisionConfig.from_hf(Qwen3_5Config().to_dict())
    assert default == dataclasses.replace(QWEN3_5_27B, out_dim=3584)  # HF's class defaults
    hub35 = {
        "model_type": "qwen3_5",
        "vision_config": {
            "model_type": "qwen3_5",
            "deepstack_visual_indexes": [],
            "out_hidden_size": 5120,
            "patch_size": [16, 16],
        },
    }
    assert VisionConfig.from_hf(hub35) == QWEN3_5_27B
    for name, cfg in PRESETS.items():
        assert VisionConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg, name


def test_config_properties():
    c = QWEN3_VL_8B
    assert (c.head_dim, c.patch_dim, c.pos_embed_side, c.num_deepstack) == (72, 1536, 48, 3)
    assert not c.windowed and c.full_attention_layers == (True,) * 27 and c.window_merge == 0
    assert (c.norm, c.mlp, c.patch_embed_bias) == ("layernorm", "mlp", True)
    assert (QWEN2_5_VL_3B.norm, QWEN2_5_VL_3B.mlp, QWEN2_5_VL_3B.patch_embed_bias) == ("rmsnorm", "swiglu", False)
    assert (QWEN2_5_VL_3B.pos_embed_side, QWEN3_5_27B.num_deepstack) == (0, 0)


@pytest.mark.parametrize(
    "d, match",
    [
        ({"model_type": "qwen3_vl", "vision_config": {"model_type": "qwen3_5_vision"}}, "disagrees"),
        ({"model_type": "qwen2_vl", "vision_config": {"model_type": "qwen3_vl_vision"}}, "disagrees"),
        ({"model_type": "qwen3_5", "vision_config": {"deepstack_visual_indexes": [3]}}, "no deepstack"),
        ({"model_type": "qwen3_vl", "vision_config": {"num_position_embeddings": 2300}}, "positive square"),
        ({"model_type": "qwen3_vl", "vision_config": {"deepstack_visual_indexes": [16, 8]}}, "strictly increasing"),
        ({"model_type": "qwen3_vl", "vision_config": {"deepstack_visual_indexes": [27]}}, "out of range"),
        ({"model_type": "qwen3_vl", "vision_config": {"window_size": 112}}, "no window attention"),
        ({"model_type": "qwen3_vl", "vision_config": {"patch_size": [16, 14]}}, "square patch"),
        ({"model_type": "qwen3_vl", "vision_config": {"rope_parameters": {"rope_type": "default"}}}, "axial"),
        ({"num_position_embeddings": 2304, "hidden_size": 1152}, "cannot tell Qwen3-VL from Qwen3.5"),
    ],
)
def test_config_errors(d, match):
    with pytest.raises(ValueError, match=match):
        VisionConfig.from_hf(d)


def test_config_rejects_qwen3_fields_on_qwen2():
    with pytest.raises(ValueError, match="no learned position table"):
        dataclasses.replace(QWEN2_5_VL_3B, num_position_embeddings=2304)
    with pytest.raises(ValueError, match="no deepstack"):
        dataclasses.replace(QWEN3_5_27B, deepstack_layers=(1,))


# ---- interpolation plan vs HF's helper -------------------------------------------------------------
GRIDS = [
    [[1, 2, 2]],  # h = w = 2: the align_corners endpoints only
    [[1, 4, 6]],  # smaller than every table side
    [[1, 48, 48]],  # exactly the table side
    [[1, 96, 100]],  # larger than the table: upsampling
    [[3, 10, 8]],  # a video: positions repeat over t
    [[3, 10, 8], [1, 96, 100], [2, 2, 34], [1, 6, 2]],  # a mixed batch
]


@pytest.mark.parametrize("side", [1, 2, 5, 6, 48])
@pytest.mark.parametrize("grid", GRIDS)
def test_interpolation_matches_hf(grid, side):
    idx, w = interpolation_indices_weights(grid, with_side(TINY_Q3, side))
    ref_idx, ref_w = hf_interp(grid, side)
    assert idx.dtype == np.int32 and w.dtype == np.float32 and idx.shape == w.shape == ref_idx.shape
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_array_equal(w, ref_w)  # bit-identical (the brief asks 1e-7)


@settings(max_examples=60, deadline=None)
@given(
    side=st.integers(1, 60),
    merge=st.sampled_from([1, 2, 3]),
    grid=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=4),
)
def test_interpolation_matches_hf_random(side, merge, grid):
    grid = [[t, h * merge, w * merge] for t, h, w in grid]
    idx, w = interpolation_indices_weights(grid, with_side(TINY_Q3, side, merge))
    ref_idx, ref_w = hf_interp(grid, side, merge)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_array_equal(w, ref_w)


def test_interpolation_padding_cache_and_errors():
    grid = [[2, 4, 6], [1, 2, 2]]
    idx, w = interpolation_indices_weights(grid, TINY_Q3, rows=64)
    n = 2 * 24 + 4
    ref_idx, ref_w = hf_interp(grid, 6)
    np.testing.assert_array_equal(idx[:n], ref_idx)
    np.testing.assert_array_equal(w[:n], ref_w)
    assert not idx[n:].any() and not w[n:].any()  # padding rows: a zero position embedding
    assert not idx.flags.writeable and not w.flags.writeable
    again = interpolation_indices_weights(np.asarray(grid, np.int32), TINY_Q3, rows=64)
    assert again[0] is idx and again[1] is w  # cached by grid, whatever the input dtype
    np.testing.assert_allclose(w[:n].sum(1), 1.0, rtol=0, atol=1e-6)  # a partition of unity
    for bad, match in [
        ([[1, 3, 4]], "multiples of spatial_merge_size"),
        ([[0, 2, 2]], "positive"),
        ([1, 2, 2], r"\[k, 3\]"),
        ([[1.0, 2, 2]], "integers"),
    ]:
        with pytest.raises(ValueError, match=match):
            interpolation_indices_weights(bad, TINY_Q3)
    with pytest.raises(ValueError, match="rows must be"):
        interpolation_indices_weights(grid, TINY_Q3, rows=n - 1)
    with pytest.raises(ValueError, match="no learned position table"):
        interpolation_indices_weights(grid, QWEN2_5_VL_3B)


@pytest.mark.parametrize("cfg", [TINY_Q3, TINY_Q35], ids=["qwen3_vl", "qwen3_5"])
def test_pos_embed_reference_matches_hf_model(cfg):
    """Zero the patch embedding, so the first block's input in HF's forward is exactly its position
    embedding; our gather of HF's table with our indices / weights must give it back."""
    hf = build_hf_model(cfg, seed=3).model.visual
    with torch.no_grad():
        hf.patch_embed.proj.weight.zero_()
        hf.patch_embed.proj.bias.zero_()
    seen = {}
    hook = hf.blocks[0].register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0].clone()))
    grid = np.array([[1, 4, 6], [2, 8, 8], [1, 12, 14]])
    n = int(np.prod(grid, axis=1).sum())
    with torch.no_grad():
        hf(torch.randn(n, cfg.patch_dim), grid_thw=torch.from_numpy(grid))
    hook.remove()
    ref = seen["x"].numpy()
    table = hf.pos_embed.weight.detach().numpy()
    assert table.shape == (cfg.num_position_embeddings, cfg.width)
    ours = pos_embed_reference(table, *interpolation_indices_weights(grid, cfg))
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (n, cfg.width)
    # 4-term float32 sums: HF's reduction order may differ from einsum's by an ulp
    np.testing.assert_allclose(ours, ref, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(table).max())


# ---- converter ---------------------------------------------------------------------------------------
def expected_q3(sd: dict, cfg: VisionConfig, prefix: str) -> dict:
    """Our params written out key by key from HF tensors (not through the converter's table)."""

    def g(k):
        return sd[prefix + k]

    def stack(fmt, n, transpose=False):
        rows = [g(fmt.format(i)) for i in range(n)]
        return np.stack([w.T for w in rows] if transpose else rows)

    L, K = cfg.depth, cfg.num_deepstack
    ours = {
        "patch_embed.kernel": g("patch_embed.proj.weight").reshape(cfg.width, -1).T,
        "patch_embed.bias": g("patch_embed.proj.bias"),
        "pos_embed.table": g("pos_embed.weight"),
        "merger.norm.scale": g("merger.norm.weight"),
        "merger.norm.bias": g("merger.norm.bias"),
        "merger.fc1.kernel": g("merger.linear_fc1.weight").T,
        "merger.fc1.bias": g("merger.linear_fc1.bias"),
        "merger.fc2.kernel": g("merger.linear_fc2.weight").T,
        "merger.fc2.bias": g("merger.linear_fc2.bias"),
    }
    for ours_name, hf_name, transpose in [
        ("norm1.scale", "norm1.weight", False),
        ("norm1.bias", "norm1.bias", False),
        ("norm2.scale", "norm2.weight", False),
        ("norm2.bias", "norm2.bias", False),
        ("attn.qkv.kernel", "attn.qkv.weight", True),
        ("attn.qkv.bias", "attn.qkv.bias", False),
        ("attn.proj.kernel", "attn.proj.weight", True),
        ("attn.proj.bias", "attn.proj.bias", False),
        ("mlp.fc1.kernel", "mlp.linear_fc1.weight", True),
        ("mlp.fc1.bias", "mlp.linear_fc1.bias", False),
        ("mlp.fc2.kernel", "mlp.linear_fc2.weight", True),
        ("mlp.fc2.bias", "mlp.linear_fc2.bias", False),
    ]:
        ours["blocks." + ours_name] = stack("blocks.{}." + hf_name, L, transpose)
    if K:
        for ours_name, hf_name, transpose in [
            ("norm.scale", "norm.weight", False),
            ("norm.bias", "norm.bias", False),
            ("fc1.kernel", "linear_fc1.weight", True),
            ("fc1.bias", "linear_fc1.bias", False),
            ("fc2.kernel", "linear_fc2.weight", True),
            ("fc2.bias", "linear_fc2.bias", False),
        ]:
            ours["deepstack." + ours_name] = stack("deepstack_merger_list.{}." + hf_name, K, transpose)
    return ours


@pytest.fixture(scope="module", params=["q3", "q35"], ids=["qwen3_vl", "qwen3_5"])
def q3_ckpt(request, towers, tmp_path_factory):
    """(cfg, {"f32", "sharded", "bf16"}: the registry's tower saved by HF each way, its f32 and bf16 tensors)."""
    from safetensors.torch import load_file

    tower = towers[request.param]
    root = tmp_path_factory.mktemp(request.param)
    dirs = {"f32": tower.hf_dir, "sharded": root / "sharded", "bf16": root / "bf16"}
    tower.hf.save_pretrained(dirs["sharded"], max_shard_size="20KB")
    copy.deepcopy(tower.hf).to(torch.bfloat16).save_pretrained(dirs["bf16"])  # the shared model stays float32
    sd32 = {k: v.numpy() for k, v in load_file(dirs["f32"] / "model.safetensors").items()}
    sd16 = {
        k: v.view(torch.int16).numpy().view(np.uint16) for k, v in load_file(dirs["bf16"] / "model.safetensors").items()
    }
    return tower.cfg, dirs, sd32, sd16


def _prefix_of(sd):
    (p,) = {k[: k.index("visual.") + len("visual.")] for k in sd if "visual." in k}
    return p


def test_convert_qwen3_every_param_once(q3_ckpt, tmp_path):
    cfg, dirs, sd32, sd16 = q3_ckpt
    prefix = _prefix_of(sd32)
    got_cfg, params = hf_read.read_hf_vision_params(dirs["f32"])
    assert got_cfg == cfg
    want = expected_q3(sd32, cfg, prefix)
    shapes = keys.expected_param_shapes(cfg)
    assert sorted(params) == sorted(want) == sorted(shapes)
    n_vision = sum(1 for k in sd32 if k.startswith(prefix))
    n_rows = sum(s[0] if k.startswith(("blocks.", "deepstack.")) else 1 for k, s in shapes.items())
    assert n_vision == n_rows  # each HF vision tensor fills exactly one param row
    for k, w in want.items():
        assert params[k].shape == shapes[k] and params[k].dtype == np.float32, k
        np.testing.assert_array_equal(params[k], w, err_msg=k)
    D, M, O, N = cfg.width, 4 * cfg.width, cfg.out_dim, cfg.num_position_embeddings
    assert shapes["patch_embed.kernel"] == (cfg.patch_dim, D) and shapes["pos_embed.table"] == (N, D)
    if cfg.variant == QWEN3_VL:
        assert shapes["deepstack.norm.scale"] == (2, M) and shapes["deepstack.fc2.kernel"] == (2, M, O)
    else:
        assert not any(k.startswith("deepstack.") for k in shapes)
    # sharded: same params
    _, sharded = hf_read.read_hf_vision_params(dirs["sharded"])
    assert (
        len(set(json.loads((dirs["sharded"] / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    )
    for k in want:
        np.testing.assert_array_equal(sharded[k], want[k], err_msg=k)
    # bf16 kept bit for bit through convert_checkpoint -> load_converted
    out = convert.convert_checkpoint(dirs["bf16"], tmp_path / "ours16")
    cfg16, p16, meta = convert.load_converted(out)
    assert cfg16 == cfg and meta["dtype"] == "bfloat16"
    for k, w in expected_q3(sd16, cfg, prefix).items():
        np.testing.assert_array_equal(np.asarray(p16[k]).view(np.uint16), w, err_msg=k)


@pytest.mark.parametrize("prefix", ["visual.", "model.visual."])
def test_convert_qwen3_hub_prefixes(q3_ckpt, tmp_path, prefix):
    cfg, dirs, sd32, _ = q3_ckpt
    old = _prefix_of(sd32)
    d = tmp_path / "hub"
    d.mkdir()
    tensors = {(prefix + k[len(old) :] if k.startswith(old) else k): v for k, v in sd32.items()}
    write_safetensors(d / "model.safetensors", tensors, {"format": "pt"})
    shutil.copy(dirs["f32"] / "config.json", d / "config.json")
    got_cfg, params = hf_read.read_hf_vision_params(d)
    assert got_cfg == cfg
    for k, w in expected_q3(sd32, cfg, old).items():
        np.testing.assert_array_equal(params[k], w, err_msg=k)


def test_convert_qwen3_strictness(q3_ckpt, tmp_path):
    cfg, dirs, sd32, _ = q3_ckpt
    prefix = _prefix_of(sd32)

    def variant(name, edit):
        d = tmp_path / name
        d.mkdir()
        tensors = dict(sd32)
        edit(tensors)
        write_safetensors(d / "model.safetensors", tensors, {"format": "pt"})
        shutil.copy(dirs["f32"] / "config.json", d / "config.json")
        return d

    with pytest.raises(CheckpointError, match="missing.*pos_embed.weight"):
        hf_read.read_hf_vision_params(variant("no_pos", lambda t: t.pop(prefix + "pos_embed.weight")))
    with pytest.raises(CheckpointError, match="match no"):
        hf_read.read_hf_vision_params(
            variant(
                "extra",
                lambda t: t.update(
                    {prefix + "deepstack_merger_list.2.norm.weight": np.zeros(4 * cfg.width, np.float32)}
                ),
            )
        )
    with pytest.raises(CheckpointError, match="shape"):
        hf_read.read_hf_vision_params(
            variant(
                "bad_shape", lambda t: t.update({prefix + "pos_embed.weight": np.zeros((35, cfg.width), np.float32)})
            )
        )
