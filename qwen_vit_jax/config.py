"""VisionConfig: one frozen, keyword-only config for both Qwen vision towers.

HF's two variants name the same things differently (the naming trap):
  Qwen2-VL   : `embed_dim` = ViT width, `hidden_size` = merger output, MLP = embed_dim * mlp_ratio
  Qwen2.5-VL : `hidden_size` = ViT width, `out_hidden_size` = merger output, `intermediate_size`
Ours is unambiguous: `width` is the ViT width, `out_dim` the merger output.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import ml_dtypes
import numpy as np

QWEN2_VL = "qwen2_vl"
QWEN2_5_VL = "qwen2_5_vl"
VARIANTS = (QWEN2_VL, QWEN2_5_VL)

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
    """Hyper-parameters of a Qwen2-VL / Qwen2.5-VL vision tower.

    Qwen2-VL: LayerNorm (with bias), fc1 -> act -> fc2 MLP, full attention in every block.
    Qwen2.5-VL: RMSNorm, SwiGLU MLP with biases, window attention except `fullatt_block_indexes`.
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

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"invalid VisionConfig: {msg}")

        if self.variant not in VARIANTS:
            bad(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        for name in ("depth", "width", "num_heads", "intermediate_size", "out_dim", "patch_size",
                     "temporal_patch_size", "in_channels", "spatial_merge_size"):
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
        if self.variant == QWEN2_5_VL:
            unit = self.patch_size * self.spatial_merge_size
            if self.window_size <= 0 or self.window_size % unit:
                bad(f"window_size {self.window_size} must be a positive multiple of "
                    f"patch_size * spatial_merge_size = {unit}")
        elif self.window_size or self.fullatt_block_indexes:
            bad("Qwen2-VL has no window attention (window_size / fullatt_block_indexes must be unset)")

    # ---- derived sizes -------------------------------------------------------------------
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
    def full_attention_layers(self) -> tuple[bool, ...]:
        """Per block: True = full (per-frame) attention, False = window attention."""
        if not self.windowed:
            return (True,) * self.depth
        return tuple(i in self.fullatt_block_indexes for i in range(self.depth))

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fullatt_block_indexes"] = list(self.fullatt_block_indexes)
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
        `hidden_act`) and the transformers 5.x `save_pretrained` layout are understood. Missing
        fields take HF's own defaults for that variant, as HF would.
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
    if "vision_config" in d:
        v = d["vision_config"]
        if not isinstance(v, dict):
            raise TypeError("vision_config is not an object")
        variant = {"qwen2_vl": QWEN2_VL, "qwen2_5_vl": QWEN2_5_VL}.get(top_type)
        if variant is None:
            variant = _variant_of_vision(v)
    else:
        v = d
        variant = _variant_of_vision(v)

    def get(*names, default=None):
        for n in names:
            if n in v and v[n] is not None:
                return v[n]
        if default is None:
            raise KeyError(f"missing field {names[0]!r}")
        return default

    rope = v.get("rope_parameters") or v.get("rope_scaling") or {}
    common = dict(
        depth=int(get("depth", "num_hidden_layers", default=32)),
        num_heads=int(get("num_heads", "num_attention_heads", default=16)),
        patch_size=int(get("patch_size", "spatial_patch_size", default=14)),
        temporal_patch_size=int(get("temporal_patch_size", default=2)),
        in_channels=int(get("in_channels", "in_chans", default=3)),
        spatial_merge_size=int(get("spatial_merge_size", default=2)),
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
    )
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


def _variant_of_vision(v: dict[str, Any]) -> str:
    mt = v.get("model_type", "")
    if mt.startswith("qwen2_5_vl"):
        return QWEN2_5_VL
    if mt.startswith("qwen2_vl"):
        return QWEN2_VL
    if any(k in v for k in ("out_hidden_size", "fullatt_block_indexes", "window_size", "intermediate_size")):
        return QWEN2_5_VL
    if any(k in v for k in ("embed_dim", "mlp_ratio")):
        return QWEN2_VL
    raise ValueError(f"cannot tell Qwen2-VL from Qwen2.5-VL (model_type={mt!r}, keys={sorted(v)})")


# ---- presets (vision towers of the released checkpoints) ---------------------------------
QWEN2_VL_2B = VisionConfig(
    variant=QWEN2_VL, depth=32, width=1280, num_heads=16, intermediate_size=5120, out_dim=1536,
    hidden_act="quick_gelu",
)
QWEN2_VL_7B = dataclasses.replace(QWEN2_VL_2B, out_dim=3584)
QWEN2_5_VL_3B = VisionConfig(
    variant=QWEN2_5_VL, depth=32, width=1280, num_heads=16, intermediate_size=3420, out_dim=2048,
    hidden_act="silu", window_size=112, fullatt_block_indexes=(7, 15, 23, 31),
)
QWEN2_5_VL_7B = dataclasses.replace(QWEN2_5_VL_3B, out_dim=3584)

PRESETS = {
    "qwen2-vl-2b": QWEN2_VL_2B,
    "qwen2-vl-7b": QWEN2_VL_7B,
    "qwen2.5-vl-3b": QWEN2_5_VL_3B,
    "qwen2.5-vl-7b": QWEN2_5_VL_7B,
}
