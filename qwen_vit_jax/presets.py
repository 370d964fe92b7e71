"""The vision towers of the released checkpoints, by name (`PRESETS`): every size and feature
field set, as `VisionConfig.from_hf` reads them from the hub's config.json files."""

from __future__ import annotations

import dataclasses

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.families import GLM4V, PADDLEOCR_VL, QWEN2_5_VL, QWEN2_VL, QWEN3_5, QWEN3_VL, TOWERS


def _tower(variant: str, **sizes) -> VisionConfig:
    """A preset: its sizes, and its variant's features spelled out (families.TOWERS)."""
    return VisionConfig(variant=variant, **TOWERS[variant].features(), **sizes)


QWEN2_VL_2B = _tower(
    QWEN2_VL,
    depth=32,
    width=1280,
    num_heads=16,
    intermediate_size=5120,
    out_dim=1536,
    hidden_act="quick_gelu",
)
QWEN2_VL_7B = dataclasses.replace(QWEN2_VL_2B, out_dim=3584)
QWEN2_5_VL_3B = _tower(
    QWEN2_5_VL,
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
QWEN3_VL_8B = _tower(
    QWEN3_VL,
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

# The rest of the family: the same towers under other model families (families.FAMILIES). out_dim
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
PADDLEOCR_VL_0_9B = _tower(
    PADDLEOCR_VL,
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
GLM_4_1V_9B = _tower(
    GLM4V,
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
