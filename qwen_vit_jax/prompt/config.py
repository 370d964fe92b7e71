"""What the language model's inputs need to know about a checkpoint: its family's token ids,
position and rotary rules, and its text model's rotary numbers (`PromptConfig`), read once from the
checkpoint's HF config (`prompt_config`).

HF 5.x spells `get_rope_index` and the text rotary module once per family; the differences are a
few knobs, kept here as a row per family (`RULES`, as `families.TOWERS` is for towers). The numba
kernel (kernels.py) reads the row as ints (`PromptConfig.knobs`, built with the config);
rotary.py reads its rotary part. HF's code is the reference in tests, never the template. No
torch, transformers or jax.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import threading

import numpy as np

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.families import OMNI
from qwen_vit_jax.weights.convert import HF_CONFIG_FILE
from qwen_vit_jax.weights.hf_read import CONFIG_FILE
from qwen_vit_jax.weights.sources import CONVERTED, resolve_source

from .rope_config import HALVES, INTERLEAVE, PAIRS, SECTIONS, TextRotary, read_text_rotary, text_fields

# Token types, as HF's processors write `mm_token_type_ids`.
TEXT, IMAGE, VIDEO, AUDIO = 0, 1, 2, 3

# RopeRules.time: how a vision item's temporal index k becomes its temporal position.
TIME_NONE = 0  # k (Qwen2-VL, Qwen3-VL, GLM, PaddleOCR-VL: videos are one frame per run or unscaled)
TIME_TPS = 1  # trunc(f32(k) * f32(tokens_per_second * s)) for videos (Qwen2.5-VL; images: k)
TIME_OMNI = 2  # f32(f32(k) * s) * position_id_per_seconds, s = 1 for images (the Omni thinkers)
# RopeRules.advance: where the text after a vision run starts.
ADVANCE_HW = 0  # start + max(h, w) // merge (HF 5.x's Qwen-VL / GLM / PaddleOCR code)
ADVANCE_MAX = 1  # the largest position of the last piece HF appended, + 1 (the Omni thinkers)
# RopeRules.audio_in_video: how a video with its audio track (use_audio_in_video) is laid out.
AIV_NONE = 0
AIV_CHUNKS = 1  # Qwen2.5-Omni: video and audio in chunks of seconds_per_chunk; <vs><as> share one
#                 position, so do <ae><ve>
AIV_MERGE = 2  # Qwen3-Omni: tokens merged by temporal position (video first on ties)
# RopeRules.audio_len: audio feature frames -> audio tokens.
AUDIO_NONE, AUDIO_QWEN2_5_OMNI, AUDIO_QWEN3_OMNI = 0, 1, 2


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RopeRules:
    """One family's rules for prompt positions and the text rotary (a row of `RULES`).

    split_frames: a video of t temporal patches is t runs of one frame each (text, e.g. timestamps,
        between them): Qwen3-VL, Qwen3.5, Qwen4-Exp, GLM-4V.
    time, advance, audio_in_video, audio_len: the constants above.
    pad_position: what HF writes at padded (attention_mask 0) positions.
    text_fallback: with no image and no video grid at all, HF takes its text-only branch
        (positions cumsum(mask) - 1, pads 1, deltas max + 1 - length): the Omni thinkers.
    glm_types: image tokens between <|begin_of_video|> and <|end_of_video|> are video tokens (GLM-4V
        uses one placeholder id for both).
    float_positions: HF keeps positions and deltas as float32, a video's time possibly fractional
        (frame * second_per_grid_ts * position_id_per_seconds): Qwen3-Omni. Otherwise int64.
    mrope: how the frequencies read the t / h / w rows (rope_config.SECTIONS or INTERLEAVE);
        mrope_section: HF's default when the config gives none.
    rotate: rope_config.HALVES (the table [f, f], rotate_half) or PAIRS (each frequency twice in
        place, pairs rotated: GLM-4.1V's rotate_half_llm).
    partial_rotary: HF's default rotary init reads `partial_rotary_factor` (the rest of a head passes
        through): Qwen3.5, Qwen3.5-MoE, Qwen4-Exp, GLM-4V.
    """

    split_frames: bool = False
    time: int = TIME_NONE
    advance: int = ADVANCE_HW
    audio_in_video: int = AIV_NONE
    audio_len: int = AUDIO_NONE
    pad_position: int = 0
    text_fallback: bool = False
    glm_types: bool = False
    float_positions: bool = False
    mrope: str = SECTIONS
    mrope_section: tuple[int, ...] = (16, 24, 24)
    rotate: str = HALVES
    partial_rotary: bool = False


_QWEN2 = RopeRules()
_QWEN3 = RopeRules(split_frames=True, mrope=INTERLEAVE, mrope_section=(24, 20, 20))
_QWEN3_5 = dataclasses.replace(_QWEN3, mrope_section=(11, 11, 10), partial_rotary=True)
_GLM = RopeRules(split_frames=True, glm_types=True, mrope_section=(8, 12, 12), partial_rotary=True)
_OMNI = RopeRules(time=TIME_OMNI, advance=ADVANCE_MAX, text_fallback=True)
RULES = {
    "qwen2_vl": _QWEN2,
    "qwen2_5_vl": RopeRules(time=TIME_TPS),
    "qwen3_vl": _QWEN3,
    "qwen3_vl_moe": _QWEN3,
    "qwen3_5": _QWEN3_5,
    "qwen3_5_moe": _QWEN3_5,
    "qwen4_exp": _QWEN3_5,
    "paddleocr_vl": _QWEN2,
    "glm4v": dataclasses.replace(_GLM, rotate=PAIRS),
    "glm4v_moe": _GLM,
    "qwen2_5_omni": dataclasses.replace(_OMNI, audio_in_video=AIV_CHUNKS, audio_len=AUDIO_QWEN2_5_OMNI, pad_position=1),
    "qwen3_omni_moe": dataclasses.replace(
        _OMNI,
        audio_in_video=AIV_MERGE,
        audio_len=AUDIO_QWEN3_OMNI,
        float_positions=True,
        mrope=INTERLEAVE,
        mrope_section=(24, 20, 20),
    ),
}
# PromptConfig.knobs: the row as the kernel reads it, int64 [N_KNOBS].
(
    K_MERGE,
    K_SPLIT,
    K_ADVANCE,
    K_AIV,
    K_PAD,
    K_IMAGE,
    K_VIDEO,
    K_AUDIO,
    K_GLM,
    K_VSTART_GLM,
    K_VEND_GLM,
    K_VSTART,
    K_ASTART,
    K_TPC,
    N_KNOBS,
) = range(15)
NO_ID = -(1 << 62)  # an id no token has (a family without that token)

# HF 5.x's config-class defaults, used where a config.json leaves a field out (as HF would).
_QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
_QWEN3_5_IDS = dict(
    image_token_id=248056, video_token_id=248057, vision_start_token_id=248053, vision_end_token_id=248054
)
_GLM_IDS = dict(
    image_token_id=151343,
    video_token_id=151344,
    image_start_token_id=151339,
    image_end_token_id=151340,
    video_start_token_id=151341,
    video_end_token_id=151342,
)
_OMNI_IDS = dict(
    audio_token_id=151646, image_token_id=151655, video_token_id=151656, audio_start_token_id=151647, user_token_id=872
)
DEFAULTS = {
    "qwen2_vl": _QWEN_IDS,
    "qwen2_5_vl": _QWEN_IDS,
    "qwen3_vl": _QWEN_IDS,
    "qwen3_vl_moe": _QWEN_IDS,
    "qwen3_5": _QWEN3_5_IDS,
    "qwen3_5_moe": _QWEN3_5_IDS,
    "qwen4_exp": _QWEN3_5_IDS,
    "paddleocr_vl": dict(
        image_token_id=100295, video_token_id=100296, vision_start_token_id=101305, vision_end_token_id=101306
    ),
    "glm4v": _GLM_IDS,
    "glm4v_moe": dict(_GLM_IDS, image_token_id=151363, video_token_id=151364),
    "qwen2_5_omni": dict(_OMNI_IDS, audio_end_token_id=151648, position_id_per_seconds=25, seconds_per_chunk=2),
    "qwen3_omni_moe": dict(_OMNI_IDS, position_id_per_seconds=25),
}
# Fields HF's code reads that its config classes do not define: they must be in the file.
_REQUIRED = {
    "qwen2_5_omni": ("vision_start_token_id", "vision_end_token_id"),
    "qwen3_omni_moe": ("vision_start_token_id", "vision_end_token_id"),
}
# The 2.5-Omni thinker's config spells its placeholder ids *_token_index (HF's attribute_map).
_ALIASES = {"image_token_id": "image_token_index", "video_token_id": "video_token_index"}
_ALIASES["audio_token_id"] = "audio_token_index"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PromptConfig:
    """A checkpoint family's prompt tokens and rules: what `rope_index`, `splice` and
    `expand_placeholders` read. Built by `prompt_config` from a checkpoint, or by hand.

    family: HF's top-level model_type ("qwen2_5_vl", "qwen3_omni_moe", "glm4v", ...); `rules` is
    `RULES[family]` unless given. Ids a family does not have are None (`audio_token_id` outside the
    Omni thinkers; GLM's `image_start_token_id` ... `video_end_token_id` outside GLM-4V;
    `video_token_id` for PaddleOCR-VL, whose processor never types a video token).
    tokens_per_second: Qwen2.5-VL's vision_config.tokens_per_second. position_id_per_seconds,
    seconds_per_chunk, audio_n_window: the Omni thinkers' (audio_n_window: Qwen3-Omni's
    audio_config.n_window, its audio-token count).
    rotary: the text model's rotary numbers (`mrope_tables` needs them; None: not known, e.g. a
    config built by hand).
    knobs: the family's row and token ids as the kernel reads them (int64, read-only; built here).
    """

    family: str
    image_token_id: int
    video_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    spatial_merge_size: int = 2
    deepstack: bool = False
    audio_token_id: int | None = None
    audio_start_token_id: int | None = None
    audio_end_token_id: int | None = None
    image_start_token_id: int | None = None
    image_end_token_id: int | None = None
    video_start_token_id: int | None = None
    video_end_token_id: int | None = None
    tokens_per_second: float = 1.0
    position_id_per_seconds: float = 25.0
    seconds_per_chunk: float = 2.0
    audio_n_window: int = 50
    rules: RopeRules | None = None
    rotary: TextRotary | None = None
    knobs: np.ndarray = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.family not in RULES:
            raise ValueError(f"PromptConfig: unknown family {self.family!r} (known: {', '.join(RULES)})")
        if self.rules is None:
            object.__setattr__(self, "rules", RULES[self.family])
        if self.spatial_merge_size < 1:
            raise ValueError(f"PromptConfig: spatial_merge_size must be >= 1, got {self.spatial_merge_size}")
        if self.rules.glm_types and (self.video_start_token_id is None or self.video_end_token_id is None):
            raise ValueError(f"PromptConfig({self.family}): GLM-4V needs video_start_token_id and video_end_token_id")
        if self.rules.audio_in_video and (self.vision_start_token_id is None or self.audio_start_token_id is None):
            raise ValueError(f"PromptConfig({self.family}): needs vision_start_token_id and audio_start_token_id")
        object.__setattr__(self, "knobs", _knobs(self))


def _knobs(cfg: PromptConfig) -> np.ndarray:
    r = cfg.rules

    def tid(v):
        return NO_ID if v is None else v

    k = np.zeros(N_KNOBS, np.int64)
    k[K_MERGE] = cfg.spatial_merge_size
    k[K_SPLIT] = r.split_frames
    k[K_ADVANCE] = r.advance
    k[K_AIV] = r.audio_in_video
    k[K_PAD] = r.pad_position
    k[K_IMAGE] = cfg.image_token_id
    k[K_VIDEO] = tid(cfg.video_token_id)
    k[K_AUDIO] = tid(cfg.audio_token_id)
    k[K_GLM] = r.glm_types
    k[K_VSTART_GLM] = tid(cfg.video_start_token_id)
    k[K_VEND_GLM] = tid(cfg.video_end_token_id)
    k[K_VSTART] = tid(cfg.vision_start_token_id)
    k[K_ASTART] = tid(cfg.audio_start_token_id)
    k[K_TPC] = int(cfg.position_id_per_seconds * cfg.seconds_per_chunk)  # HF: int(pps * seconds_per_chunk)
    k.setflags(write=False)
    return k


_CACHE: dict[str | tuple[str, str], PromptConfig] = {}
_LOCK = threading.Lock()


def prompt_config(source) -> PromptConfig:
    """The PromptConfig of a checkpoint, read once and cached (a second call with the same source
    reads no file).

    Args:
        source: what `load_model` takes (an HF checkpoint directory, a directory written by
            `convert_checkpoint`, a hub id in the local HF cache), the path of an HF config.json, an
            HF config dict (read each time), or a PromptConfig (returned as it is).
    Returns:
        PromptConfig.
    Raises:
        FileNotFoundError for a missing source; ValueError for a config that is not a supported VL
        model's, or that lacks a field HF's code reads (naming the file and the field).
    """
    if isinstance(source, PromptConfig):
        return source
    if isinstance(source, dict):
        return config_from_dict(source)
    cfg = _CACHE.get(source)  # an absolute path as given: no system call at all
    if cfg is not None:
        return cfg
    name = os.fspath(source)
    absolute = os.path.isabs(name)
    key = name if absolute else (name, os.getcwd())  # a relative path (or hub id) means something else elsewhere
    cfg = _CACHE.get(key)
    if cfg is None:
        cfg = _read(name)
        with _LOCK:
            _CACHE[key] = cfg
            if absolute and isinstance(source, str):
                _CACHE[source] = cfg
    return cfg


def _config_path(name: str) -> pathlib.Path:
    """The HF config.json behind a source."""
    path = pathlib.Path(name).expanduser()
    if path.is_file():
        return path
    src = resolve_source(name)
    if src.kind == CONVERTED:
        hf = src.path / HF_CONFIG_FILE
        if not hf.is_file():
            raise ValueError(
                f"{src.path}: a converted directory without {HF_CONFIG_FILE} (written by convert_checkpoint "
                "since the language-model inputs issue); convert the checkpoint again, or pass the HF directory"
            )
        return hf
    return src.path / CONFIG_FILE


def _read(name: str) -> PromptConfig:
    path = _config_path(name)
    try:
        d = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config_from_dict(d, where=str(path))


def config_from_dict(d: dict, where: str = "HF config") -> PromptConfig:
    """A PromptConfig from an HF config dict (a full VL model's config.json, either layout, or an
    Omni model's / thinker's). ValueError names `where` and what is missing."""
    family = d.get("model_type", "")
    thinker = d
    if family.endswith("_thinker") and family[: -len("_thinker")] in OMNI:
        family = family[: -len("_thinker")]
    elif family in OMNI:
        thinker = d.get("thinker_config")
        if not isinstance(thinker, dict):
            raise ValueError(f"{where}: an {family} config without a thinker_config")
    if family not in RULES:
        raise ValueError(
            f"{where}: model_type {family!r} is not a vision-language model whose prompts this package knows "
            f"({', '.join(RULES)})"
        )
    vision = thinker.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(f"{where}: no vision_config (a vision-only or text-only config has no prompt rules)")
    defaults = DEFAULTS[family]

    def field(key: str, default=None):
        for k in (key, _ALIASES.get(key)):
            if k is not None and thinker.get(k) is not None:
                return thinker[k]
        if key in _REQUIRED.get(family, ()):
            raise ValueError(
                f"{where}: {family} needs {key}, which HF's get_rope_index reads but its config class does not "
                "define; the released config.json files carry it"
            )
        return defaults.get(key, default)

    rules = RULES[family]
    glm = rules.glm_types
    try:
        deepstack = bool(VisionConfig.from_hf(thinker).deepstack_layers) if family != "paddleocr_vl" else False
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    audio = thinker.get("audio_config") or {}
    return PromptConfig(
        family=family,
        image_token_id=int(field("image_token_id")),
        # PaddleOCR-VL's processor only types images (its config's video id is never used)
        video_token_id=None if family == "paddleocr_vl" else int(field("video_token_id")),
        vision_start_token_id=_opt(field("vision_start_token_id")),
        vision_end_token_id=_opt(field("vision_end_token_id")),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        deepstack=deepstack,
        audio_token_id=_opt(field("audio_token_id")),
        audio_start_token_id=_opt(field("audio_start_token_id")),
        audio_end_token_id=_opt(field("audio_end_token_id")),
        image_start_token_id=_opt(field("image_start_token_id")) if glm else None,
        image_end_token_id=_opt(field("image_end_token_id")) if glm else None,
        video_start_token_id=_opt(field("video_start_token_id")) if glm else None,
        video_end_token_id=_opt(field("video_end_token_id")) if glm else None,
        tokens_per_second=float(vision.get("tokens_per_second", 4)),  # Qwen2_5_VLVisionConfig's default
        position_id_per_seconds=float(field("position_id_per_seconds", 25)),
        seconds_per_chunk=float(field("seconds_per_chunk", 2)),
        audio_n_window=int(audio.get("n_window", 50)),
        rotary=read_text_rotary(family, text_fields(family, thinker), rules.mrope_section, rules.partial_rotary, where),
    )


def _opt(v) -> int | None:
    return None if v is None else int(v)
