"""The config.json dicts of every family we load (a released tower of each, with small token ids):
what `prompt_config` reads in test_positions.py and the rotary modules are built from in
test_rotary.py. Only the dicts are used: no weights anywhere."""

from __future__ import annotations

from qwen_vit_jax import presets
from qwen_vit_jax.families import OMNI
from qwen_vit_jax.prompt import config as pc
from qwen_vit_jax.tools.hf_reference import hf_config

# family -> a released tower of it (only the config dict is used: no weights anywhere)
TOWERS = {
    "qwen2_vl": presets.QWEN2_VL_2B,
    "qwen2_5_vl": presets.QWEN2_5_VL_3B,
    "qwen3_vl": presets.QWEN3_VL_8B,
    "qwen3_vl_moe": presets.QWEN3_VL_30B_A3B,
    "qwen3_5": presets.QWEN3_5_27B,
    "qwen3_5_moe": presets.QWEN3_5_35B_A3B,
    "qwen4_exp": presets.QWEN4_EXP,
    "qwen2_5_omni": presets.QWEN2_5_OMNI_3B,
    "qwen3_omni_moe": presets.QWEN3_OMNI_30B_A3B,
    "paddleocr_vl": presets.PADDLEOCR_VL_0_9B,
    "glm4v": presets.GLM_4_1V_9B,
    "glm4v_moe": presets.GLM_4_5V,
}
FAMILIES = tuple(TOWERS)
GLM = tuple(f for f in FAMILIES if pc.RULES[f].glm_types)
# Small ids so prompts are easy to read; every family's own special tokens.
IDS = dict(image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
OMNI_IDS = dict(IDS, audio_token_id=94, audio_start_token_id=95, audio_end_token_id=96, position_id_per_seconds=13)
GLM_IDS = dict(IDS, image_start_token_id=92, image_end_token_id=93, video_start_token_id=97, video_end_token_id=98)


def config_dict(family: str, tokens_per_second: int = 2) -> dict:
    """The transformers 5.x config.json of a `family` model, with our small token ids."""
    d = hf_config(TOWERS[family])
    if family in OMNI:
        ids = dict(OMNI_IDS)
        if family == "qwen2_5_omni":  # its thinker config spells the placeholders *_token_index
            for k in ("image", "video", "audio"):
                ids[f"{k}_token_index"] = ids.pop(f"{k}_token_id")
            ids["seconds_per_chunk"] = 2
        d["thinker_config"].update(ids)
        return d
    for k in list(d):
        if k.endswith("_token_id"):
            del d[k]
    d.update(GLM_IDS if family in GLM else IDS)
    if family == "qwen2_5_vl":
        d["vision_config"]["tokens_per_second"] = tokens_per_second
    return d
