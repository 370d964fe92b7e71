"""The language model's inputs, positions part: `prompt_config`, `token_types`, `rope_index` and
`decode_positions` against HF's own code (installed transformers) for every family we load.

HF's `get_rope_index` is called on a stand-in instance that holds HF's real config object of the
family (built from the same config.json dict prompt_config reads): it needs no weights."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from qwen_vit_jax import presets
from qwen_vit_jax.prompt import config as pc
from qwen_vit_jax.prompt.config import PromptConfig, prompt_config, token_types
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
# Small ids so prompts are easy to read; every family's own special tokens.
IDS = dict(image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
OMNI_IDS = dict(IDS, audio_token_id=94, audio_start_token_id=95, audio_end_token_id=96, position_id_per_seconds=13)
GLM_IDS = dict(IDS, image_start_token_id=92, image_end_token_id=93, video_start_token_id=97, video_end_token_id=98)


def config_dict(family: str, tokens_per_second: int = 2) -> dict:
    """The transformers 5.x config.json of a `family` model, with our small token ids."""
    d = hf_config(TOWERS[family])
    if family in pc.OMNI:
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
    d.update(GLM_IDS if family in pc.GLM else IDS)
    if family == "qwen2_5_vl":
        d["vision_config"]["tokens_per_second"] = tokens_per_second
    return d


def write_config(tmp_path, family: str, **kw):
    path = tmp_path / family
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config_dict(family, **kw)))
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_config_reads_every_family(family, tmp_path):
    cfg = prompt_config(write_config(tmp_path, family))
    assert cfg.family == family and cfg.rules == pc.RULES[family]
    assert cfg.image_token_id == 90 and cfg.spatial_merge_size == 2
    assert cfg.video_token_id == (None if family == "paddleocr_vl" else 91)
    assert cfg.deepstack == (family in ("qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe"))
    if family in pc.OMNI:
        assert (cfg.audio_token_id, cfg.audio_start_token_id, cfg.position_id_per_seconds) == (94, 95, 13)
    else:
        assert cfg.audio_token_id is None
    if family in pc.GLM:
        assert (cfg.video_start_token_id, cfg.video_end_token_id) == (97, 98)
    if family == "qwen2_5_vl":
        assert cfg.tokens_per_second == 2


def test_prompt_config_is_read_once(tmp_path):
    path = write_config(tmp_path, "qwen2_5_vl")
    first = prompt_config(str(path))
    (path / "config.json").unlink()  # a second call reads no file
    assert prompt_config(str(path)) is first
    assert prompt_config(first) is first


def test_prompt_config_errors(tmp_path):
    d = config_dict("qwen3_omni_moe")
    del d["thinker_config"]["vision_start_token_id"]
    (tmp_path / "omni.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="vision_start_token_id"):
        prompt_config(tmp_path / "omni.json")
    (tmp_path / "llama.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="'llama' is not a vision-language model"):
        prompt_config(tmp_path / "llama.json")
    with pytest.raises(FileNotFoundError):
        prompt_config(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown family"):
        PromptConfig(family="llama", image_token_id=1, video_token_id=2, vision_start_token_id=3, vision_end_token_id=4)


def _hf_types(family: str, cfg: PromptConfig, ids: np.ndarray) -> np.ndarray:
    """HF's processor's mm_token_type_ids of `ids` (its create_mm_token_type_ids on a stand-in)."""
    from transformers.processing_utils import ProcessorMixin

    if family in pc.GLM:
        from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

        me = types.SimpleNamespace(
            image_token_id=cfg.image_token_id,
            video_start_id=cfg.video_start_token_id,
            video_end_id=cfg.video_end_token_id,
        )
        return np.array(Glm4vProcessor.create_mm_token_type_ids(me, ids.tolist()))
    me = types.SimpleNamespace(
        image_token_ids=[cfg.image_token_id], video_token_ids=[cfg.video_token_id], audio_token_ids=[cfg.audio_token_id]
    )
    return np.array(ProcessorMixin.create_mm_token_type_ids(me, ids.tolist()))


@pytest.mark.parametrize("family", FAMILIES)
def test_token_types_equal_hf_processor(family, tmp_path):
    cfg = prompt_config(write_config(tmp_path, family))
    rng = np.random.default_rng(0)
    ids = rng.integers(85, 100, size=(4, 64))
    np.testing.assert_array_equal(token_types(cfg, ids), _hf_types(family, cfg, ids))
