"""HF reference models for the tests: built from configs with random weights, saved in the
real checkpoint layout by `save_pretrained` (no hub access anywhere)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from qwen_vit_jax.config import QWEN2_5_VL, QWEN3_5, QWEN3_FAMILY, QWEN3_VL, VisionConfig

TINY_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
    vocab_size=128, bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
)
# Qwen3 text configs default head_dim to 128: pin it to hidden / heads so mrope_section (8) fits.
TINY_TEXT_QWEN3 = dict(TINY_TEXT, head_dim=16)
# Qwen3.5's text model is hybrid (Gated DeltaNet + attention): one full-attention layer keeps it tiny.
TINY_TEXT_QWEN3_5 = dict(TINY_TEXT_QWEN3, layer_types=["full_attention"], linear_num_key_heads=1,
                         linear_num_value_heads=1, linear_key_head_dim=8, linear_value_head_dim=8)


def hf_vision_config(cfg: VisionConfig) -> dict:
    """Our VisionConfig as the HF vision_config dict of its variant."""
    common = dict(
        depth=cfg.depth, num_heads=cfg.num_heads, patch_size=cfg.patch_size, in_channels=cfg.in_channels,
        temporal_patch_size=cfg.temporal_patch_size, spatial_merge_size=cfg.spatial_merge_size,
        hidden_act=cfg.hidden_act,
    )
    if cfg.variant in QWEN3_FAMILY:
        d = dict(common, hidden_size=cfg.width, intermediate_size=cfg.intermediate_size, out_hidden_size=cfg.out_dim,
                 num_position_embeddings=cfg.num_position_embeddings)
        if cfg.variant == QWEN3_VL:
            d["deepstack_visual_indexes"] = list(cfg.deepstack_layers)
        return d
    if cfg.variant == QWEN2_5_VL:
        return dict(
            common, hidden_size=cfg.width, intermediate_size=cfg.intermediate_size, out_hidden_size=cfg.out_dim,
            window_size=cfg.window_size, fullatt_block_indexes=list(cfg.fullatt_block_indexes),
        )
    assert cfg.intermediate_size % cfg.width == 0
    return dict(common, embed_dim=cfg.width, mlp_ratio=cfg.intermediate_size // cfg.width, hidden_size=cfg.out_dim)


def reinit_(module: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter so that no bias is 0 and no norm weight is 1:
    matrices N(0, 1/fan_in), biases 0.02 N(0, 1), norm weights 1 + 0.1 N(0, 1)."""
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
    """A full HF VL model (tiny text part) whose vision tower matches `cfg`, re-initialised."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    text = TINY_TEXT
    if cfg.variant == QWEN2_5_VL:
        conf, cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    elif cfg.variant == QWEN3_VL:
        conf, cls, text = Qwen3VLConfig, Qwen3VLForConditionalGeneration, TINY_TEXT_QWEN3
    elif cfg.variant == QWEN3_5:
        conf, cls, text = Qwen3_5Config, Qwen3_5ForConditionalGeneration, TINY_TEXT_QWEN3_5
    else:
        conf, cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    hf_cfg = conf(text_config=dict(text), vision_config=hf_vision_config(cfg))
    torch.manual_seed(seed)
    model = cls(hf_cfg).eval()
    reinit_(model.model.visual, seed)
    return model


def hf_visual(model, pixel_values: np.ndarray, grid_thw: np.ndarray) -> np.ndarray:
    """HF's `visual(...).pooler_output`, float32 numpy."""
    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(np.asarray(pixel_values, np.float32)),
                                 grid_thw=torch.from_numpy(np.asarray(grid_thw, np.int64)))
    return out.pooler_output.float().numpy()


def random_pixels(cfg: VisionConfig, grid_thw, seed: int = 0) -> np.ndarray:
    n = int(np.prod(np.asarray(grid_thw), axis=1).sum())
    return np.random.default_rng(seed).standard_normal((n, cfg.patch_dim), dtype=np.float32)


def tiny(variant_cfg: VisionConfig, **kw) -> VisionConfig:
    return dataclasses.replace(variant_cfg, **kw)


def assert_fp32_close(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """docs/numerics.md float32 bar: relative Frobenius <= 1e-5 and max abs <= 1e-4 * max|ref|."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert np.isfinite(ours).all()
    rel = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    max_abs = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    assert rel <= 1e-5 and max_abs <= 1e-4 * scale, f"rel {rel:.3g}, max abs {max_abs:.3g} (max|ref| {scale:.3g})"
    return rel, max_abs / scale


def assert_bf16_close(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """docs/numerics.md bfloat16 bar: per-token cosine >= 0.999 and relative error <= 2e-2."""
    assert ours.shape == ref.shape
    cos = (ours * ref).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(ref, axis=-1))
    rel = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    assert cos.min() >= 0.999 and rel <= 2e-2, f"min cos {cos.min():.5f}, rel {rel:.3g}"
    return float(cos.min()), rel
