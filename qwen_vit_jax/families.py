"""The towers we build (variants), the HF model families that carry them, what each tower is made
of (`TOWERS`), and HF `config.json` read into VisionConfig fields (`hf_vision_fields`).

HF's variants name the same things differently (the naming trap):
  Qwen2-VL   : `embed_dim` = ViT width, `hidden_size` = merger output, MLP = embed_dim * mlp_ratio
  Qwen2.5-VL : `hidden_size` = ViT width, `out_hidden_size` = merger output, `intermediate_size`
  Qwen3-VL, Qwen3.5 : as Qwen2.5-VL, plus `num_position_embeddings` (a learned square position
               table) and, Qwen3-VL only, `deepstack_visual_indexes` (ours: `deepstack_layers`)
  PaddleOCR-VL : SigLIP names (`num_hidden_layers`, `num_attention_heads`, `num_channels`,
               `layer_norm_eps`), the table's side from `image_size / patch_size`, the merger
               (HF's projector) output from the text model's `hidden_size`
  GLM-4V     : `out_hidden_size` = merger output AND block MLP width, `intermediate_size` = the
               merger's SwiGLU width (ours: `merger_intermediate_size`)
Ours is unambiguous: `width` is the ViT width, `out_dim` the merger output.

A new tower is a row of `TOWERS`, a preset (presets.py) and its key rules (weights/keys.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

QWEN2_VL = "qwen2_vl"
QWEN2_5_VL = "qwen2_5_vl"
QWEN3_VL = "qwen3_vl"
QWEN3_5 = "qwen3_5"
PADDLEOCR_VL = "paddleocr_vl"
GLM4V = "glm4v"
VARIANTS = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_5, PADDLEOCR_VL, GLM4V)
QWEN3_FAMILY = (QWEN3_VL, QWEN3_5)

# HF model families (their top-level model_type) whose vision tower is one of our variants. A
# family names where a checkpoint keeps the tower and how its tensors and config are spelled; it
# never changes the math. Qwen4-Exp subclasses Qwen3.5's vision classes unchanged, the MoE models
# reuse their dense sibling's tower, and the Omni thinkers carry the Qwen3-VL / Qwen2.5-VL tower
# (docs/family.md).
FAMILIES = {
    "qwen2_vl": QWEN2_VL,
    "qwen2_5_vl": QWEN2_5_VL,
    "qwen3_vl": QWEN3_VL,
    "qwen3_5": QWEN3_5,
    "qwen3_vl_moe": QWEN3_VL,
    "qwen3_5_moe": QWEN3_5,
    "qwen4_exp": QWEN3_5,
    "qwen3_omni_moe": QWEN3_VL,
    "qwen2_5_omni": QWEN2_5_VL,
    "paddleocr_vl": PADDLEOCR_VL,
    "glm4v": GLM4V,
    "glm4v_moe": GLM4V,
}
# The Omni families: the tower (and the prompt's rules) sit in a thinker (`thinker_config`,
# `thinker.visual.*`), audio tokens beside the vision ones.
OMNI = ("qwen2_5_omni", "qwen3_omni_moe")
# The dtypes the tower computes in (config.DTYPES maps them to numpy dtypes).
DTYPE_NAMES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Tower:
    """What a variant's tower is made of: the defaults of VisionConfig's feature fields, and which
    optional parts its config may switch on (`windows`, `deepstack`)."""

    norm: str  # "rmsnorm" (scale only) or "layernorm" (scale + bias): blocks and merger
    mlp: str  # "swiglu" (gate / up / down) or "mlp" (fc1 -> act -> fc2)
    block_bias: bool  # biases on the blocks' attention projection and MLP
    patch_norm: bool  # an RMSNorm right after the patch embedding (GLM)
    patch_embed_bias: bool  # a bias on the patch embedding
    merger: str  # "mlp" (norm -> fc1 -> GELU -> fc2) or "glm" (downsample conv -> proj -> LN -> GELU -> SwiGLU)
    pos_embed: str  # the learned table's resampling: "" (no table), "bilinear-corners", "bilinear", "bicubic"
    post_norm: bool  # a norm after the last block
    merger_norm_eps: float | None  # the merger norm's eps; None: norm_eps
    raster_rows: bool  # pixel rows arrive in raster order per frame (the plan reorders them)
    images_only: bool  # no video: every grid row has t = 1
    windows: bool = False  # may use window attention (window_size, fullatt_block_indexes)
    deepstack: bool = False  # may tap blocks into deepstack mergers (deepstack_layers)

    def features(self) -> dict[str, Any]:
        """The VisionConfig feature fields this row sets."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in FEATURES}


FEATURES = (
    "norm",
    "mlp",
    "block_bias",
    "patch_norm",
    "patch_embed_bias",
    "merger",
    "pos_embed",
    "post_norm",
    "merger_norm_eps",
    "raster_rows",
    "images_only",
)
_QWEN2 = Tower("layernorm", "mlp", True, False, False, "mlp", "", False, None, False, False)
_QWEN3 = dataclasses.replace(_QWEN2, patch_embed_bias=True, pos_embed="bilinear-corners")
TOWERS = {
    # Qwen2-VL: LayerNorm (with bias), fc1 -> act -> fc2, full attention in every block.
    QWEN2_VL: _QWEN2,
    # Qwen2.5-VL: RMSNorm, SwiGLU with biases, window attention except `fullatt_block_indexes`.
    QWEN2_5_VL: dataclasses.replace(_QWEN2, norm="rmsnorm", mlp="swiglu", windows=True),
    # Qwen3-VL / Qwen3.5: Qwen2-VL's layout plus a patch-embedding bias and a learned table resampled
    # bilinearly (align_corners=True); Qwen3-VL also taps blocks into deepstack mergers.
    QWEN3_VL: dataclasses.replace(_QWEN3, deepstack=True),
    QWEN3_5: _QWEN3,
    # PaddleOCR-VL: Qwen3.5's layout with 2-D patches, align_corners=False, a post-layernorm, a
    # merger norm with eps 1e-5, rows in raster order, images only.
    PADDLEOCR_VL: dataclasses.replace(
        _QWEN3, pos_embed="bilinear", post_norm=True, merger_norm_eps=1e-5, raster_rows=True, images_only=True
    ),
    # GLM-4.1V / 4.5V: RMSNorm / SwiGLU blocks without biases, full attention, an RMSNorm after the
    # patch embedding, a bicubic table, a post-norm and its own merger.
    GLM4V: Tower("rmsnorm", "swiglu", False, True, True, "glm", "bicubic", True, None, False, False),
}


# ---- HF config.json -> VisionConfig fields ------------------------------------------------------
def hf_vision_fields(d: dict[str, Any]) -> dict[str, Any]:
    """VisionConfig keyword arguments from an HF config dict (full VL model, Omni thinker, or
    vision-only; the hub's 4.4x layout or transformers 5.x's). Missing fields take HF's defaults
    for the variant. KeyError / TypeError / ValueError for what cannot be read."""
    top_type = d.get("model_type", "")
    if "thinker_config" in d:  # Omni: the tower lives in the thinker (thinker_config.vision_config)
        d = d["thinker_config"]
        if not isinstance(d, dict):
            raise TypeError("thinker_config is not an object")
        top_type = top_type or d.get("model_type", "")
    family = _top_family(top_type)
    if top_type and family is None and _family_of_vision_type(top_type) is None:
        raise ValueError(
            f"model_type {top_type!r} is not a vision-language model whose tower this package builds "
            f"(supported model_type: {', '.join(FAMILIES)})"
        )
    if "vision_config" in d:
        v = d["vision_config"]
        if not isinstance(v, dict):
            raise TypeError("vision_config is not an object")
        inner = _family_of_vision_type(v.get("model_type", ""))
        if family is None:
            family = _family_of_vision(v)
        elif inner is not None and FAMILIES[inner] != FAMILIES[family]:
            raise ValueError(
                f"model_type {top_type!r} ({FAMILIES[family]}) disagrees with vision_config "
                f"model_type {v['model_type']!r} ({FAMILIES[inner]})"
            )
        elif inner is None and v.get("model_type") and FAMILIES[family] in QWEN3_FAMILY:
            raise ValueError(
                f"model_type {top_type!r} ({FAMILIES[family]}) disagrees with vision_config "
                f"model_type {v['model_type']!r}"
            )
    else:
        v = d
        family = _family_of_vision(v)
    variant = FAMILIES[family]

    def get(*names, default=None):
        for n in names:
            if n in v and v[n] is not None:
                return v[n]
        if default is None:
            raise KeyError(f"missing field {names[0]!r}")
        return default

    rope = v.get("rope_parameters") or v.get("rope_scaling") or {}
    q3 = variant in QWEN3_FAMILY  # PaddleOCR-VL's and GLM's patch size defaults to 14, as Qwen2's
    common = dict(
        variant=variant,
        family=family,
        depth=int(get("depth", "num_hidden_layers", default=27 if q3 else 32)),
        num_heads=int(get("num_heads", "num_attention_heads", default=16)),
        patch_size=_square_patch(get("patch_size", "spatial_patch_size", default=16 if q3 else 14), "patch_size"),
        temporal_patch_size=_square_patch(get("temporal_patch_size", default=2), "temporal_patch_size"),
        in_channels=int(get("in_channels", "in_chans", default=3)),
        spatial_merge_size=int(get("spatial_merge_size", default=2)),
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
        **TOWERS[variant].features(),
    )
    if variant in QWEN3_FAMILY:
        return _qwen3_fields(variant, v, get, common)
    if variant == PADDLEOCR_VL:
        return _paddleocr_fields(d, v, get, common)
    if variant == GLM4V:
        return _glm4v_fields(v, get, common)
    # Qwen2.5-Omni's defaults are Qwen2.5-VL's (HF's default width 3584 is not a released tower's
    # 1280: the presets carry the released sizes).
    if variant == QWEN2_VL:
        width = int(get("embed_dim", default=1280))
        return dict(
            common,
            width=width,
            intermediate_size=int(width * get("mlp_ratio", default=4)),
            out_dim=int(get("hidden_size", default=3584)),
            hidden_act=str(get("hidden_act", default="quick_gelu")),
        )
    return dict(
        common,
        width=int(get("hidden_size", default=3584)),
        intermediate_size=int(get("intermediate_size", default=3420)),
        out_dim=int(get("out_hidden_size", default=3584)),
        hidden_act=str(get("hidden_act", default="silu")),
        window_size=int(get("window_size", default=112)),
        fullatt_block_indexes=tuple(get("fullatt_block_indexes", default=(7, 15, 23, 31))),
    )


def _qwen3_fields(variant: str, v: dict[str, Any], get, common: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-VL / Qwen3.5 vision fields (HF defaults: Qwen3VLVisionConfig / Qwen3_5VisionConfig)."""
    for name in ("window_size", "fullatt_block_indexes"):
        if v.get(name):
            raise ValueError(f"{variant} has no window attention, but the config sets {name}={v[name]!r}")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"{variant} vision rotary must be rope_type 'axial', got {rope['rope_type']!r}")
    ds = v.get("deepstack_visual_indexes")
    if variant == QWEN3_VL:
        ds = (8, 16, 24) if ds is None else ds
    elif ds:  # the hub's Qwen3.5 files carry an empty list; a non-empty one is not a Qwen3.5 tower
        raise ValueError(f"Qwen3.5 has no deepstack mergers, but deepstack_visual_indexes is {ds!r}")
    if not isinstance(ds or [], (list, tuple)) or not all(type(i) is int for i in ds or []):
        raise ValueError(f"deepstack_visual_indexes must be a list of ints, got {ds!r}")
    return dict(
        common,
        width=int(get("hidden_size", default=1152)),
        intermediate_size=int(get("intermediate_size", default=4304)),
        out_dim=int(get("out_hidden_size", default=3584)),
        hidden_act=str(get("hidden_act", default="gelu_pytorch_tanh")),
        num_position_embeddings=int(get("num_position_embeddings", default=2304)),
        deepstack_layers=tuple(ds or ()),
    )


def _paddleocr_fields(d: dict[str, Any], v: dict[str, Any], get, common: dict[str, Any]) -> dict[str, Any]:
    """PaddleOCR-VL (HF defaults: PaddleOCRVisionConfig). The merger (HF's projector, `mlp_AR`)
    outputs the text model's width: `text_config.hidden_size` (5.x) or the top-level `hidden_size`
    (the hub's flat layout). The table has (image_size / patch_size)^2 rows."""
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    if text is v or "hidden_size" not in text:
        raise KeyError("missing field 'hidden_size' of the text model (the projector's output width)")
    side = int(get("image_size", default=384)) // common["patch_size"]
    return dict(
        common,
        temporal_patch_size=1,
        depth=int(get("num_hidden_layers", "depth", default=27)),
        in_channels=int(get("num_channels", "in_channels", default=3)),
        width=int(get("hidden_size", default=1152)),
        intermediate_size=int(get("intermediate_size", default=4304)),
        out_dim=int(text["hidden_size"]),
        hidden_act=str(get("hidden_act", default="gelu_pytorch_tanh")),
        num_position_embeddings=side * side,
        norm_eps=float(get("layer_norm_eps", default=1e-6)),
    )


def _glm4v_fields(v: dict[str, Any], get, common: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.1V / 4.5V (HF defaults: Glm4vVisionConfig). HF's `out_hidden_size` is the block MLP's
    width and the tower's output, its `intermediate_size` the merger's SwiGLU width; the table has
    (image_size / patch_size)^2 rows."""
    side = int(_square_patch(get("image_size", default=336), "image_size")) // common["patch_size"]
    out = int(get("out_hidden_size", default=4096))
    return dict(
        common,
        depth=int(get("depth", "num_hidden_layers", default=24)),
        num_heads=int(get("num_heads", default=12)),
        width=int(get("hidden_size", default=1536)),
        intermediate_size=out,
        out_dim=out,
        merger_intermediate_size=int(get("intermediate_size", default=13696)),
        hidden_act=str(get("hidden_act", default="silu")),
        num_position_embeddings=side * side,
        norm_eps=float(get("rms_norm_eps", default=1e-5)),
        qkv_bias=bool(v.get("attention_bias", False)),
    )


def _square_patch(p, name: str) -> int:
    """HF 5.x allows `patch_size` as an int or an [a, a] pair; a non-square pair is not supported."""
    if isinstance(p, (list, tuple)):
        if len(p) != 2 or p[0] != p[1]:
            raise ValueError(f"{name} {p!r}: only a square patch (one int or [a, a]) is supported")
        p = p[0]
    if not isinstance(p, int) or isinstance(p, bool):
        raise ValueError(f"{name} must be an int, got {p!r}")
    return p


def _top_family(top_type: str) -> str | None:
    """The family of a top-level model_type ("qwen3_vl", an Omni thinker's
    "qwen3_omni_moe_thinker", ...), or None for an unknown or missing one."""
    if top_type.endswith("_thinker"):
        top_type = top_type[: -len("_thinker")]
    return top_type if top_type in FAMILIES else None


def _family_of_vision_type(mt: str) -> str | None:
    """The family a vision model_type names ("qwen3_vl_vision", the hub's "qwen3_vl",
    "qwen3_omni_moe_vision_encoder", Qwen4-Exp's old "qwen4_exp", ...), or None. The longest
    family name wins: "qwen3_vl_moe_vision" is Qwen3-VL-MoE, not Qwen3-VL."""
    return next((f for f in sorted(FAMILIES, key=len, reverse=True) if mt.startswith(f)), None)


def _family_of_vision(v: dict[str, Any]) -> str:
    """The family of a vision config without a known top-level model_type: its own model_type, else
    the fields only one variant has."""
    mt = v.get("model_type", "")
    if (family := _family_of_vision_type(mt)) is not None:
        return family
    if "num_position_embeddings" in v:  # no model_type: only deepstack layers tell the two apart
        if v.get("deepstack_visual_indexes"):
            return QWEN3_VL
        raise ValueError("cannot tell Qwen3-VL from Qwen3.5 without model_type (no deepstack_visual_indexes)")
    if any(k in v for k in ("out_hidden_size", "fullatt_block_indexes", "window_size", "intermediate_size")):
        return QWEN2_5_VL
    if any(k in v for k in ("embed_dim", "mlp_ratio")):
        return QWEN2_VL
    raise ValueError(f"cannot tell Qwen2-VL from Qwen2.5-VL (model_type={mt!r}, keys={sorted(v)})")
