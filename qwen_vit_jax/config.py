"""VisionConfig: one frozen, keyword-only config for the Qwen vision towers.

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
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import ml_dtypes
import numpy as np

QWEN2_VL = "qwen2_vl"
QWEN2_5_VL = "qwen2_5_vl"
QWEN3_VL = "qwen3_vl"
QWEN3_5 = "qwen3_5"
PADDLEOCR_VL = "paddleocr_vl"
GLM4V = "glm4v"
VARIANTS = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_5, PADDLEOCR_VL, GLM4V)
QWEN3_FAMILY = (QWEN3_VL, QWEN3_5)  # learned position table, patch-embed bias, LayerNorm, gelu MLP
# Towers with a learned square position table resampled to each grid (a host plan: posembed.py).
TABLE_VARIANTS = (QWEN3_VL, QWEN3_5, PADDLEOCR_VL, GLM4V)

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

# The dtypes the tower computes in and stores weights in, by name: the one table of the package
# (jnp accepts these numpy dtypes as they are).
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def dtype_named(name: str) -> np.dtype:
    """DTYPES[name]; a ValueError naming the choices for any other name."""
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {name!r}")
    return DTYPES[name]


# Activations the vision MLP may use (HF ACT2FN names). The merger GELU is always exact erf.
ACTIVATIONS = ("quick_gelu", "silu", "gelu", "gelu_pytorch_tanh", "gelu_new")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VisionConfig:
    """Hyper-parameters of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 / PaddleOCR-VL / GLM-4V vision tower.

    Qwen2-VL: LayerNorm (with bias), fc1 -> act -> fc2 MLP, full attention in every block.
    Qwen2.5-VL: RMSNorm, SwiGLU MLP with biases, window attention except `fullatt_block_indexes`.
    Qwen3-VL / Qwen3.5: as Qwen2-VL (LayerNorm, fc1 -> act -> fc2, full attention), plus a bias on
      the patch embedding and a learned `num_position_embeddings` table (a square side x side grid)
      resampled bilinearly to each image's grid and added after the patch embedding. Qwen3-VL also
      taps the hidden states after each block in `deepstack_layers` into its own merger.
    PaddleOCR-VL (images only): Qwen3.5's layout with temporal patch 1 (rows of C x p x p), the
      table resampled with align_corners=False, a LayerNorm after the last block, a merger norm
      with eps 1e-5, and pixel rows that arrive in raster order (the plan reorders them into
      merge units on the host: docs/family.md).
    GLM-4.1V / 4.5V: Qwen2.5-VL's RMSNorm / SwiGLU blocks without MLP or projection biases (qkv
      bias per `qkv_bias`) and full attention, an RMSNorm after the patch embedding, a table
      resampled bicubically (16 taps, align_corners=False), a post-norm, and its own merger
      (GlmMerger: a 2 x 2 conv downsample, then proj -> LayerNorm -> GELU -> SwiGLU of width
      `merger_intermediate_size`). HF's `out_hidden_size` is both the block MLP width and the output.
    """

    variant: str
    depth: int
    width: int  # ViT hidden width (HF: Qwen2-VL embed_dim, Qwen2.5-VL hidden_size)
    num_heads: int
    intermediate_size: int  # MLP hidden width
    out_dim: int  # merger output (HF: Qwen2-VL hidden_size, Qwen2.5-VL out_hidden_size)
    hidden_act: str
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 0  # pixels; 0 = no window attention (Qwen2-VL)
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    num_position_embeddings: int = 0  # rows of the learned position table; 0 = none (Qwen2 family)
    deepstack_layers: tuple[int, ...] = ()  # Qwen3-VL: blocks whose output feeds a deepstack merger
    family: str = ""  # HF model family (a FAMILIES key); "" = the variant's own (e.g. "qwen3_vl")
    qkv_bias: bool = True  # GLM: HF's attention_bias (False for the released GLM-4.1V tower)
    merger_intermediate_size: int = 0  # GLM: the merger's SwiGLU width (HF's intermediate_size); 0 = none

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"invalid VisionConfig: {msg}")

        if self.variant not in VARIANTS:
            bad(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.family == self.variant:  # one spelling per tower: equal configs compare equal
            object.__setattr__(self, "family", "")
        if self.family and FAMILIES.get(self.family) != self.variant:
            bad(
                f"family {self.family!r} does not carry a {self.variant} tower "
                f"(known: {', '.join(f'{f} -> {v}' for f, v in FAMILIES.items())})"
            )
        for name in (
            "depth",
            "width",
            "num_heads",
            "intermediate_size",
            "out_dim",
            "patch_size",
            "temporal_patch_size",
            "in_channels",
            "spatial_merge_size",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{name} must be a positive int, got {v!r}")
        if self.hidden_act not in ACTIVATIONS:
            bad(f"hidden_act {self.hidden_act!r} is not supported (known: {ACTIVATIONS})")
        if self.width % self.num_heads:
            bad(f"width {self.width} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            bad(f"head_dim {self.head_dim} must be divisible by 4 (2-D rotary over h and w)")
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            bad(f"fullatt_block_indexes {self.fullatt_block_indexes} out of range for depth {self.depth}")
        object.__setattr__(self, "deepstack_layers", tuple(int(i) for i in self.deepstack_layers))
        n_pos = self.num_position_embeddings
        if not isinstance(n_pos, int) or isinstance(n_pos, bool) or n_pos < 0:
            bad(f"num_position_embeddings must be a non-negative int, got {n_pos!r}")
        mi = self.merger_intermediate_size
        if (self.variant == GLM4V) != (isinstance(mi, int) and not isinstance(mi, bool) and mi > 0):
            bad(f"merger_intermediate_size must be a positive int for GLM and 0 otherwise, got {mi!r}")
        if self.variant == GLM4V and self.intermediate_size != self.out_dim:
            sizes = f"intermediate_size {self.intermediate_size} != out_dim {self.out_dim}"
            bad(f"GLM's block MLP width is its output width: {sizes}")
        if not self.qkv_bias and self.variant != GLM4V:
            bad(f"{self.variant} always has a qkv bias (qkv_bias=False is GLM's)")
        if self.variant == PADDLEOCR_VL and self.temporal_patch_size != 1:
            bad(f"PaddleOCR-VL has no temporal patch (temporal_patch_size must be 1), got {self.temporal_patch_size}")
        if self.variant in TABLE_VARIANTS:
            if n_pos <= 0 or math.isqrt(n_pos) ** 2 != n_pos:
                bad(f"num_position_embeddings {n_pos} must be a positive square (a side x side table)")
            if self.window_size or self.fullatt_block_indexes:
                bad(f"{self.variant} has no window attention (window_size / fullatt_block_indexes must be unset)")
            ds = self.deepstack_layers
            if self.variant != QWEN3_VL and ds:
                bad(f"{self.variant} has no deepstack mergers, got deepstack_layers {ds}")
            if any(not 0 <= i < self.depth for i in ds):
                bad(f"deepstack_layers {ds} out of range for depth {self.depth}")
            if any(a >= b for a, b in zip(ds, ds[1:])):
                # HF appends deepstack features in block order but picks merger k for the k-th list
                # entry: only an increasing list makes both orders agree.
                bad(f"deepstack_layers {ds} must be strictly increasing")
            return
        if n_pos or self.deepstack_layers:
            bad(
                f"{self.variant} has no learned position table or deepstack mergers "
                f"(num_position_embeddings / deepstack_layers must be unset)"
            )
        if self.variant == QWEN2_5_VL:
            unit = self.patch_size * self.spatial_merge_size
            if self.window_size <= 0 or self.window_size % unit:
                bad(
                    f"window_size {self.window_size} must be a positive multiple of "
                    f"patch_size * spatial_merge_size = {unit}"
                )
        elif self.window_size or self.fullatt_block_indexes:
            bad("Qwen2-VL has no window attention (window_size / fullatt_block_indexes must be unset)")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def hf_family(self) -> str:
        """The HF model family (top-level model_type) the tower comes from: `family` or the variant."""
        return self.family or self.variant

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one pixel_values row: (C, T, ph, pw) flattened, 1176 for the real towers."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output token (4)."""
        return self.spatial_merge_size**2

    @property
    def windowed(self) -> bool:
        """True if some blocks use window attention (Qwen2.5-VL)."""
        return self.variant == QWEN2_5_VL and len(self.fullatt_block_indexes) < self.depth

    @property
    def window_merge(self) -> int:
        """Window side in merge units (4 for window_size 112, patch 14, merge 2)."""
        return self.window_size // self.patch_size // self.spatial_merge_size if self.window_size else 0

    @property
    def window_patches(self) -> int:
        """Most patches one window holds (64 for the real towers)."""
        return (self.window_merge * self.spatial_merge_size) ** 2

    @property
    def norm(self) -> str:
        """Block / merger norm: "rmsnorm" (Qwen2.5-VL, GLM; no bias) or "layernorm" (with bias)."""
        return "rmsnorm" if self.variant in (QWEN2_5_VL, GLM4V) else "layernorm"

    @property
    def mlp(self) -> str:
        """Block MLP: "swiglu" (Qwen2.5-VL, GLM: gate / up / down) or "mlp" (fc1 -> act -> fc2)."""
        return "swiglu" if self.variant in (QWEN2_5_VL, GLM4V) else "mlp"

    @property
    def block_bias(self) -> bool:
        """Whether the blocks' attention projection and MLP have biases (all but GLM)."""
        return self.variant != GLM4V

    @property
    def patch_norm(self) -> bool:
        """An RMSNorm right after the patch embedding, before the position table (GLM)."""
        return self.variant == GLM4V

    @property
    def merger(self) -> str:
        """ "glm" (downsample conv + proj -> LayerNorm -> GELU -> SwiGLU) or "mlp" (the others)."""
        return "glm" if self.variant == GLM4V else "mlp"

    @property
    def pos_embed_taps(self) -> int:
        """Table rows per patch in the resampling: 16 (bicubic: GLM) or 4 (bilinear)."""
        return 16 if self.variant == GLM4V else 4

    @property
    def patch_embed_bias(self) -> bool:
        """Whether the patch embedding (a Conv3d / Conv2d in HF) has a bias: the table towers."""
        return self.variant in TABLE_VARIANTS

    @property
    def pos_embed_align_corners(self) -> bool:
        """How the table is resampled: align_corners=True (Qwen3) or False (PaddleOCR-VL, GLM)."""
        return self.variant in QWEN3_FAMILY

    @property
    def post_norm(self) -> bool:
        """A norm after the last block (PaddleOCR-VL's post_layernorm, GLM's RMSNorm)."""
        return self.variant in (PADDLEOCR_VL, GLM4V)

    @property
    def merger_norm_eps(self) -> float:
        """The merger's norm eps: PaddleOCR-VL's projector hard-codes 1e-5, the others use norm_eps."""
        return 1e-5 if self.variant == PADDLEOCR_VL else self.norm_eps

    @property
    def raster_rows(self) -> bool:
        """True when pixel_values rows arrive in raster order per frame (PaddleOCR-VL's processor)
        rather than in merge units; the plan then takes them in merge-unit order (Plan.take)."""
        return self.variant == PADDLEOCR_VL

    @property
    def images_only(self) -> bool:
        """True for towers that take images only (PaddleOCR-VL): every grid row must have t = 1."""
        return self.variant == PADDLEOCR_VL

    @property
    def pos_embed_side(self) -> int:
        """Side of the learned square position table (48 for 2304 rows); 0 when there is none."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def num_deepstack(self) -> int:
        """Deepstack mergers (3 for the released Qwen3-VL towers, 0 otherwise)."""
        return len(self.deepstack_layers)

    @property
    def full_attention_layers(self) -> tuple[bool, ...]:
        """Per block: True = full (per-frame) attention, False = window attention."""
        if not self.windowed:
            return (True,) * self.depth
        return tuple(i in self.fullatt_block_indexes for i in range(self.depth))

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fullatt_block_indexes"] = list(self.fullatt_block_indexes)
        d["deepstack_layers"] = list(self.deepstack_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown VisionConfig fields: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> VisionConfig:
        """Build from an HF config: a full VL `config.json` (with `vision_config`) or a vision-only one.

        Accepts a dict, a path to a config.json, or a checkpoint directory holding one. Both the
        hub layout (transformers 4.4x: `in_chans`, no vision `model_type`, Qwen2-VL without
        `hidden_act`; Qwen3-VL's hub files say vision `model_type` "qwen3_vl") and the
        transformers 5.x `save_pretrained` layout (vision `model_type` "qwen3_vl_vision",
        "qwen3_5_vision", `rope_parameters`) are understood. Missing fields take HF's own
        defaults for that variant, as HF would. A top-level and a vision `model_type` that name
        different Qwen3 variants, or a Qwen3.5 config with deepstack layers, raise ValueError.
        """
        d, where = load_json_object(path_or_dict, "config.json", "HF config")
        try:
            return _from_hf_dict(d)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: cannot read a Qwen vision config: {e}") from None


def load_json_object(path_or_dict, filename: str, what: str) -> tuple[dict[str, Any], str]:
    """(the JSON object, where it came from) from a dict, a JSON file, or a directory holding
    `filename`. FileNotFoundError for a missing file, ValueError for bad JSON or a non-object."""
    if isinstance(path_or_dict, dict):
        return path_or_dict, f"{what} dict"
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, filename)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {what} at {path}")
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d, path


def _from_hf_dict(d: dict[str, Any]) -> VisionConfig:
    top_type = d.get("model_type", "")
    if "thinker_config" in d:  # Omni: the tower lives in the thinker (thinker_config.vision_config)
        d = d["thinker_config"]
        if not isinstance(d, dict):
            raise TypeError("thinker_config is not an object")
        top_type = top_type or d.get("model_type", "")
    family = _top_family(top_type)
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
    q3 = variant in QWEN3_FAMILY
    if variant in (PADDLEOCR_VL, GLM4V):
        q3 = False  # their patch size defaults to 14, as Qwen2's
    common = dict(
        depth=int(get("depth", "num_hidden_layers", default=27 if q3 else 32)),
        num_heads=int(get("num_heads", "num_attention_heads", default=16)),
        patch_size=_square_patch(get("patch_size", "spatial_patch_size", default=16 if q3 else 14), "patch_size"),
        temporal_patch_size=_square_patch(get("temporal_patch_size", default=2), "temporal_patch_size"),
        in_channels=int(get("in_channels", "in_chans", default=3)),
        spatial_merge_size=int(get("spatial_merge_size", default=2)),
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
        family=family,
    )
    if variant in QWEN3_FAMILY:
        return _qwen3_from_hf(variant, v, get, common)
    if variant == PADDLEOCR_VL:
        return _paddleocr_from_hf(d, v, get, common)
    if variant == GLM4V:
        return _glm4v_from_hf(v, get, common)
    # Qwen2.5-Omni's defaults are Qwen2.5-VL's (HF's default width 3584 is not a released tower's
    # 1280: the presets carry the released sizes).
    if variant == QWEN2_VL:
        width = int(get("embed_dim", default=1280))
        return VisionConfig(
            variant=QWEN2_VL,
            width=width,
            intermediate_size=int(width * get("mlp_ratio", default=4)),
            out_dim=int(get("hidden_size", default=3584)),
            hidden_act=str(get("hidden_act", default="quick_gelu")),
            **common,
        )
    return VisionConfig(
        variant=QWEN2_5_VL,
        width=int(get("hidden_size", default=3584)),
        intermediate_size=int(get("intermediate_size", default=3420)),
        out_dim=int(get("out_hidden_size", default=3584)),
        hidden_act=str(get("hidden_act", default="silu")),
        window_size=int(get("window_size", default=112)),
        fullatt_block_indexes=tuple(get("fullatt_block_indexes", default=(7, 15, 23, 31))),
        **common,
    )


def _qwen3_from_hf(variant: str, v: dict[str, Any], get, common: dict[str, Any]) -> VisionConfig:
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
    return VisionConfig(
        variant=variant,
        width=int(get("hidden_size", default=1152)),
        intermediate_size=int(get("intermediate_size", default=4304)),
        out_dim=int(get("out_hidden_size", default=3584)),
        hidden_act=str(get("hidden_act", default="gelu_pytorch_tanh")),
        num_position_embeddings=int(get("num_position_embeddings", default=2304)),
        deepstack_layers=tuple(ds or ()),
        **common,
    )


def _paddleocr_from_hf(d: dict[str, Any], v: dict[str, Any], get, common: dict[str, Any]) -> VisionConfig:
    """PaddleOCR-VL (HF defaults: PaddleOCRVisionConfig). The merger (HF's projector, `mlp_AR`)
    outputs the text model's width: `text_config.hidden_size` (5.x) or the top-level `hidden_size`
    (the hub's flat layout). The table has (image_size / patch_size)^2 rows."""
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    if text is v or "hidden_size" not in text:
        raise KeyError("missing field 'hidden_size' of the text model (the projector's output width)")
    side = int(get("image_size", default=384)) // common["patch_size"]
    common = dict(
        common,
        temporal_patch_size=1,
        depth=int(get("num_hidden_layers", "depth", default=27)),
        in_channels=int(get("num_channels", "in_channels", default=3)),
    )
    return VisionConfig(
        variant=PADDLEOCR_VL,
        width=int(get("hidden_size", default=1152)),
        intermediate_size=int(get("intermediate_size", default=4304)),
        out_dim=int(text["hidden_size"]),
        hidden_act=str(get("hidden_act", default="gelu_pytorch_tanh")),
        num_position_embeddings=side * side,
        norm_eps=float(get("layer_norm_eps", default=1e-6)),
        **common,
    )


def _glm4v_from_hf(v: dict[str, Any], get, common: dict[str, Any]) -> VisionConfig:
    """GLM-4.1V / 4.5V (HF defaults: Glm4vVisionConfig). HF's `out_hidden_size` is the block MLP's
    width and the tower's output, its `intermediate_size` the merger's SwiGLU width; the table has
    (image_size / patch_size)^2 rows."""
    side = int(_square_patch(get("image_size", default=336), "image_size")) // common["patch_size"]
    out = int(get("out_hidden_size", default=4096))
    common = dict(
        common, depth=int(get("depth", "num_hidden_layers", default=24)), num_heads=int(get("num_heads", default=12))
    )
    return VisionConfig(
        variant=GLM4V,
        width=int(get("hidden_size", default=1536)),
        intermediate_size=out,
        out_dim=out,
        merger_intermediate_size=int(get("intermediate_size", default=13696)),
        hidden_act=str(get("hidden_act", default="silu")),
        num_position_embeddings=side * side,
        norm_eps=float(get("rms_norm_eps", default=1e-5)),
        qkv_bias=bool(v.get("attention_bias", False)),
        **common,
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


# ---- presets (vision towers of the released checkpoints) ---------------------------------
QWEN2_VL_2B = VisionConfig(
    variant=QWEN2_VL,
    depth=32,
    width=1280,
    num_heads=16,
    intermediate_size=5120,
    out_dim=1536,
    hidden_act="quick_gelu",
)
QWEN2_VL_7B = dataclasses.replace(QWEN2_VL_2B, out_dim=3584)
QWEN2_5_VL_3B = VisionConfig(
    variant=QWEN2_5_VL,
    depth=32,
    width=1280,
    num_heads=16,
    intermediate_size=3420,
    out_dim=2048,
    hidden_act="silu",
    window_size=112,
    fullatt_block_indexes=(7, 15, 23, 31),
)
QWEN2_5_VL_7B = dataclasses.replace(QWEN2_5_VL_3B, out_dim=3584)

# Qwen3-VL / Qwen3.5: HF's defaults are the large tower (depth 27, width 1152); the 2B / 4B
# Qwen3-VL models use a smaller one. out_dim is the language model's hidden size.
QWEN3_VL_8B = VisionConfig(
    variant=QWEN3_VL,
    depth=27,
    width=1152,
    num_heads=16,
    intermediate_size=4304,
    out_dim=4096,
    hidden_act="gelu_pytorch_tanh",
    patch_size=16,
    num_position_embeddings=2304,
    deepstack_layers=(8, 16, 24),
)
QWEN3_VL_32B = dataclasses.replace(QWEN3_VL_8B, out_dim=5120)
QWEN3_VL_4B = dataclasses.replace(
    QWEN3_VL_8B, depth=24, width=1024, intermediate_size=4096, out_dim=2560, deepstack_layers=(5, 11, 17)
)
QWEN3_VL_2B = dataclasses.replace(QWEN3_VL_4B, out_dim=2048)
QWEN3_5_27B = dataclasses.replace(QWEN3_VL_8B, variant=QWEN3_5, out_dim=5120, deepstack_layers=())
QWEN3_5_397B_A17B = dataclasses.replace(QWEN3_5_27B, out_dim=4096, family="qwen3_5_moe")

# The rest of the family: the same towers under other model families (config.py FAMILIES). out_dim
# is the language model's hidden size; the tower sizes are the released checkpoints' vision_config.
QWEN3_VL_30B_A3B = dataclasses.replace(QWEN3_VL_8B, out_dim=2048, family="qwen3_vl_moe")
QWEN3_VL_235B_A22B = dataclasses.replace(QWEN3_VL_8B, out_dim=4096, family="qwen3_vl_moe")
QWEN3_5_35B_A3B = dataclasses.replace(QWEN3_5_27B, out_dim=2048, family="qwen3_5_moe")
QWEN4_EXP = dataclasses.replace(QWEN3_5_27B, out_dim=2560, family="qwen4_exp")
QWEN3_OMNI_30B_A3B = dataclasses.replace(QWEN3_VL_8B, out_dim=2048, family="qwen3_omni_moe")
QWEN2_5_OMNI_7B = dataclasses.replace(QWEN2_5_VL_7B, family="qwen2_5_omni")
QWEN2_5_OMNI_3B = dataclasses.replace(QWEN2_5_VL_3B, family="qwen2_5_omni")
# PaddleOCR-VL (0.9B): a 27 x 1152 tower (head_dim 72), 384 / 14 = 27 -> a 27 x 27 table, out the
# ERNIE-4.5-0.3B language model's 1024.
PADDLEOCR_VL_0_9B = VisionConfig(
    variant=PADDLEOCR_VL,
    depth=27,
    width=1152,
    num_heads=16,
    intermediate_size=4304,
    out_dim=1024,
    hidden_act="gelu_pytorch_tanh",
    temporal_patch_size=1,
    num_position_embeddings=729,
)
# GLM-4.1V-9B: HF's Glm4vVisionConfig defaults are the released tower (24 x 1536, 12 heads, a 24 x 24
# table from image_size 336 / patch 14, block MLP = out 4096, merger SwiGLU 13696). GLM-4.5V's tower
# has the same shape with out_hidden_size 4096 (its language model's width).
GLM_4_1V_9B = VisionConfig(
    variant=GLM4V,
    depth=24,
    width=1536,
    num_heads=12,
    intermediate_size=4096,
    out_dim=4096,
    merger_intermediate_size=13696,
    hidden_act="silu",
    norm_eps=1e-5,
    num_position_embeddings=576,
    qkv_bias=False,
)
GLM_4_5V = dataclasses.replace(GLM_4_1V_9B, family="glm4v_moe")

PRESETS = {
    "qwen2-vl-2b": QWEN2_VL_2B,
    "qwen2-vl-7b": QWEN2_VL_7B,
    "qwen2.5-vl-3b": QWEN2_5_VL_3B,
    "qwen2.5-vl-7b": QWEN2_5_VL_7B,
    "qwen3-vl-2b": QWEN3_VL_2B,
    "qwen3-vl-4b": QWEN3_VL_4B,
    "qwen3-vl-8b": QWEN3_VL_8B,
    "qwen3-vl-32b": QWEN3_VL_32B,
    "qwen3.5-27b": QWEN3_5_27B,
    "qwen3.5-397b-a17b": QWEN3_5_397B_A17B,
    "qwen3-vl-30b-a3b": QWEN3_VL_30B_A3B,
    "qwen3-vl-235b-a22b": QWEN3_VL_235B_A22B,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
    "qwen4-exp": QWEN4_EXP,
    "qwen3-omni-30b-a3b": QWEN3_OMNI_30B_A3B,
    "qwen2.5-omni-7b": QWEN2_5_OMNI_7B,
    "qwen2.5-omni-3b": QWEN2_5_OMNI_3B,
    "paddleocr-vl": PADDLEOCR_VL_0_9B,
    "glm-4.1v-9b": GLM_4_1V_9B,
    "glm-4.5v": GLM_4_5V,
}
