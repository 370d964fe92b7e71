"""Tiny whole HF models of the families whose language-model inputs we build (test_splice.py,
test_lm_end_to_end.py): a text model as wide as the tower's output and token ids inside its
vocabulary, so their whole forward runs; their prompt configs and random expanded batches."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import qwen_vit_jax as qvj
from qwen_vit_jax.families import OMNI
from qwen_vit_jax.presets import PRESETS
from qwen_vit_jax.prompt.config import config_from_dict
from qwen_vit_jax.tools.hf_reference import (
    AUDIO_CONFIG,
    TEXT_CONFIG,
    TEXT_CONFIG_GLM4V,
    TEXT_CONFIG_QWEN3,
    TEXT_CONFIG_QWEN3_5,
    hf_vision_config,
    reinit_,
    text_config,
)

WIDTH = 32  # the tower's output = the text model's hidden size
_SMALL = dict(depth=2, width=32, num_heads=2, intermediate_size=48, out_dim=WIDTH)
TOWERS = {
    "qwen2_5_vl": dataclasses.replace(PRESETS["qwen2.5-vl-3b"], **_SMALL, fullatt_block_indexes=(1,)),
    "qwen3_vl": dataclasses.replace(
        PRESETS["qwen3-vl-8b"], **_SMALL, num_position_embeddings=16, deepstack_layers=(0, 1)
    ),
    "glm4v": dataclasses.replace(
        PRESETS["glm-4.1v-9b"],
        **dict(_SMALL, intermediate_size=WIDTH),  # GLM: the block MLP width is out_dim
        merger_intermediate_size=40,
        num_position_embeddings=16,
    ),
}
TOWERS["qwen2_5_omni"] = dataclasses.replace(TOWERS["qwen2_5_vl"], family="qwen2_5_omni")
FAMILIES = list(TOWERS)  # the splice and placeholder tests'; tests/test_lm_end_to_end.py adds two more
TOWERS["qwen3_5"] = dataclasses.replace(PRESETS["qwen3.5-27b"], **_SMALL, num_position_embeddings=16)
TOWERS["qwen3_omni_moe"] = dataclasses.replace(TOWERS["qwen3_vl"], family="qwen3_omni_moe")
# Token ids inside the tiny text models' vocabulary (128): text tokens are 1 .. 99, 0 pads.
QWEN_IDS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
GLM_IDS = dict(
    image_token_id=120,
    video_token_id=121,
    image_start_token_id=122,
    image_end_token_id=123,
    video_start_token_id=124,
    video_end_token_id=125,
)
OMNI_IDS = dict(
    image_token_index=120,
    video_token_index=121,
    vision_start_token_id=122,
    vision_end_token_id=123,
    audio_token_index=124,
    audio_start_token_id=125,
    audio_end_token_id=126,
)
QWEN3_OMNI_IDS = {k.replace("_index", "_id"): v for k, v in OMNI_IDS.items()}  # its thinker's spelling
# The text models: each family's tiny one (hf_reference), Qwen3.5's wider, so its partial rotary has 8
# frequencies in 3 interleaved sections (the default 0.25 of 16 would leave 2)
TEXT = {
    "qwen2_5_vl": TEXT_CONFIG,
    "qwen2_5_omni": TEXT_CONFIG,
    "qwen3_vl": TEXT_CONFIG_QWEN3,
    "glm4v": TEXT_CONFIG_GLM4V,
    "qwen3_5": dict(
        TEXT_CONFIG_QWEN3_5,
        head_dim=32,
        rope_parameters={
            "rope_type": "default",
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    ),
    "qwen3_omni_moe": text_config(TOWERS["qwen3_omni_moe"]),
}


def hf_config_dict(family: str) -> dict:
    """The config of a tiny whole model of `family` (what save_pretrained writes, as a dict)."""
    cfg = TOWERS[family]
    vision = hf_vision_config(cfg)
    text = dict(TEXT[family], hidden_size=WIDTH)
    if family in OMNI:
        thinker = dict(
            model_type=f"{family}_thinker", text_config=text, vision_config=vision, audio_config=AUDIO_CONFIG
        )
        ids = OMNI_IDS if family == "qwen2_5_omni" else QWEN3_OMNI_IDS
        return dict(model_type=family, thinker_config=dict(thinker, **ids), enable_audio_output=False)
    ids = GLM_IDS if family == "glm4v" else QWEN_IDS
    return dict(model_type=family, text_config=text, vision_config=vision, **ids)


# family -> (HF module, config class, whole-model class)
HF_CLASSES = {
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "glm4v": ("glm4v", "Glm4vConfig", "Glm4vForConditionalGeneration"),
    "qwen2_5_omni": ("qwen2_5_omni", "Qwen2_5OmniConfig", "Qwen2_5OmniForConditionalGeneration"),
    "qwen3_5": ("qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_omni_moe": ("qwen3_omni_moe", "Qwen3OmniMoeConfig", "Qwen3OmniMoeForConditionalGeneration"),
}


def tiny_hf(family: str, seed: int = 0):
    """A tiny HF *ForConditionalGeneration (Omni: the whole model, with its thinker), float32, eval,
    every weight re-initialised the docs/numerics.md way."""
    import importlib

    module, config_name, model_name = HF_CLASSES[family]
    full_cls = getattr(importlib.import_module(f"transformers.models.{module}.configuration_{module}"), config_name)
    model_cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), model_name)
    d = hf_config_dict(family)
    torch.manual_seed(seed)
    if family in OMNI:
        hf_cfg = full_cls(thinker_config=d["thinker_config"], enable_audio_output=False)
        # HF 5.x's thinker config classes drop the vision start / end ids their get_rope_index reads
        for k in ("vision_start_token_id", "vision_end_token_id"):
            setattr(hf_cfg.thinker_config, k, OMNI_IDS[k])
    else:
        hf_cfg = full_cls(**{k: v for k, v in d.items() if k != "model_type"})
    model = model_cls(hf_cfg).eval()
    # every weight re-initialised (docs/numerics.md): HF's flat std 0.02 leaves attention so uniform
    # that wrong positions would hardly move the logits
    reinit_(model, seed)
    return model


def inner(model):
    """The *Model whose forward splices (an Omni model's: its thinker's)."""
    return model.thinker.model if hasattr(model, "thinker") else model.model


def prompt_config_of(family: str):
    return config_from_dict(hf_config_dict(family), where=family)


# ---- random prompts ---------------------------------------------------------------------------------
def placeholder_prompts(family: str, rng, items: list[str], batch: int = 2) -> list[list[int]]:
    """`batch` rows of random text with the items ("image" / "video") spread over them in order, each
    as the chat template writes it (one placeholder token)."""
    cfg = prompt_config_of(family)
    rows = [list(rng.integers(1, 100, rng.integers(1, 6))) for _ in range(batch)]
    for i, kind in enumerate(items):
        row = rows[i % batch] if rng.random() < 0.7 else rows[int(rng.integers(batch))]
        if kind == "image":
            row += [cfg.vision_start_token_id or cfg.image_start_token_id, cfg.image_token_id]
            row += [cfg.vision_end_token_id or cfg.image_end_token_id]
        elif family == "glm4v":
            row += [cfg.video_start_token_id, cfg.video_token_id, cfg.video_end_token_id]
        else:
            row += [cfg.vision_start_token_id, cfg.video_token_id, cfg.vision_end_token_id]
        row += list(rng.integers(1, 100, rng.integers(0, 5)))
    return rows


def timestamp_ids(text: str) -> list[int]:
    """A fake tokenizer for the frame times: one text token per character."""
    return [1 + ord(c) % 90 for c in text]


def random_batch(family: str, seed: int, items: list[str], left: bool = True):
    """(input_ids [B, L] padded with 0, attention_mask [B, L], image grids, video grids) of a random
    expanded batch: items in order, random small grids."""
    rng = np.random.default_rng(seed)
    kinds = [k for k in items]
    prompts = placeholder_prompts(family, rng, kinds)
    grid = {"image": [], "video": []}
    for k in kinds:
        t = 1 if k == "image" else int(rng.integers(1, 4))
        grid[k].append([t, 2 * int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4))])
    thw = {k: np.array(v, np.int64).reshape(-1, 3) for k, v in grid.items()}
    ts = [np.arange(t) * 1.5 + 0.25 for t in thw["video"][:, 0]]
    rows = qvj.expand_placeholders(
        prompt_config_of(family),
        prompts,
        thw["image"] if len(thw["image"]) else None,
        thw["video"] if len(thw["video"]) else None,
        video_timestamps=ts,
        timestamp_ids=timestamp_ids,
    )
    length = max(len(r) for r in rows) + int(rng.integers(0, 3))
    ids = np.zeros((len(rows), length), np.int64)
    mask = np.zeros((len(rows), length), np.int64)
    for b, r in enumerate(rows):
        sl = slice(length - len(r), length) if left else slice(0, len(r))
        ids[b, sl], mask[b, sl] = r, 1
    return ids, mask, thw["image"], thw["video"]
