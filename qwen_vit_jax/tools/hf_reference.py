"""HF transformers as the reference: its config layout, its models, and the parity bars.

Everything the project knows about HF's side lives here, for `qwen-vit-jax verify`, the tests and
the benchmarks:

  * the HF config layout of a `VisionConfig` (`hf_vision_config`, `hf_config`): plain dicts,
    no torch; the demo writes them as config.json;
  * the parity bars of docs/numerics.md (`FLOAT32`, `BFLOAT16`, `TOLERANCES`) and how an output
    is measured against them (`compare`, `Tolerance.passes`), defined once;
  * HF models: a re-initialised random model of a config (`build_hf_model`, `reinit_`), HF's own
    vision tower loaded from a checkpoint (`load_hf_vision_tower`), its forward (`hf_visual`).

torch and transformers are imported inside the functions that need them: importing this module
costs neither (runtime code never needs them).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.families import GLM4V, OMNI, PADDLEOCR_VL, QWEN2_5_VL, QWEN3_FAMILY, QWEN3_VL


# ---- the parity bars (docs/numerics.md, "Tolerances") ---------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Tolerance:
    """A bar an output [T, D] must meet against HF float32; a None field is not checked."""

    rel: float  # relative Frobenius error ||ours - ref|| / ||ref||
    max_abs: float | None = None  # max |ours - ref| / max |ref|
    min_cos: float | None = None  # cosine similarity of every row (token) with its reference

    def passes(self, m: dict[str, float]) -> bool:
        """Whether the measures of `compare` meet this bar."""
        return (
            m["rel"] <= self.rel
            and (self.max_abs is None or m["max_rel"] <= self.max_abs)
            and (self.min_cos is None or m["min_cos"] >= self.min_cos)
        )

    def describe(self) -> str:
        parts = [f"rel err <= {self.rel:g}"]
        if self.max_abs is not None:
            parts.append(f"max abs <= {self.max_abs:g} * max|ref|")
        if self.min_cos is not None:
            parts.insert(0, f"min cos >= {self.min_cos:g}")
        return " and ".join(parts)


FLOAT32 = Tolerance(rel=1e-5, max_abs=1e-4)
BFLOAT16 = Tolerance(rel=2e-2, min_cos=0.999)
TOLERANCES = {"float32": FLOAT32, "bfloat16": BFLOAT16}  # by compute dtype, always vs HF float32


def compare(ours, ref) -> dict[str, float]:
    """Error measures of `ours` [..., D] against `ref` [..., D] (computed in float64): max_abs,
    max_rel (max_abs / max|ref|), rel (relative Frobenius) and min_cos (least cosine similarity of
    a row with its reference row)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if ours.shape != ref.shape:
        raise ValueError(f"compare: shapes differ, ours {ours.shape} vs reference {ref.shape}")
    diff = ours - ref
    norms = np.linalg.norm(ours, axis=-1) * np.linalg.norm(ref, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):  # a zero row: cos 1 if equal, else 0
        cos = np.where(norms > 0, (ours * ref).sum(-1) / norms, np.abs(diff).max(-1) == 0)
    return {
        "max_abs": float(np.abs(diff).max()),
        "max_rel": float(np.abs(diff).max() / np.abs(ref).max()),
        "rel": float(np.linalg.norm(diff) / np.linalg.norm(ref)),
        "min_cos": float(cos.min()),
    }


# ---- HF's config layout (no torch) ---------------------------------------------------------------
# A minimal text model: HF's VL config classes need one, and with it HF's from_pretrained can
# build the full VL model from a checkpoint directory (its text weights then start random).
TEXT_CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
}
# Qwen3 text configs default head_dim to 128: pin it to hidden / heads so mrope_section (8) fits.
TEXT_CONFIG_QWEN3 = dict(TEXT_CONFIG, head_dim=16)
# Qwen3.5's text model is hybrid (Gated DeltaNet + attention): one full-attention layer keeps it tiny.
TEXT_CONFIG_QWEN3_5 = dict(
    TEXT_CONFIG_QWEN3,
    layer_types=["full_attention"],
    linear_num_key_heads=1,
    linear_num_value_heads=1,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
# The MoE text models: the smallest expert layout HF accepts.
_MOE_FIELDS = dict(moe_intermediate_size=16, num_experts=2, num_experts_per_tok=1)
# Qwen4-Exp's text model: one linear-attention layer (its indexed-attention layers need the QSA
# indexer's sizes) with a small shared expert.
TEXT_CONFIG_QWEN4_EXP = dict(
    TEXT_CONFIG_QWEN3_5, **_MOE_FIELDS, layer_types=["linear_attention"], shared_expert_intermediate_size=16
)
# The Omni thinkers' audio encoder (the vision tower ignores it, but a thinker always builds one).
AUDIO_CONFIG = dict(
    num_mel_bins=8,
    encoder_layers=1,
    encoder_attention_heads=2,
    encoder_ffn_dim=16,
    d_model=8,
    output_dim=32,
    downsample_hidden_size=8,
)
# family -> (HF module, full model class, its config class, vision config class, vision tower class)
_HF_CLASSES = {
    "qwen2_vl": (
        "qwen2_vl",
        "Qwen2VLForConditionalGeneration",
        "Qwen2VLConfig",
        "Qwen2VLVisionConfig",
        "Qwen2VisionTransformerPretrainedModel",
    ),
    "qwen2_5_vl": (
        "qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLVisionConfig",
        "Qwen2_5_VisionTransformerPretrainedModel",
    ),
    "qwen3_vl": (
        "qwen3_vl",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLConfig",
        "Qwen3VLVisionConfig",
        "Qwen3VLVisionModel",
    ),
    "qwen3_5": (
        "qwen3_5",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5Config",
        "Qwen3_5VisionConfig",
        "Qwen3_5VisionModel",
    ),
    "qwen3_vl_moe": (
        "qwen3_vl_moe",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3VLMoeConfig",
        "Qwen3VLMoeVisionConfig",
        "Qwen3VLMoeVisionModel",
    ),
    "qwen3_5_moe": (
        "qwen3_5_moe",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeVisionConfig",
        "Qwen3_5MoeVisionModel",
    ),
    "qwen4_exp": (
        "qwen4_exp",
        "Qwen4ExpForConditionalGeneration",
        "Qwen4ExpConfig",
        "Qwen4ExpVisionConfig",
        "Qwen4ExpVisionModel",
    ),
    "qwen3_omni_moe": (
        "qwen3_omni_moe",
        "Qwen3OmniMoeForConditionalGeneration",
        "Qwen3OmniMoeConfig",
        "Qwen3OmniMoeVisionEncoderConfig",
        "Qwen3OmniMoeVisionEncoder",
    ),
    "qwen2_5_omni": (
        "qwen2_5_omni",
        "Qwen2_5OmniForConditionalGeneration",
        "Qwen2_5OmniConfig",
        "Qwen2_5OmniVisionEncoderConfig",
        "Qwen2_5OmniVisionEncoder",
    ),
    "paddleocr_vl": (
        "paddleocr_vl",
        "PaddleOCRVLForConditionalGeneration",
        "PaddleOCRVLConfig",
        "PaddleOCRVisionConfig",
        "PaddleOCRVisionModel",
    ),
    "glm4v": ("glm4v", "Glm4vForConditionalGeneration", "Glm4vConfig", "Glm4vVisionConfig", "Glm4vVisionModel"),
    "glm4v_moe": (
        "glm4v_moe",
        "Glm4vMoeForConditionalGeneration",
        "Glm4vMoeConfig",
        "Glm4vMoeVisionConfig",
        "Glm4vMoeVisionModel",
    ),
}
# GLM's text models: rotary over half the head (mrope_section sums to head_dim / 4).
TEXT_CONFIG_GLM4V = dict(
    TEXT_CONFIG_QWEN3,
    rope_parameters={
        "rope_type": "default",
        "mrope_section": [1, 1, 2],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
)
_GLM_MOE_FIELDS = dict(
    moe_intermediate_size=16, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1, first_k_dense_replace=1
)


def text_config(cfg: VisionConfig) -> dict:
    """The tiny text model that goes with a vision tower of `cfg`'s family."""
    return {
        "qwen3_vl": TEXT_CONFIG_QWEN3,
        "qwen3_5": TEXT_CONFIG_QWEN3_5,
        "qwen3_vl_moe": dict(TEXT_CONFIG_QWEN3, **_MOE_FIELDS),
        "qwen3_5_moe": dict(TEXT_CONFIG_QWEN3_5, **_MOE_FIELDS),
        "qwen4_exp": TEXT_CONFIG_QWEN4_EXP,
        "qwen3_omni_moe": dict(TEXT_CONFIG_QWEN3, **_MOE_FIELDS),
        # PaddleOCR-VL's merger (HF's projector) outputs the text model's width
        "paddleocr_vl": dict(TEXT_CONFIG_QWEN3, hidden_size=cfg.out_dim),
        "glm4v": TEXT_CONFIG_GLM4V,
        "glm4v_moe": dict(TEXT_CONFIG_GLM4V, **_GLM_MOE_FIELDS),
    }.get(cfg.hf_family, TEXT_CONFIG)


def _vision_model_type(cfg: VisionConfig) -> str:
    """HF's vision model_type of `cfg`'s family ("qwen3_vl_vision", "qwen3_omni_moe_vision_encoder")."""
    return f"{cfg.hf_family}_vision" + ("_encoder" if cfg.hf_family in OMNI else "")


def hf_vision_config(cfg: VisionConfig) -> dict:
    """`cfg` as the `vision_config` dict of its HF family (the naming trap: families.py)."""
    common = {
        "model_type": _vision_model_type(cfg),
        "depth": cfg.depth,
        "num_heads": cfg.num_heads,
        "hidden_act": cfg.hidden_act,
        "patch_size": cfg.patch_size,
        "temporal_patch_size": cfg.temporal_patch_size,
        "in_channels": cfg.in_channels,
        "spatial_merge_size": cfg.spatial_merge_size,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "axial"},
    }
    if cfg.variant == PADDLEOCR_VL:  # SigLIP names; the table's side from image_size / patch_size
        return {
            "model_type": common["model_type"],
            "hidden_size": cfg.width,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.depth,
            "num_attention_heads": cfg.num_heads,
            "num_channels": cfg.in_channels,
            "image_size": cfg.pos_embed_side * cfg.patch_size,
            "patch_size": cfg.patch_size,
            "hidden_act": cfg.hidden_act,
            "layer_norm_eps": cfg.norm_eps,
            "spatial_merge_size": cfg.spatial_merge_size,
            "rope_parameters": common["rope_parameters"],
        }
    if cfg.variant == GLM4V:  # HF's out_hidden_size is the block MLP width too; intermediate_size the merger's
        return dict(
            common,
            hidden_size=cfg.width,
            out_hidden_size=cfg.out_dim,
            intermediate_size=cfg.merger_intermediate_size,
            image_size=cfg.pos_embed_side * cfg.patch_size,
            rms_norm_eps=cfg.norm_eps,
            attention_bias=cfg.qkv_bias,
        )
    if cfg.variant in QWEN3_FAMILY:
        vision = dict(
            common,
            hidden_size=cfg.width,
            out_hidden_size=cfg.out_dim,
            intermediate_size=cfg.intermediate_size,
            num_position_embeddings=cfg.num_position_embeddings,
        )
        if cfg.variant == QWEN3_VL:
            vision["deepstack_visual_indexes"] = list(cfg.deepstack_layers)
        return vision
    if cfg.variant == QWEN2_5_VL:
        return dict(
            common,
            hidden_size=cfg.width,
            out_hidden_size=cfg.out_dim,
            intermediate_size=cfg.intermediate_size,
            window_size=cfg.window_size,
            fullatt_block_indexes=list(cfg.fullatt_block_indexes),
        )
    if cfg.intermediate_size % cfg.width:
        raise ValueError(
            f"Qwen2-VL stores the MLP width as embed_dim * mlp_ratio: intermediate_size "
            f"{cfg.intermediate_size} is not a multiple of width {cfg.width}"
        )
    return dict(common, embed_dim=cfg.width, hidden_size=cfg.out_dim, mlp_ratio=cfg.intermediate_size // cfg.width)


def hf_config(cfg: VisionConfig, dtype: str = "float32") -> dict:
    """The transformers 5.x `config.json` of a full model of `cfg`'s family whose vision tower is `cfg`
    (with `text_config(cfg)` as its text model; the Omni models nest both in `thinker_config`, with
    a tiny audio encoder and no talker)."""
    module, arch, *_ = _HF_CLASSES[cfg.hf_family]
    text = dict(text_config(cfg), model_type=f"{module}_text")
    if cfg.hf_family in OMNI:
        del text["model_type"]  # the thinker's own text config class reads it
        thinker = {
            "model_type": f"{module}_thinker",
            "text_config": text,
            "vision_config": hf_vision_config(cfg),
            "audio_config": AUDIO_CONFIG,
        }
        return {
            "architectures": [arch],
            "model_type": module,
            "dtype": dtype,
            "thinker_config": thinker,
            "enable_audio_output": False,
        }
    return {
        "architectures": [arch],
        "model_type": module,
        "dtype": dtype,
        "text_config": text,
        "vision_config": hf_vision_config(cfg),
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
    }


# ---- HF models (torch) ------------------------------------------------------------------------------
def _hf_classes(family: str):
    """(full config class, vision config class, vision tower class, full model class) of a family."""
    import importlib

    module, arch, config_cls, vision_cfg_cls, tower_cls = _HF_CLASSES[family]
    hf = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    conf = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    return getattr(conf, config_cls), getattr(conf, vision_cfg_cls), getattr(hf, tower_cls), getattr(hf, arch)


def hf_tower(model):
    """The vision tower (`visual`) of a full HF model (an Omni model's: in its thinker), or `model`
    itself when it is a tower."""
    if hasattr(model, "thinker"):
        model = model.thinker
    if hasattr(model, "visual"):  # a thinker (its `model` is the text model up to transformers 5.17)
        return model.visual
    inner = getattr(model, "model", None)
    return inner.visual if hasattr(inner, "visual") else model


def reinit_(module, seed: int) -> None:
    """Re-initialise every parameter of a torch module the docs/numerics.md way, so that no bias is
    0 and no norm weight is 1: matrices N(0, 1/fan_in), biases 0.02 N(0, 1), norm weights
    1 + 0.1 N(0, 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.ndim >= 2:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(noise / fan_in**0.5)
            elif "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.02 * noise)


def build_hf_model(cfg: VisionConfig, seed: int = 0):
    """A full HF VL model (a tiny text part: `text_config`) whose vision tower matches `cfg`,
    float32, eval mode, its vision tower re-initialised (`reinit_`). `save_pretrained` writes it in
    the real checkpoint layout."""
    import torch

    full_cls, _, _, model_cls = _hf_classes(cfg.hf_family)
    if cfg.hf_family in OMNI:
        hf_cfg = full_cls(thinker_config=hf_config(cfg)["thinker_config"], enable_audio_output=False)
    else:
        hf_cfg = full_cls(text_config=dict(text_config(cfg)), vision_config=hf_vision_config(cfg))
    torch.manual_seed(seed)
    model = model_cls(hf_cfg).eval()
    reinit_(hf_tower(model), seed)
    if cfg.variant == PADDLEOCR_VL:  # our merger is HF's projector, beside the tower
        reinit_(model.model.projector, seed + 1)
        # transformers before 5.23 resampled the position table with align_corners=True; 5.23 changed
        # it to False, the resampling we follow: an older reference is set as 5.23 builds it.
        for m in model.modules():
            if getattr(m, "interpolation_align_corners", False):
                m.interpolation_align_corners = False
    return model


def hf_visual(model, pixel_values, grid_thw) -> np.ndarray:
    """`visual(pixel_values, grid_thw=...)` of a full HF model or of a vision tower: the merged
    tokens (`pooler_output`), float32 numpy [T, out_dim]. GLM's tower is fed per-frame grids (each
    [t, h, w] row as t rows [1, h, w]), as its get_video_features does: its position code indexes
    grid rows by frame."""
    import torch

    visual = hf_tower(model)
    grid = np.asarray(grid_thw, np.int64)
    if visual.config.model_type.startswith("glm4v"):
        grid = np.repeat(np.concatenate([np.ones_like(grid[:, :1]), grid[:, 1:]], 1), grid[:, 0], axis=0)  # [F, 3]
    with torch.no_grad():
        out = visual(torch.from_numpy(np.asarray(pixel_values, np.float32)), grid_thw=torch.from_numpy(grid))
    return getattr(out, "pooler_output", out).float().numpy()  # transformers 4.x returns the tensor


def hf_image_features(model, pixel_values, grid_thw) -> np.ndarray:
    """The contract for the whole family: HF's `get_image_features(pixel_values, grid_thw)` of a full
    model (the Omni ones: of its thinker), i.e. what the language model receives, the per-image
    pieces concatenated in order; float32 numpy [T, out_dim]."""
    import torch

    owner = model.thinker if hasattr(model, "thinker") else model
    px = torch.from_numpy(np.asarray(pixel_values, np.float32))
    if owner.config.model_type == "paddleocr_vl":  # HF takes [N, C, p, p]; ours are rows [N, C * p * p]
        v = owner.config.vision_config
        px = px.reshape(len(px), v.num_channels, v.patch_size, v.patch_size)
    with torch.no_grad():
        out = owner.get_image_features(px, torch.from_numpy(np.asarray(grid_thw, np.int64)))
    return torch.cat(list(out.pooler_output)).float().numpy()


def load_hf_vision_tower(hf_dir: str | pathlib.Path):
    """HF's own vision tower for the checkpoint `hf_dir`, float32, eval mode, with its vision weights
    loaded strictly (every key, every shape). Only the vision tensors are read (with safetensors'
    own torch reader, independent of ours): a 7B checkpoint's language model is never loaded."""
    from safetensors import safe_open

    from qwen_vit_jax.weights.hf_read import locate_tensors, vision_prefix

    hf_dir = pathlib.Path(hf_dir)
    cfg = VisionConfig.from_hf(hf_dir)
    if cfg.variant == PADDLEOCR_VL:
        raise ValueError(
            f"{hf_dir}: PaddleOCR-VL's merger is HF's projector, outside its vision tower: HF's tower "
            "alone is not what encode returns (compare with hf_image_features of the full model)"
        )
    full_cls, vision_cls, tower_cls, _ = _hf_classes(cfg.hf_family)
    raw = json.loads((hf_dir / "config.json").read_text())
    if "thinker_config" in raw:  # an Omni model: the tower's config sits in the thinker's
        config = full_cls.from_pretrained(hf_dir).thinker_config.vision_config
    elif "vision_config" in raw:  # a full VL config, hub (4.4x) or 5.x layout: HF's own class reads both
        config = full_cls.from_pretrained(hf_dir).vision_config
    else:
        config = vision_cls.from_dict(raw)
    model = tower_cls._from_config(config).float().eval()

    where, _ = locate_tensors(hf_dir)
    prefix = vision_prefix(where, hf_dir)
    state = {}
    for path in sorted({p for k, p in where.items() if k.startswith(prefix)}):
        with safe_open(path, framework="pt") as f:
            names = [k for k in f.keys() if k.startswith(prefix)]  # noqa: SIM118 (safe_open: no __iter__)
            state.update({k[len(prefix) :]: f.get_tensor(k) for k in names})
    model.load_state_dict(state, strict=True)
    return model


# ---- `qwen-vit-jax verify` ------------------------------------------------------------------------
VERIFY_CASES = (  # (description, grid_thw): windows that divide evenly, edge windows, a video
    ("image 16x16", [[1, 16, 16]]),
    ("images 10x14 + 4x6 (edge windows)", [[1, 10, 14], [1, 4, 6]]),
    ("video 3x12x20", [[3, 12, 20]]),
)


def verify_cases(hf, encoders: dict, cfg: VisionConfig, seed: int = 0):
    """HF's tower `hf` vs each of our `encoders` ({dtype: VisionEncoder}) on random pixels for
    VERIFY_CASES: all cases in one call on each side (one compiled program per dtype; a mixed batch
    also exercises packing), then compared case by case. Yields (dtype, case, tokens, `compare`'s
    metrics, whether they pass TOLERANCES[dtype])."""
    grids = [np.asarray(g, np.int64) for _, g in VERIFY_CASES]
    grid = np.concatenate(grids)
    rows = int(np.prod(grid, axis=1).sum())
    pixels = np.random.default_rng(seed).standard_normal((rows, cfg.patch_dim), dtype=np.float32)
    ref = hf_visual(hf, pixels, grid)
    cuts = np.cumsum([int(np.prod(g, axis=1).sum()) // cfg.merge_unit for g in grids])[:-1]
    for dtype, enc in encoders.items():
        cases = zip(VERIFY_CASES, np.split(enc.encode(pixels, grid), cuts), np.split(ref, cuts))
        for (name, _), ours, expected in cases:
            m = compare(ours, expected)
            yield dtype, name, len(expected), m, TOLERANCES[dtype].passes(m)
