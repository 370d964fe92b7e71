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

from qwen_vit_jax.config import QWEN2_5_VL, QWEN3_5, QWEN3_FAMILY, QWEN3_VL, VisionConfig


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
_ARCHITECTURES = {
    QWEN2_5_VL: ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    QWEN3_VL: ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    QWEN3_5: ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
}
_QWEN2_VL_ARCH = ("qwen2_vl", "Qwen2VLForConditionalGeneration")


def text_config(cfg: VisionConfig) -> dict:
    """The tiny text model that goes with a vision tower of `cfg`'s variant."""
    return {QWEN3_VL: TEXT_CONFIG_QWEN3, QWEN3_5: TEXT_CONFIG_QWEN3_5}.get(cfg.variant, TEXT_CONFIG)


def hf_vision_config(cfg: VisionConfig) -> dict:
    """`cfg` as the `vision_config` dict of its HF variant (the naming trap: config.py)."""
    top, _ = _ARCHITECTURES.get(cfg.variant, _QWEN2_VL_ARCH)
    common = {
        "model_type": f"{top}_vision",
        "depth": cfg.depth,
        "num_heads": cfg.num_heads,
        "hidden_act": cfg.hidden_act,
        "patch_size": cfg.patch_size,
        "temporal_patch_size": cfg.temporal_patch_size,
        "in_channels": cfg.in_channels,
        "spatial_merge_size": cfg.spatial_merge_size,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "axial"},
    }
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
    """The transformers 5.x `config.json` of a full VL model whose vision tower is `cfg` (with
    `text_config(cfg)` as its text model)."""
    top, arch = _ARCHITECTURES.get(cfg.variant, _QWEN2_VL_ARCH)
    return {
        "architectures": [arch],
        "model_type": top,
        "dtype": dtype,
        "text_config": dict(text_config(cfg), model_type=f"{top}_text"),
        "vision_config": hf_vision_config(cfg),
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
    }


# ---- HF models (torch) ------------------------------------------------------------------------------
def _hf_classes(variant: str):
    """(full VL config class, vision config class, vision tower class, full model class) of a variant."""
    if variant == QWEN3_VL:
        from transformers.models.qwen3_vl import modeling_qwen3_vl as hf

        return hf.Qwen3VLConfig, hf.Qwen3VLVisionConfig, hf.Qwen3VLVisionModel, hf.Qwen3VLForConditionalGeneration
    if variant == QWEN3_5:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

        return hf.Qwen3_5Config, hf.Qwen3_5VisionConfig, hf.Qwen3_5VisionModel, hf.Qwen3_5ForConditionalGeneration
    if variant == QWEN2_5_VL:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

        return (
            hf.Qwen2_5_VLConfig,
            hf.Qwen2_5_VLVisionConfig,
            hf.Qwen2_5_VisionTransformerPretrainedModel,
            hf.Qwen2_5_VLForConditionalGeneration,
        )
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    return (
        hf.Qwen2VLConfig,
        hf.Qwen2VLVisionConfig,
        hf.Qwen2VisionTransformerPretrainedModel,
        hf.Qwen2VLForConditionalGeneration,
    )


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

    full_cls, _, _, model_cls = _hf_classes(cfg.variant)
    hf_cfg = full_cls(text_config=dict(text_config(cfg)), vision_config=hf_vision_config(cfg))
    torch.manual_seed(seed)
    model = model_cls(hf_cfg).eval()
    reinit_(model.model.visual, seed)
    return model


def hf_visual(model, pixel_values, grid_thw) -> np.ndarray:
    """`visual(pixel_values, grid_thw=...)` of a full HF model or of a vision tower: the merged
    tokens (`pooler_output`), float32 numpy [T, out_dim]."""
    import torch

    visual = model.model.visual if hasattr(model, "model") else model
    with torch.no_grad():
        out = visual(
            torch.from_numpy(np.asarray(pixel_values, np.float32)),
            grid_thw=torch.from_numpy(np.asarray(grid_thw, np.int64)),
        )
    return getattr(out, "pooler_output", out).float().numpy()  # transformers 4.x returns the tensor


def load_hf_vision_tower(hf_dir: str | pathlib.Path):
    """HF's own vision tower for the checkpoint `hf_dir`, float32, eval mode, with its vision weights
    loaded strictly (every key, every shape). Only the vision tensors are read (with safetensors'
    own torch reader, independent of ours): a 7B checkpoint's language model is never loaded."""
    from safetensors import safe_open

    from qwen_vit_jax.convert import locate_tensors, vision_prefix

    hf_dir = pathlib.Path(hf_dir)
    full_cls, vision_cls, tower_cls, _ = _hf_classes(VisionConfig.from_hf(hf_dir).variant)
    raw = json.loads((hf_dir / "config.json").read_text())
    if "vision_config" in raw:  # a full VL config, hub (4.4x) or 5.x layout: HF's own class reads both
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
