"""HF Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 checkpoint (and the families carrying those towers:
the MoE models, Qwen4-Exp, Qwen3-Omni, Qwen2.5-Omni) -> our params, through one strict, declarative
key table.

Reading touches only the vision tensors: safetensors headers (or the shard index) say where each
tensor lives, only shards holding vision keys are opened, and tensor bytes are memory-mapped and
copied one at a time (a 72B checkpoint is ~144 GB, its vision tower ~1.3 GB). Our own safetensors
reader handles BF16 without torch. Every HF vision key must match exactly one rule of `RULES`,
every one of our params (and every row of a stacked param: one per block, or one per deepstack
merger) must be filled exactly once, and
shapes are checked before and after each transform; anything else raises `CheckpointError`.

A converted directory holds:
  config.json                {"format": "qwen_vit_jax", "format_version": 1, "vision_config": ...,
                              "source": {"hf_dir": ..., "keys_prefix": ...}, "dtype": ...}
  params.safetensors         flat NNX paths, blocks stacked over depth, deepstack mergers stacked
                             over their taps, kernels [in, out]
  preprocessor_config.json   copied from the HF directory when present
  video_preprocessor_config.json   likewise (Qwen3-VL checkpoints ship one)
No torch, transformers or jax is imported here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from qwen_vit_jax.config import DTYPES, GLM4V, PADDLEOCR_VL, QWEN2_5_VL, QWEN2_VL, QWEN3_5, QWEN3_VL, VisionConfig
from qwen_vit_jax.safetensors_io import (  # noqa: F401 (CheckpointError, read_safetensors: public here too)
    _PARAM_DTYPES,
    _ST_NAMES,
    CheckpointError,
    SafetensorsFile,
    _unique_keys,
    read_safetensors,
    write_safetensors,
)

FORMAT, FORMAT_VERSION = "qwen_vit_jax", 1
CONFIG_FILE, PARAMS_FILE, PREPROCESSOR_FILE = "config.json", "params.safetensors", "preprocessor_config.json"
VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"


# The safetensors reader / writer and CheckpointError live in safetensors_io.py (re-exported here).


# ---- the key table ----------------------------------------------------------------------------
def _identity(w, cfg):
    return w


def _linear(w, cfg):  # torch Linear weight [out, in] -> kernel [in, out], used as x @ kernel
    return w.T


def _conv(w, cfg):
    # Conv3d with stride == kernel over rows already flattened as (C, T, ph, pw): exactly
    # rows [N, P] @ weight.reshape(D, P).T (PaddleOCR-VL's Conv2d: rows (C, ph, pw), the same)
    return w.reshape(cfg.width, cfg.patch_dim).T


def _downsample(w, cfg):
    # GLM's Conv2d(D -> O, kernel = stride = merge) over a merge unit's rows viewed as [m, m, D]:
    # out[o] = sum_{i, j, d} W[o, d, i, j] x[(i, j), d], i.e. the concatenated [m * m * D] row (unit
    # rows in raster order, then width) @ W.permute(i, j, d, o)
    return w.transpose(2, 3, 1, 0).reshape(cfg.merge_unit * cfg.width, cfg.out_dim)


def dims_to_shape(spec: str, cfg: VisionConfig) -> tuple[int, ...]:
    """Dimension string -> shape, e.g. "3D D" -> (3 * width, width)."""
    dims = dict(
        D=cfg.width,
        I=cfg.intermediate_size,
        O=cfg.out_dim,
        M=cfg.merge_unit * cfg.width,
        P=cfg.patch_dim,
        C=cfg.in_channels,
        T=cfg.temporal_patch_size,
        p=cfg.patch_size,
        N=cfg.num_position_embeddings,
        J=cfg.merger_intermediate_size,
        m=cfg.spatial_merge_size,
    )
    tokens = (re.fullmatch(r"(\d*)([A-Za-z])", t) for t in spec.split())
    return tuple(int(m[1] or 1) * dims[m[2]] for m in tokens)


# Key layouts: how a family spells its tower's tensors. Most families spell them as their variant
# does ("native"); the Omni thinkers keep older names (Qwen3-Omni: the merger as `ln_q` / `mlp.0` /
# `mlp.2`, the deepstack mergers as `merger_list.k`; Qwen2.5-Omni: separate `q` / `k` / `v`).
NATIVE, OMNI3, OMNI25 = "native", "qwen3_omni_moe", "qwen2_5_omni"
LAYOUTS = (NATIVE, OMNI3, OMNI25)


def key_layout(cfg: VisionConfig) -> str:
    """The key layout of `cfg`'s checkpoint family (one of LAYOUTS)."""
    return cfg.hf_family if cfg.hf_family in (OMNI3, OMNI25) else NATIVE


@dataclasses.dataclass(frozen=True)
class Rule:
    """HF tensor family -> one of our params.

    pattern: anchored regex on the prefix-stripped HF key; a `(?P<layer>...)` group marks a
      per-block tensor filling row `layer` of our stacked [L, ...] param, a `(?P<tap>...)` group a
      deepstack-merger tensor filling row `tap` of our stacked [K, ...] param (K deepstack layers;
      row k is the merger of the k-th entry of cfg.deepstack_layers, as in HF's list).
    src, dst: shapes as dimension strings (D width, I MLP hidden, O merger out, M = merge_unit * D,
      P patch_dim, C/T/p channels/temporal patch/patch, N position-table rows); dst is per row.
    variants, layouts: the rule applies to a config of one of `variants` whose checkpoint spells its
      keys in one of `layouts` (`key_layout`).
    part: (i, k) for a split -> fused rule: the tensor fills the i-th of k equal column blocks of
      the target's last axis (Qwen2.5-Omni's q, k, v -> our qkv); `whole` is then the target's
      per-row shape, dst the part's.
    """

    pattern: str
    target: str
    transform: Callable[[np.ndarray, VisionConfig], np.ndarray]
    src: str
    dst: str
    variants: tuple[str, ...] = (QWEN2_VL, QWEN2_5_VL)
    layouts: tuple[str, ...] = LAYOUTS
    part: tuple[int, int] | None = None
    whole: str | None = None
    needs: str | None = None  # a VisionConfig flag the tensor exists under (GLM's qkv bias: "qkv_bias")

    def applies(self, cfg: VisionConfig) -> bool:
        """Whether the rule is part of `cfg`'s table (variant, key layout, flag, and a stack with rows)."""
        return (
            cfg.variant in self.variants
            and key_layout(cfg) in self.layouts
            and (self.needs is None or getattr(cfg, self.needs))
            and not (self.per_block and self.rows(cfg) == 0)
        )

    @property
    def stack(self) -> str | None:
        """ "layer" (stacked over blocks), "tap" (stacked over deepstack mergers) or None."""
        return next((g for g in ("layer", "tap") if f"(?P<{g}>" in self.pattern), None)

    @property
    def per_block(self) -> bool:
        return self.stack is not None

    def rows(self, cfg: VisionConfig) -> int:
        """Leading size of our stacked param: depth, or the number of deepstack mergers."""
        return cfg.depth if self.stack == "layer" else cfg.num_deepstack

    def hf_key(self, layer: int | None) -> str:
        """The HF key (without prefix) this rule expects, for error messages."""
        return re.sub(r"\(\?P<(?:layer|tap)>[^)]*\)", str(layer), self.pattern).replace("\\", "")


_B = r"blocks\.(?P<layer>0|[1-9][0-9]*)\."
_DS = r"deepstack_merger_list\.(?P<tap>0|[1-9][0-9]*)\."
_DSO = r"merger_list\.(?P<tap>0|[1-9][0-9]*)\."  # Qwen3-Omni's spelling of the deepstack mergers
_V2, _V25, _V3, _V3VL = (QWEN2_VL,), (QWEN2_5_VL,), (QWEN3_VL, QWEN3_5), (QWEN3_VL,)
_ALL = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_5)
_LN = (QWEN2_VL, QWEN3_VL, QWEN3_5)  # LayerNorm (with bias) variants
_FUSED_QKV, _NATIVE, _O3, _O25 = (NATIVE, OMNI3), (NATIVE,), (OMNI3,), (OMNI25,)
_P = (PADDLEOCR_VL,)
_PL = r"vision_model\.encoder\.layers\.(?P<layer>0|[1-9][0-9]*)\."  # PaddleOCR-VL's blocks
RULES: tuple[Rule, ...] = (
    Rule(r"patch_embed\.proj\.weight", "patch_embed.kernel", _conv, "D C T p p", "P D", _ALL),
    Rule(r"patch_embed\.proj\.bias", "patch_embed.bias", _identity, "D", "D", _V3),
    Rule(r"pos_embed\.weight", "pos_embed.table", _identity, "N D", "N D", _V3),
    Rule(_B + r"norm1\.weight", "blocks.norm1.scale", _identity, "D", "D", _ALL),
    Rule(_B + r"norm1\.bias", "blocks.norm1.bias", _identity, "D", "D", _LN),
    Rule(_B + r"norm2\.weight", "blocks.norm2.scale", _identity, "D", "D", _ALL),
    Rule(_B + r"norm2\.bias", "blocks.norm2.bias", _identity, "D", "D", _LN),
    Rule(_B + r"attn\.qkv\.weight", "blocks.attn.qkv.kernel", _linear, "3D D", "D 3D", _ALL, _FUSED_QKV),
    Rule(_B + r"attn\.qkv\.bias", "blocks.attn.qkv.bias", _identity, "3D", "3D", _ALL, _FUSED_QKV),
    # Qwen2.5-Omni: q, k, v apart; each fills its third of our fused qkv (columns q | k | v, as HF's
    # fused qkv rows are ordered).
    *(
        Rule(_B + rf"attn\.{n}\.weight", "blocks.attn.qkv.kernel", _linear, "D D", "D D", _V25, _O25, (i, 3), "D 3D")
        for i, n in enumerate("qkv")
    ),
    *(
        Rule(_B + rf"attn\.{n}\.bias", "blocks.attn.qkv.bias", _identity, "D", "D", _V25, _O25, (i, 3), "3D")
        for i, n in enumerate("qkv")
    ),
    Rule(_B + r"attn\.proj\.weight", "blocks.attn.proj.kernel", _linear, "D D", "D D", _ALL),
    Rule(_B + r"attn\.proj\.bias", "blocks.attn.proj.bias", _identity, "D", "D", _ALL),
    Rule(_B + r"mlp\.fc1\.weight", "blocks.mlp.fc1.kernel", _linear, "I D", "D I", _V2),
    Rule(_B + r"mlp\.fc1\.bias", "blocks.mlp.fc1.bias", _identity, "I", "I", _V2),
    Rule(_B + r"mlp\.fc2\.weight", "blocks.mlp.fc2.kernel", _linear, "D I", "I D", _V2),
    Rule(_B + r"mlp\.fc2\.bias", "blocks.mlp.fc2.bias", _identity, "D", "D", _V2),
    Rule(_B + r"mlp\.linear_fc1\.weight", "blocks.mlp.fc1.kernel", _linear, "I D", "D I", _V3),
    Rule(_B + r"mlp\.linear_fc1\.bias", "blocks.mlp.fc1.bias", _identity, "I", "I", _V3),
    Rule(_B + r"mlp\.linear_fc2\.weight", "blocks.mlp.fc2.kernel", _linear, "D I", "I D", _V3),
    Rule(_B + r"mlp\.linear_fc2\.bias", "blocks.mlp.fc2.bias", _identity, "D", "D", _V3),
    Rule(_B + r"mlp\.gate_proj\.weight", "blocks.mlp.gate.kernel", _linear, "I D", "D I", _V25),
    Rule(_B + r"mlp\.gate_proj\.bias", "blocks.mlp.gate.bias", _identity, "I", "I", _V25),
    Rule(_B + r"mlp\.up_proj\.weight", "blocks.mlp.up.kernel", _linear, "I D", "D I", _V25),
    Rule(_B + r"mlp\.up_proj\.bias", "blocks.mlp.up.bias", _identity, "I", "I", _V25),
    Rule(_B + r"mlp\.down_proj\.weight", "blocks.mlp.down.kernel", _linear, "D I", "I D", _V25),
    Rule(_B + r"mlp\.down_proj\.bias", "blocks.mlp.down.bias", _identity, "D", "D", _V25),
    Rule(r"merger\.ln_q\.weight", "merger.norm.scale", _identity, "D", "D"),
    Rule(r"merger\.ln_q\.bias", "merger.norm.bias", _identity, "D", "D", _V2),
    Rule(r"merger\.mlp\.0\.weight", "merger.fc1.kernel", _linear, "M M", "M M"),
    Rule(r"merger\.mlp\.0\.bias", "merger.fc1.bias", _identity, "M", "M"),
    Rule(r"merger\.mlp\.2\.weight", "merger.fc2.kernel", _linear, "O M", "M O"),
    Rule(r"merger\.mlp\.2\.bias", "merger.fc2.bias", _identity, "O", "O"),
    # Qwen3-Omni keeps the Qwen2 merger's names for its Qwen3-VL merger (a LayerNorm with bias).
    Rule(r"merger\.ln_q\.weight", "merger.norm.scale", _identity, "D", "D", _V3VL, _O3),
    Rule(r"merger\.ln_q\.bias", "merger.norm.bias", _identity, "D", "D", _V3VL, _O3),
    Rule(r"merger\.mlp\.0\.weight", "merger.fc1.kernel", _linear, "M M", "M M", _V3VL, _O3),
    Rule(r"merger\.mlp\.0\.bias", "merger.fc1.bias", _identity, "M", "M", _V3VL, _O3),
    Rule(r"merger\.mlp\.2\.weight", "merger.fc2.kernel", _linear, "O M", "M O", _V3VL, _O3),
    Rule(r"merger\.mlp\.2\.bias", "merger.fc2.bias", _identity, "O", "O", _V3VL, _O3),
    Rule(r"merger\.norm\.weight", "merger.norm.scale", _identity, "D", "D", _V3, _NATIVE),
    Rule(r"merger\.norm\.bias", "merger.norm.bias", _identity, "D", "D", _V3, _NATIVE),
    Rule(r"merger\.linear_fc1\.weight", "merger.fc1.kernel", _linear, "M M", "M M", _V3, _NATIVE),
    Rule(r"merger\.linear_fc1\.bias", "merger.fc1.bias", _identity, "M", "M", _V3, _NATIVE),
    Rule(r"merger\.linear_fc2\.weight", "merger.fc2.kernel", _linear, "O M", "M O", _V3, _NATIVE),
    Rule(r"merger\.linear_fc2\.bias", "merger.fc2.bias", _identity, "O", "O", _V3, _NATIVE),
    # Qwen3-VL deepstack mergers: the norm runs after the 2x2 shuffle, so it spans M = 4D.
    Rule(_DS + r"norm\.weight", "deepstack.norm.scale", _identity, "M", "M", _V3VL, _NATIVE),
    Rule(_DS + r"norm\.bias", "deepstack.norm.bias", _identity, "M", "M", _V3VL, _NATIVE),
    Rule(_DS + r"linear_fc1\.weight", "deepstack.fc1.kernel", _linear, "M M", "M M", _V3VL, _NATIVE),
    Rule(_DS + r"linear_fc1\.bias", "deepstack.fc1.bias", _identity, "M", "M", _V3VL, _NATIVE),
    Rule(_DS + r"linear_fc2\.weight", "deepstack.fc2.kernel", _linear, "O M", "M O", _V3VL, _NATIVE),
    Rule(_DS + r"linear_fc2\.bias", "deepstack.fc2.bias", _identity, "O", "O", _V3VL, _NATIVE),
    Rule(_DSO + r"ln_q\.weight", "deepstack.norm.scale", _identity, "M", "M", _V3VL, _O3),
    Rule(_DSO + r"ln_q\.bias", "deepstack.norm.bias", _identity, "M", "M", _V3VL, _O3),
    Rule(_DSO + r"mlp\.0\.weight", "deepstack.fc1.kernel", _linear, "M M", "M M", _V3VL, _O3),
    Rule(_DSO + r"mlp\.0\.bias", "deepstack.fc1.bias", _identity, "M", "M", _V3VL, _O3),
    Rule(_DSO + r"mlp\.2\.weight", "deepstack.fc2.kernel", _linear, "O M", "M O", _V3VL, _O3),
    Rule(_DSO + r"mlp\.2\.bias", "deepstack.fc2.bias", _identity, "O", "O", _V3VL, _O3),
    # PaddleOCR-VL: a SigLIP-named tower under visual.vision_model, q / k / v / out_proj apart, a
    # post_layernorm, and HF's projector (`mlp_AR.*`, beside the tower: see PROJECTOR_PREFIXES).
    Rule(r"vision_model\.embeddings\.patch_embedding\.weight", "patch_embed.kernel", _conv, "D C p p", "P D", _P),
    Rule(r"vision_model\.embeddings\.patch_embedding\.bias", "patch_embed.bias", _identity, "D", "D", _P),
    Rule(r"vision_model\.embeddings\.position_embedding\.weight", "pos_embed.table", _identity, "N D", "N D", _P),
    Rule(_PL + r"layer_norm1\.weight", "blocks.norm1.scale", _identity, "D", "D", _P),
    Rule(_PL + r"layer_norm1\.bias", "blocks.norm1.bias", _identity, "D", "D", _P),
    Rule(_PL + r"layer_norm2\.weight", "blocks.norm2.scale", _identity, "D", "D", _P),
    Rule(_PL + r"layer_norm2\.bias", "blocks.norm2.bias", _identity, "D", "D", _P),
    *(
        Rule(
            _PL + rf"self_attn\.{n}_proj\.weight",
            "blocks.attn.qkv.kernel",
            _linear,
            "D D",
            "D D",
            _P,
            part=(i, 3),
            whole="D 3D",
        )
        for i, n in enumerate("qkv")
    ),
    *(
        Rule(
            _PL + rf"self_attn\.{n}_proj\.bias",
            "blocks.attn.qkv.bias",
            _identity,
            "D",
            "D",
            _P,
            part=(i, 3),
            whole="3D",
        )
        for i, n in enumerate("qkv")
    ),
    Rule(_PL + r"self_attn\.out_proj\.weight", "blocks.attn.proj.kernel", _linear, "D D", "D D", _P),
    Rule(_PL + r"self_attn\.out_proj\.bias", "blocks.attn.proj.bias", _identity, "D", "D", _P),
    Rule(_PL + r"mlp\.fc1\.weight", "blocks.mlp.fc1.kernel", _linear, "I D", "D I", _P),
    Rule(_PL + r"mlp\.fc1\.bias", "blocks.mlp.fc1.bias", _identity, "I", "I", _P),
    Rule(_PL + r"mlp\.fc2\.weight", "blocks.mlp.fc2.kernel", _linear, "D I", "I D", _P),
    Rule(_PL + r"mlp\.fc2\.bias", "blocks.mlp.fc2.bias", _identity, "D", "D", _P),
    Rule(r"vision_model\.post_layernorm\.weight", "post_norm.scale", _identity, "D", "D", _P),
    Rule(r"vision_model\.post_layernorm\.bias", "post_norm.bias", _identity, "D", "D", _P),
    Rule(r"mlp_AR\.pre_norm\.weight", "merger.norm.scale", _identity, "D", "D", _P),
    Rule(r"mlp_AR\.pre_norm\.bias", "merger.norm.bias", _identity, "D", "D", _P),
    Rule(r"mlp_AR\.linear_1\.weight", "merger.fc1.kernel", _linear, "M M", "M M", _P),
    Rule(r"mlp_AR\.linear_1\.bias", "merger.fc1.bias", _identity, "M", "M", _P),
    Rule(r"mlp_AR\.linear_2\.weight", "merger.fc2.kernel", _linear, "O M", "M O", _P),
    Rule(r"mlp_AR\.linear_2\.bias", "merger.fc2.bias", _identity, "O", "O", _P),
)
_G = (GLM4V,)
RULES += (
    # GLM-4.1V / 4.5V: RMSNorm blocks (scale only), SwiGLU without biases, qkv bias per the config's
    # attention_bias, no proj bias; norms after the patch embedding and the last block; the merger
    # starts with the downsample conv (a matmul over the merge unit's concatenated rows).
    Rule(r"patch_embed\.proj\.weight", "patch_embed.kernel", _conv, "D C T p p", "P D", _G),
    Rule(r"patch_embed\.proj\.bias", "patch_embed.bias", _identity, "D", "D", _G),
    Rule(r"post_conv_layernorm\.weight", "patch_norm.scale", _identity, "D", "D", _G),
    Rule(r"embeddings\.position_embedding\.weight", "pos_embed.table", _identity, "N D", "N D", _G),
    Rule(_B + r"norm1\.weight", "blocks.norm1.scale", _identity, "D", "D", _G),
    Rule(_B + r"norm2\.weight", "blocks.norm2.scale", _identity, "D", "D", _G),
    Rule(_B + r"attn\.qkv\.weight", "blocks.attn.qkv.kernel", _linear, "3D D", "D 3D", _G),
    Rule(_B + r"attn\.qkv\.bias", "blocks.attn.qkv.bias", _identity, "3D", "3D", _G, needs="qkv_bias"),
    Rule(_B + r"attn\.proj\.weight", "blocks.attn.proj.kernel", _linear, "D D", "D D", _G),
    Rule(_B + r"mlp\.gate_proj\.weight", "blocks.mlp.gate.kernel", _linear, "I D", "D I", _G),
    Rule(_B + r"mlp\.up_proj\.weight", "blocks.mlp.up.kernel", _linear, "I D", "D I", _G),
    Rule(_B + r"mlp\.down_proj\.weight", "blocks.mlp.down.kernel", _linear, "D I", "I D", _G),
    Rule(r"post_layernorm\.weight", "post_norm.scale", _identity, "D", "D", _G),
    Rule(r"downsample\.weight", "merger.downsample.kernel", _downsample, "O D m m", "M O", _G),
    Rule(r"downsample\.bias", "merger.downsample.bias", _identity, "O", "O", _G),
    Rule(r"merger\.proj\.weight", "merger.proj.kernel", _linear, "O O", "O O", _G),
    Rule(r"merger\.post_projection_norm\.weight", "merger.norm.scale", _identity, "O", "O", _G),
    Rule(r"merger\.post_projection_norm\.bias", "merger.norm.bias", _identity, "O", "O", _G),
    Rule(r"merger\.gate_proj\.weight", "merger.mlp.gate.kernel", _linear, "J O", "O J", _G),
    Rule(r"merger\.up_proj\.weight", "merger.mlp.up.kernel", _linear, "J O", "O J", _G),
    Rule(r"merger\.down_proj\.weight", "merger.mlp.down.kernel", _linear, "O J", "J O", _G),
)
# PaddleOCR-VL keeps its merger (HF's projector) beside the tower, not under its prefix: the hub and
# save_pretrained spell it `mlp_AR.*`, transformers 5.x in memory `model.projector.*`. Its tensors
# are matched as `mlp_AR.*` whichever prefix they carry.
PROJECTOR_PREFIXES = ("mlp_AR.", "model.projector.")


def expected_param_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Our flat param key -> shape; per-block params lead with L = cfg.depth, deepstack params with
    K = cfg.num_deepstack (a Qwen3-VL config without deepstack layers has none)."""
    return {
        r.target: ((r.rows(cfg),) if r.per_block else ()) + dims_to_shape(r.whole or r.dst, cfg)
        for r in RULES
        if r.applies(cfg)
    }


# ---- reading an HF checkpoint -----------------------------------------------------------------
# hub / transformers 5.x saves, some 4.5x saves (and the MoE / Qwen4-Exp hub files), the Omni thinkers
_PREFIXES = ("visual.", "model.visual.", "thinker.visual.")
_BARE_ROOTS = ("patch_embed.", "blocks.", "merger.", "vision_model.")  # a vision-only checkpoint (any of its keys)


def locate_tensors(hf_dir: pathlib.Path) -> tuple[dict[str, pathlib.Path], dict[pathlib.Path, SafetensorsFile]]:
    """Every tensor name -> the file holding it, from model.safetensors' header or the shard index.

    Returns the map and the files already opened on the way (the single-file case).
    """
    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if single.is_file():  # transformers prefers it too when both exist
        f = SafetensorsFile(single)
        return dict.fromkeys(f.entries, single), {single: f}
    if not index.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {hf_dir}")
    try:
        d = json.loads(index.read_text(), object_pairs_hook=_unique_keys)
    except ValueError as e:
        raise CheckpointError(f"{index}: not a valid JSON index ({e})") from None
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{index}: no 'weight_map' object of tensor name -> shard file name")
    odd = sorted({v for v in wm.values() if pathlib.PurePath(v).name != v or v in ("", ".", "..")})
    if odd:
        raise CheckpointError(f"{index}: shard names must be plain file names, got {odd[:3]}")
    return {k: hf_dir / v for k, v in wm.items()}, {}


def vision_prefix(keys: Iterable[str], where: pathlib.Path) -> str:
    keys = list(keys)
    found = {p: k for p in _PREFIXES for k in keys if k.startswith(p)}
    if len(found) > 1:
        raise CheckpointError(
            f"{where}: tensors under several tower prefixes are present (e.g. "
            + ", ".join(f"{k!r}" for k in found.values())
            + "): which is the tower?"
        )
    if found:
        return next(iter(found))
    if any(k.startswith(_BARE_ROOTS) for k in keys):
        return ""  # vision-only checkpoint: then every tensor in it must be a vision tensor
    raise CheckpointError(
        f"{where}: no vision tensors (keys under 'visual.', 'model.visual.', 'thinker.visual.' or bare "
        "'patch_embed.' / 'blocks.' / 'merger.')"
    )


def _read_hf(hf_dir) -> tuple[VisionConfig, dict[str, np.ndarray], str]:
    hf_dir = pathlib.Path(hf_dir)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"HF checkpoint directory not found: {hf_dir}")
    config_path = hf_dir / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in the HF checkpoint directory: {config_path}")
    try:
        cfg = VisionConfig.from_hf(config_path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    where, files = locate_tensors(hf_dir)
    prefix = vision_prefix(where, hf_dir)
    rules = [(re.compile(r.pattern), r) for r in RULES if r.applies(cfg)]

    # Pass 1, names only: every vision key maps to exactly one rule and an existing block.
    matched, unknown = [], []
    local = {k: k[len(prefix) :] for k in where if k.startswith(prefix)}  # key -> name the rules match
    if cfg.variant == PADDLEOCR_VL:
        local |= _projector_names(where, hf_dir)
    for key in sorted(local):
        hits = [(r, m) for rx, r in rules if (m := rx.fullmatch(local[key]))]
        rule = hits[0][0] if len(hits) == 1 else None
        layer = int(hits[0][1][rule.stack]) if rule is not None and rule.per_block else None
        if len(hits) != 1:
            unknown.append(f"{key!r} in {where[key]}" + (" (matches several rules)" if hits else ""))
        elif layer is not None and layer >= rule.rows(cfg):
            what = ("block", "depth") if rule.stack == "layer" else ("deepstack merger", "deepstack layers")
            unknown.append(f"{key!r} in {where[key]} ({what[0]} {layer} >= {what[1]} {rule.rows(cfg)})")
        else:
            matched.append((key, hits[0][0], layer))
    if unknown:
        raise CheckpointError(
            f"{hf_dir}: {len(unknown)} vision tensor(s) match no {cfg.variant} parameter: "
            + "; ".join(unknown[:10])
            + (" ..." if len(unknown) > 10 else "")
        )

    # Pass 2: open only the files holding vision tensors, check, transform, fill.
    shapes = expected_param_shapes(cfg)
    params: dict[str, np.ndarray] = {}
    filled: dict[tuple[str, int | None], str] = {}
    for key, rule, layer in matched:
        path = where[key]
        f = files[path] if path in files else files.setdefault(path, SafetensorsFile(path))
        if key not in f.entries:
            raise CheckpointError(f"{path}: the index places tensor {key!r} here, but the file lacks it")
        loc = f"{path}: tensor {key!r}"
        st, shape = f.entries[key][:2]
        src, dst = dims_to_shape(rule.src, cfg), dims_to_shape(rule.dst, cfg)  # dst: per row, per part
        if shape != src:
            raise CheckpointError(f"{loc}: shape {shape}, expected {src} = [{rule.src}] for {cfg.variant}")
        if st not in _PARAM_DTYPES:
            raise CheckpointError(f"{loc}: dtype {st} is not one of {_PARAM_DTYPES}")
        w = rule.transform(f.get(key), cfg)
        if w.shape != dst:  # a table bug, but never write a wrongly shaped param
            raise CheckpointError(f"{loc}: transformed to {w.shape}, expected {dst} for {rule.target}")
        slot = (rule.target, layer, rule.part)
        if slot in filled:
            what = f"{rule.target}[{layer}]" + ("" if rule.part is None else f" part {rule.part[0]} of {rule.part[1]}")
            raise CheckpointError(f"{loc}: {what} already filled from {filled[slot]!r}")
        filled[slot] = key
        if layer is None and rule.part is None:
            params[rule.target] = np.array(w)  # copy out of the file mapping
            continue
        if rule.target not in params:  # preallocate [L, ...] (or the fused whole) in the source dtype
            params[rule.target] = np.empty(shapes[rule.target], w.dtype)
        stack = params[rule.target]
        if stack.dtype != w.dtype:
            raise CheckpointError(f"{loc}: dtype {w.dtype}, other parts of {rule.target}: {stack.dtype}")
        row = stack if layer is None else stack[layer]  # a view: writes land in the stack
        if rule.part is None:
            row[...] = w
        else:  # the i-th of k column blocks of the last axis
            i, k = rule.part
            width = row.shape[-1] // k
            row[..., i * width : (i + 1) * width] = w

    missing = [
        f"{'' if r.pattern.startswith('mlp_AR') else prefix}{r.hf_key(i)} (-> {r.target}"
        + ("" if i is None else f"[{i}]")
        + ")"
        for _, r in rules
        for i in (range(r.rows(cfg)) if r.per_block else [None])
        if (r.target, i, r.part) not in filled
    ]
    if missing:
        raise CheckpointError(
            f"{hf_dir}: {len(missing)} {cfg.variant} vision tensor(s) missing: "
            + "; ".join(missing[:10])
            + (" ..." if len(missing) > 10 else "")
        )
    return cfg, params, prefix


def _projector_names(where: dict[str, pathlib.Path], hf_dir) -> dict[str, str]:
    """PaddleOCR-VL's projector tensors (outside the tower's prefix) -> their `mlp_AR.*` names."""
    found = {p: [k for k in where if k.startswith(p)] for p in PROJECTOR_PREFIXES}
    if all(found.values()):
        raise CheckpointError(
            f"{hf_dir}: both 'mlp_AR.*' and 'model.projector.*' tensors are present (e.g. "
            f"{found['mlp_AR.'][0]!r}, {found['model.projector.'][0]!r}): which is the projector?"
        )
    return {k: "mlp_AR." + k[len(p) :] for p, keys in found.items() for k in keys}


def read_hf_vision_params(hf_dir: str | os.PathLike) -> tuple[VisionConfig, dict[str, np.ndarray]]:
    """Read the vision tower of an HF checkpoint directory into our flat params (source dtype kept).

    Returns (cfg, params) with params as in `expected_param_shapes(cfg)`, e.g. for Qwen2.5-VL
    `patch_embed.kernel` [P, D], `blocks.attn.qkv.kernel` [L, D, 3D], `merger.fc2.kernel` [4D, O].
    Raises FileNotFoundError for a missing directory / config.json / shard, CheckpointError otherwise.
    """
    cfg, params, _ = _read_hf(hf_dir)
    return cfg, params


# ---- our format -------------------------------------------------------------------------------
def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_replaceable(out: pathlib.Path, hf_dir) -> None:
    """Refuse to delete anything that is not an earlier output of ours (or an empty directory)."""
    ours = out.is_dir() and not out.is_symlink() and out.resolve() != pathlib.Path(hf_dir).resolve()
    if ours and any(out.iterdir()):
        try:
            ours = json.loads((out / CONFIG_FILE).read_text()).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            ours = False
    if not ours:
        raise FileExistsError(f"{out} exists and is not a {FORMAT} output directory; not replacing it")


def _install(tmp: pathlib.Path, out: pathlib.Path) -> None:
    if os.path.lexists(out):  # overwrite: old aside, new in, then drop old
        aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        try:
            os.rename(out, aside)  # replaces the empty placeholder
        except BaseException:
            aside.rmdir()
            raise
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(aside, out)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, out)
    _fsync(out.parent)


def convert_checkpoint(
    hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | None = None, overwrite: bool = False
) -> pathlib.Path:
    """Convert an HF checkpoint's vision tower into `out_dir`, atomically.

    dtype: None keeps the checkpoint's dtype (bit-exact), "float32" / "bfloat16" cast.
    Everything is written into a temporary sibling directory, fsynced and renamed into place; on
    any failure it is removed, so nothing is left behind. An existing `out_dir` raises
    FileExistsError unless `overwrite` (it must then be an earlier output of ours, or empty).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be None or one of {tuple(DTYPES)}, got {dtype!r}")
    hf_dir, out = pathlib.Path(hf_dir), pathlib.Path(out_dir)
    if os.path.lexists(out):  # before reading a possibly huge checkpoint
        if not overwrite:
            raise FileExistsError(f"output directory exists: {out} (overwrite / --overwrite replaces it)")
        _check_replaceable(out, hf_dir)
    cfg, params, prefix = _read_hf(hf_dir)
    if dtype is not None:
        params = {k: v.astype(DTYPES[dtype], copy=False) for k, v in params.items()}
    names = sorted({v.dtype.name for v in params.values()})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "vision_config": cfg.to_dict(),
        "source": {"hf_dir": str(hf_dir.resolve()), "keys_prefix": prefix},
        "dtype": names[0] if len(names) == 1 else "mixed",
    }

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        umask = os.umask(0o22)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the result is an ordinary directory
        write_safetensors(tmp / PARAMS_FILE, params, {"format": FORMAT, "version": str(FORMAT_VERSION)})
        with open(tmp / CONFIG_FILE, "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        for name in (PREPROCESSOR_FILE, VIDEO_PREPROCESSOR_FILE):
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, tmp / name)
                _fsync(tmp / name)
        _fsync(tmp)
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_converted(out_dir: str | os.PathLike) -> tuple[VisionConfig, dict[str, np.ndarray], dict]:
    """Load a converted directory: (cfg, params as read-only memory-mapped arrays, config.json dict).

    Raises FileNotFoundError for a missing directory or file, CheckpointError when the format
    marker, version, config or the param set (names, shapes, float dtypes) is wrong.
    """
    out = pathlib.Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"converted checkpoint directory not found: {out}")
    config_path, params_path = out / CONFIG_FILE, out / PARAMS_FILE
    for p in (config_path, params_path):
        if not p.is_file():
            raise FileNotFoundError(f"missing {p}")
    try:
        meta = json.loads(config_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f'{config_path}: not a {FORMAT} config (no "format": "{FORMAT}")')
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{config_path}: format_version {meta.get('format_version')!r}, this code reads {FORMAT_VERSION}"
        )
    try:
        cfg = VisionConfig.from_dict(meta["vision_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{config_path}: bad vision_config ({e})") from None
    params = read_safetensors(params_path)
    shapes = expected_param_shapes(cfg)
    problems = [f"missing {k}" for k in sorted(set(shapes) - set(params))]
    problems += [f"unexpected {k}" for k in sorted(set(params) - set(shapes))]
    problems += [
        f"{k}: shape {params[k].shape}, expected {s}" for k, s in shapes.items() if k in params and params[k].shape != s
    ]
    problems += [
        f"{k}: dtype {v.dtype} is not a float dtype"
        for k, v in params.items()
        if _ST_NAMES.get(v.dtype) not in _PARAM_DTYPES
    ]
    if problems:
        raise CheckpointError(
            f"{params_path}: params do not match the {cfg.variant} config: "
            + "; ".join(problems[:10])
            + (" ..." if len(problems) > 10 else "")
        )
    return cfg, params, meta


# ---- command line -----------------------------------------------------------------------------
@contextlib.contextmanager
def sigterm_as_interrupt():
    """While the block runs, SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does.

    SIGTERM's default action ends the process on the spot: no `except` / `finally` runs, so a
    temporary file or directory being written would be left behind. As an exception it unwinds
    like Ctrl-C: the writers remove their temporary output and the previous output stays intact.
    Outside the main thread (where Python cannot install handlers) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """`HF_DIR OUT_DIR [--dtype {float32,bfloat16}] [--overwrite]`; prints one summary line."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Convert the vision tower of an HF Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 "
        "checkpoint (or Qwen3-VL-MoE, Qwen3.5-MoE, Qwen4-Exp, Qwen3-Omni, Qwen2.5-Omni) to qwen_vit_jax params.",
    )
    ap.add_argument("hf_dir", help="HF checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("out_dir", help="output directory (must not exist unless --overwrite)")
    ap.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="cast the params (default: keep the checkpoint's dtype)"
    )
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier output in OUT_DIR")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        with sigterm_as_interrupt():
            out = convert_checkpoint(args.hf_dir, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
            cfg, params, meta = load_converted(out)
    except (OSError, ValueError) as e:  # FileNotFoundError, FileExistsError, CheckpointError, I/O
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: convert_checkpoint removed its temporary output
        print("error: interrupted; nothing written", file=sys.stderr)
        return 130
    n = sum(v.size for v in params.values())
    print(
        f"converted {cfg.variant} vision tower (depth {cfg.depth}, width {cfg.width}): {n:,} params in "
        f"{len(params)} tensors, dtype {meta['dtype']}, {time.perf_counter() - t0:.1f} s -> {out}"
    )
    return 0
