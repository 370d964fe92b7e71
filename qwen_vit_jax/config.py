"""VisionConfig: one frozen, keyword-only config for the Qwen vision towers, as data.

Sizes (depth, width, heads, ...) and the tower's features (its norm, MLP, merger, position table,
...) are fields: the model, the planner and the cost model read fields, never the variant string.
A feature left unset (None) takes its variant's value from `families.TOWERS`; the presets
(presets.py) and `from_hf` set every one. `variant` still names the tower for what is keyed on a
checkpoint's layout: the converter's key rules, HF's processor defaults, the reference model.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import ml_dtypes
import numpy as np

from qwen_vit_jax import families
from qwen_vit_jax.families import DTYPE_NAMES, FAMILIES, FEATURES, TOWERS, VARIANTS
from qwen_vit_jax.files import load_json_object

# The dtypes the tower computes in and stores weights in, by name: the one table of the package
# (jnp accepts these numpy dtypes as they are).
DTYPES = dict(zip(DTYPE_NAMES, (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))))


def dtype_named(name: str) -> np.dtype:
    """DTYPES[name]; a ValueError naming the choices for any other name."""
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {name!r}")
    return DTYPES[name]


# Activations the vision MLP may use (HF ACT2FN names). The merger GELU is always exact erf.
ACTIVATIONS = ("quick_gelu", "silu", "gelu", "gelu_pytorch_tanh", "gelu_new")
_CHOICES = {
    "norm": ("rmsnorm", "layernorm"),
    "mlp": ("swiglu", "mlp"),
    "merger": ("mlp", "glm"),
    "pos_embed": ("", "bilinear-corners", "bilinear", "bicubic"),
}
_POS_TAPS = {"": 0, "bilinear-corners": 4, "bilinear": 4, "bicubic": 16}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VisionConfig:
    """Hyper-parameters of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 / PaddleOCR-VL / GLM-4V vision tower.

    The towers (families.TOWERS has each one's features):
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
    window_size: int = 0  # pixels; 0 = no window attention
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    num_position_embeddings: int = 0  # rows of the learned position table; 0 = none
    deepstack_layers: tuple[int, ...] = ()  # blocks whose output feeds a deepstack merger (Qwen3-VL)
    family: str = ""  # HF model family (a FAMILIES key); "" = the variant's own (e.g. "qwen3_vl")
    qkv_bias: bool = True  # GLM: HF's attention_bias (False for the released GLM-4.1V tower)
    merger_intermediate_size: int = 0  # the GLM merger's SwiGLU width (HF's intermediate_size); 0 = none
    # ---- features (None: the variant's, families.TOWERS) ----
    norm: str | None = None  # "rmsnorm" (scale only) or "layernorm" (scale + bias)
    mlp: str | None = None  # "swiglu" (gate / up / down) or "mlp" (fc1 -> act -> fc2)
    block_bias: bool | None = None  # biases on the blocks' attention projection and MLP
    patch_norm: bool | None = None  # an RMSNorm right after the patch embedding
    patch_embed_bias: bool | None = None  # a bias on the patch embedding
    merger: str | None = None  # "mlp" or "glm" (see GlmMerger)
    pos_embed: str | None = None  # the table's resampling: "", "bilinear-corners", "bilinear", "bicubic"
    post_norm: bool | None = None  # a norm after the last block
    merger_norm_eps: float | None = None  # the merger norm's eps (None: norm_eps)
    raster_rows: bool | None = None  # pixel rows in raster order per frame (Plan.take reorders them)
    images_only: bool | None = None  # every grid row must have t = 1

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"invalid VisionConfig: {msg}")

        if self.variant not in VARIANTS:
            bad(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        tower = TOWERS[self.variant]
        if self.family == self.variant:  # one spelling per tower: equal configs compare equal
            object.__setattr__(self, "family", "")
        if self.family and FAMILIES.get(self.family) != self.variant:
            bad(
                f"family {self.family!r} does not carry a {self.variant} tower "
                f"(known: {', '.join(f'{f} -> {v}' for f, v in FAMILIES.items())})"
            )
        for name in FEATURES:  # merger_norm_eps may stay None: norm_eps
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(tower, name))
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                bad(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("block_bias", "patch_norm", "patch_embed_bias", "post_norm", "raster_rows", "images_only"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be a bool, got {getattr(self, name)!r}")
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
        if (self.merger == "glm") != (isinstance(mi, int) and not isinstance(mi, bool) and mi > 0):
            bad(f"merger_intermediate_size must be a positive int for GLM's merger and 0 otherwise, got {mi!r}")
        if self.merger == "glm" and self.intermediate_size != self.out_dim:
            sizes = f"intermediate_size {self.intermediate_size} != out_dim {self.out_dim}"
            bad(f"GLM's block MLP width is its output width: {sizes}")
        if not self.qkv_bias and self.block_bias:
            bad(f"{self.variant} always has a qkv bias (qkv_bias=False is GLM's)")
        if self.images_only and self.temporal_patch_size != 1:
            bad(f"{self.variant} has no temporal patch (temporal_patch_size must be 1), got {self.temporal_patch_size}")
        if (self.window_size or self.fullatt_block_indexes) and not tower.windows:
            bad(f"{self.variant} has no window attention (window_size / fullatt_block_indexes must be unset)")
        if self.deepstack_layers and not tower.deepstack:
            bad(f"{self.variant} has no deepstack mergers, got deepstack_layers {self.deepstack_layers}")
        if self.pos_embed:
            if n_pos <= 0 or math.isqrt(n_pos) ** 2 != n_pos:
                bad(f"num_position_embeddings {n_pos} must be a positive square (a side x side table)")
        elif n_pos:
            bad(f"{self.variant} has no learned position table (num_position_embeddings must be unset)")
        ds = self.deepstack_layers
        if any(not 0 <= i < self.depth for i in ds):
            bad(f"deepstack_layers {ds} out of range for depth {self.depth}")
        if any(a >= b for a, b in zip(ds, ds[1:])):
            # HF appends deepstack features in block order but picks merger k for the k-th list
            # entry: only an increasing list makes both orders agree.
            bad(f"deepstack_layers {ds} must be strictly increasing")
        if tower.windows:
            unit = self.patch_size * self.spatial_merge_size
            if self.window_size <= 0 or self.window_size % unit:
                bad(
                    f"window_size {self.window_size} must be a positive multiple of "
                    f"patch_size * spatial_merge_size = {unit}"
                )

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
        return self.window_size > 0 and len(self.fullatt_block_indexes) < self.depth

    @property
    def window_merge(self) -> int:
        """Window side in merge units (4 for window_size 112, patch 14, merge 2)."""
        return self.window_size // self.patch_size // self.spatial_merge_size if self.window_size else 0

    @property
    def window_patches(self) -> int:
        """Most patches one window holds (64 for the real towers)."""
        return (self.window_merge * self.spatial_merge_size) ** 2

    @property
    def pos_embed_taps(self) -> int:
        """Table rows per patch in the resampling: 16 (bicubic), 4 (bilinear), 0 (no table)."""
        return _POS_TAPS[self.pos_embed]

    @property
    def pos_embed_align_corners(self) -> bool:
        """How the table is resampled: align_corners=True (Qwen3) or False (PaddleOCR-VL, GLM)."""
        return self.pos_embed == "bilinear-corners"

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
        """The inverse of `to_dict`. A dict without the feature fields (written before they were
        fields) gets its variant's."""
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
        defaults for that variant, as HF would. A model_type of another architecture (a Llama,
        a CLIP), a top-level and a vision `model_type` that name different variants, or a Qwen3.5
        config with deepstack layers raise ValueError.
        """
        d, where = load_json_object(path_or_dict, "config.json", "HF config")
        try:
            return cls(**families.hf_vision_fields(d))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: cannot read a Qwen vision config: {e}") from None


def parse_sizes(text: str, flag: str) -> tuple[tuple[int, int, int], ...]:
    """ "16x16,2x36x36" -> ((1, 16, 16), (2, 36, 36)): HxW (an image) or TxHxW (a video), in patches,
    as a command-line flag (`flag`, named in the ValueError) gives them."""
    sizes = []
    for item in text.split(","):
        try:
            dims = [int(v) for v in item.strip().lower().split("x")]
        except ValueError:
            dims = []
        if len(dims) not in (2, 3) or min(dims) <= 0:
            raise ValueError(f"{flag}: {item.strip()!r} is not HxW or TxHxW in patches (e.g. 16x16, 2x36x36)")
        sizes.append(tuple(dims) if len(dims) == 3 else (1, *dims))
    return tuple(sizes)
