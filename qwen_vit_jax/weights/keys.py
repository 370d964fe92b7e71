"""The key table: every HF vision tensor of every family -> one of our params, with its transform
and its shapes (`RULES`), declared once and read both ways (hf_read.py converts HF -> ours,
export.py ours -> HF, tools/demo.py writes a random checkpoint from it).

Our params are flat NNX paths ("blocks.attn.qkv.kernel"), blocks stacked over depth and deepstack
mergers over their taps, kernels [in, out]. Shapes are written as dimension strings ("3D D") over
the config's sizes (`dims_to_shape`). No torch, transformers or jax here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.families import GLM4V, OMNI, PADDLEOCR_VL, QWEN2_5_VL, QWEN2_VL, QWEN3_5, QWEN3_VL


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


# The transforms run backwards (export.py): our param row -> the HF tensor of shape `shape` (its `src`).
INVERSE = {
    _identity: lambda w, shape: w,
    _linear: lambda w, shape: w.T,  # kernel [in, out] -> torch Linear weight [out, in]
    _conv: lambda w, shape: w.T.reshape(shape),  # [P, D] -> [D, P] -> Conv3d [D, C, T, p, p]
}


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
NATIVE, OMNI3, OMNI25 = "native", "qwen3_omni_moe", "qwen2_5_omni"  # layouts, named for their families
LAYOUTS = (NATIVE, OMNI3, OMNI25)


def key_layout(cfg: VisionConfig) -> str:
    """The key layout of `cfg`'s checkpoint family (one of LAYOUTS)."""
    return cfg.hf_family if cfg.hf_family in OMNI else NATIVE


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
