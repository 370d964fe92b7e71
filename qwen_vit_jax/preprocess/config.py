"""Preprocessing settings (`PreprocessConfig`) and every reader of HF's processor configs: the image
processors' `preprocessor_config.json` and the video processors' `video_preprocessor_config.json`,
with the class defaults of each HF processor a field missing from its file gets.

Defaults are transformers 5.24's: `Qwen2VLImageProcessorPil` (images), `Qwen2VLVideoProcessor` /
`Qwen3VLVideoProcessor` (videos), `PaddleOCRVLImageProcessorPil`, `Glm4vImageProcessorPil`. A
checkpoint's own files win (`PreprocessConfig.from_hf`; `image_config_for` / `video_config_for`
pick the right defaults and files for a tower).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np
from PIL import Image

from qwen_vit_jax.families import GLM4V, PADDLEOCR_VL
from qwen_vit_jax.files import load_json_object

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VIDEO_SAMPLERS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")  # HF's video processors' frame sampling (video.py)
_PIL_FILTERS = tuple(sorted(int(f) for f in Image.Resampling))  # PIL resample ids: NEAREST=0 .. BICUBIC=3 ..


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    """Preprocessing settings. Defaults are transformers 5.24's `Qwen2VLImageProcessorPil` class defaults
    (max_pixels 1,003,520 = 28*28*1280). The released Qwen checkpoints say max_pixels 12,845,056 in
    their preprocessor_config.json: load it with `from_hf` when you have one."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    # Video (video.py; images ignore these). Defaults: HF 5.24's Qwen2VLVideoProcessor class values.
    video_sampler: str = "qwen2-vl"  # whose frame sampling and timestamps: qwen2-vl | qwen2.5-vl | qwen3-vl
    do_sample_frames: bool = False  # apply `fps` / `num_frames` below when a call passes neither
    fps: float | None = None  # frames per second to sample
    num_frames: int | None = None  # or a fixed count (mutually exclusive with fps)
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False  # HF's (qwen-vl-utils') per-frame share of a total budget
    max_video_tokens: int | None = None  # that budget; None: the sampler's HF default (128000 / 768)

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"invalid PreprocessConfig: {msg}")

        ints = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")
        for name in (*ints, "resample"):
            if isinstance(getattr(self, name), (np.integer, Image.Resampling)):  # numpy ints / PIL enums
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in ints:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{name} must be a positive int, got {v!r}")
        if self.min_pixels > self.max_pixels:
            bad(f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be a bool, got {getattr(self, name)!r}")
        if type(self.resample) is not int or self.resample not in _PIL_FILTERS:
            bad(f"resample must be a PIL filter id {_PIL_FILTERS}, got {self.resample!r}")
        r = self.rescale_factor
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            bad(f"rescale_factor must be a positive number, got {r!r}")
        object.__setattr__(self, "rescale_factor", float(r))
        for name in ("image_mean", "image_std"):
            v = getattr(self, name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):  # HF: one value for all channels
                v = (v,) * 3
            try:
                v = tuple(float(x) for x in v)
            except (TypeError, ValueError):
                bad(f"{name} must be 3 numbers, got {getattr(self, name)!r}")
            if len(v) != 3 or not all(math.isfinite(x) for x in v):
                bad(f"{name} must be 3 finite numbers, got {getattr(self, name)!r}")
            object.__setattr__(self, name, v)
        if any(s == 0 for s in self.image_std):
            bad(f"image_std must be non-zero, got {self.image_std}")
        _check_video_fields(self, bad)

    @property
    def factor(self) -> int:
        """Side of one merge unit in pixels (28): resized sides are multiples of it."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one pixel_values row: C * T * p * p (1176)."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dict; `from_hf` (and HF's `Qwen2VLImageProcessorPil.from_dict`) read it back."""
        d = dataclasses.asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return d

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict, *, video: bool | None = None) -> PreprocessConfig:
        """Read an HF `preprocessor_config.json` or `video_preprocessor_config.json`: a dict, a path to
        the file, or a checkpoint directory.

        The pixel range comes from top-level `min_pixels` / `max_pixels` (they win, as in HF) or from
        `size` = {"shortest_edge", "longest_edge"} (also accepted there: "min_pixels" / "max_pixels").
        Missing or null fields keep the defaults; unknown keys are ignored; bad values raise ValueError.

        Video (video.py): a config with a `video_processor_type`, or any config when `video=True`, starts
        from that HF video processor's class defaults instead of the image processor's, as HF does. With
        `video=True` a directory's video_preprocessor_config.json is read, else its
        preprocessor_config.json (HF's fallback, what Qwen2-VL / Qwen2.5-VL checkpoints ship). The
        sampling rules (`video_sampler`) follow `video_processor_type`, `processor_class`, else the patch
        size (16: Qwen3-VL).
        """
        filename = "preprocessor_config.json"
        if (
            video
            and not isinstance(path_or_dict, dict)
            and os.path.isfile(os.path.join(path_or_dict, VIDEO_CONFIG_FILE))
        ):
            filename = VIDEO_CONFIG_FILE
        d, where = load_json_object(path_or_dict, filename, "HF preprocessor config")

        kw: dict[str, Any] = video_defaults(d, video)
        size = d.get("size")
        if size is not None:
            if not isinstance(size, dict):
                raise ValueError(f"{where}: 'size' must be an object, got {size!r}")
            for ours, names in (
                ("min_pixels", ("shortest_edge", "min_pixels")),
                ("max_pixels", ("longest_edge", "max_pixels")),
            ):
                for n in names:
                    if size.get(n) is not None:
                        kw[ours] = size[n]
                        break
        names = [f.name for f in dataclasses.fields(cls)]
        kw.update({n: d[n] for n in names if d.get(n) is not None})
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def _check_video_fields(cfg: PreprocessConfig, bad) -> None:
    """Validate (and normalise) PreprocessConfig's video fields; `bad(msg)` raises."""
    if cfg.video_sampler not in VIDEO_SAMPLERS:
        bad(f"video_sampler must be one of {VIDEO_SAMPLERS}, got {cfg.video_sampler!r}")
    for name in ("do_sample_frames", "cap_pixels_per_frame"):
        if not isinstance(getattr(cfg, name), bool):
            bad(f"{name} must be a bool, got {getattr(cfg, name)!r}")
    for name, optional in (
        ("num_frames", True),
        ("min_frames", False),
        ("max_frames", False),
        ("max_video_tokens", True),
    ):
        v = getattr(cfg, name)
        if isinstance(v, np.integer):
            object.__setattr__(cfg, name, v := int(v))
        if not (optional and v is None) and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            bad(f"{name} must be a positive int{' or None' if optional else ''}, got {v!r}")
    if cfg.fps is not None:
        if isinstance(cfg.fps, bool) or not isinstance(cfg.fps, (int, float)) or not 0 < cfg.fps < math.inf:
            bad(f"fps must be a positive number or None, got {cfg.fps!r}")
        object.__setattr__(cfg, "fps", float(cfg.fps))


# The hub's Qwen3-VL preprocessor_config.json (Qwen3.5 ships the same image settings):
# {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
#  "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
QWEN3_VL_PREPROCESS = PreprocessConfig(
    min_pixels=65536,
    max_pixels=16777216,
    patch_size=16,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    video_sampler="qwen3-vl",  # what from_hf reads from such a file (patch 16)
)


# HF's PaddleOCRVLImageProcessorPil class defaults: pixel budget 384^2 .. 1536^2, patch 14, no temporal
# patch, merge 2, CLIP mean / std (a checkpoint's preprocessor_config.json overrides them).
PADDLEOCR_PREPROCESS = PreprocessConfig(min_pixels=384 * 384, max_pixels=1536 * 1536, temporal_patch_size=1)
# HF's Glm4vImageProcessorPil class defaults: pixel budget 112^2 .. 28^2 * 15000 (counted over the
# temporal patch's 2 frames), patch 14, temporal patch 2, merge 2, CLIP mean / std.
GLM4V_PREPROCESS = PreprocessConfig(min_pixels=112 * 112, max_pixels=28 * 28 * 15000)


# ---- video processors ---------------------------------------------------------------------------
VIDEO_CONFIG_FILE = "video_preprocessor_config.json"

# HF 5.24's class defaults of each video processor (what a field missing from its config gets).
_VIDEO_DEFAULTS = {
    "Qwen2VLVideoProcessor": dict(
        min_pixels=128 * 28 * 28,
        max_pixels=28 * 28 * 768,
        patch_size=14,
        image_mean=OPENAI_CLIP_MEAN,
        image_std=OPENAI_CLIP_STD,
    ),
    "Qwen3VLVideoProcessor": dict(
        min_pixels=128 * 32 * 32,
        max_pixels=32 * 32 * 768,
        patch_size=16,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        do_sample_frames=True,
        fps=2.0,
    ),
}
MAX_VIDEO_TOKENS = {"qwen2-vl": 128000, "qwen2.5-vl": 128000, "qwen3-vl": 768}
# VisionConfig.variant -> the sampler of the HF video processor its checkpoints use
_SAMPLER_OF_VARIANT = {
    "qwen2_vl": "qwen2-vl",
    "qwen2_5_vl": "qwen2.5-vl",
    "qwen3_vl": "qwen3-vl",
    "qwen3_5": "qwen3-vl",
}


def _sampler_of(d: dict) -> str:
    """Which HF video processor's rules a config dict asks for."""
    kind = str(d.get("video_processor_type") or "")
    cls = str(d.get("processor_class") or "")
    if kind.startswith("Qwen3") or cls.startswith("Qwen3"):
        return "qwen3-vl"
    if "2_5" in cls:
        return "qwen2.5-vl"
    if kind.startswith("Qwen2") or cls.startswith("Qwen2"):
        return "qwen2-vl"
    return "qwen3-vl" if d.get("patch_size") == 16 else "qwen2-vl"


def sampler_for_variant(variant: str) -> str | None:
    """The video_sampler of a tower variant's checkpoints (None: a variant without one here)."""
    return _SAMPLER_OF_VARIANT.get(variant)


def video_defaults(d: dict, video: bool | None) -> dict[str, Any]:
    """PreprocessConfig keywords a config dict starts from (before its own fields): the sampler always;
    for a video config (`video_processor_type` present, or `video`) also its HF class defaults."""
    sampler = _sampler_of(d)
    if not (video or (video is None and d.get("video_processor_type"))):
        return {"video_sampler": sampler}
    base = "Qwen3VLVideoProcessor" if sampler == "qwen3-vl" else "Qwen2VLVideoProcessor"
    return dict(_VIDEO_DEFAULTS[base], video_sampler=sampler)


VIDEO_DEFAULT = PreprocessConfig.from_hf({"video_processor_type": "Qwen2VLVideoProcessor"})
QWEN3_VL_VIDEO = PreprocessConfig.from_hf({"video_processor_type": "Qwen3VLVideoProcessor"})


# ---- a tower's defaults ---------------------------------------------------------------------------
def image_config_for(variant: str) -> PreprocessConfig:
    """HF's image-processor class defaults for a tower variant (a checkpoint's preprocessor_config.json,
    read with `from_hf`, wins over them)."""
    return {PADDLEOCR_VL: PADDLEOCR_PREPROCESS, GLM4V: GLM4V_PREPROCESS}.get(variant, PreprocessConfig())


def video_config_for(path: str | os.PathLike | None, variant: str) -> PreprocessConfig:
    """The video PreprocessConfig of a checkpoint directory: its video_preprocessor_config.json, else
    its preprocessor_config.json (HF's fallback), else HF's video-processor class defaults; with the
    frame sampling and timestamps of the tower's variant (Qwen2-VL and Qwen2.5-VL share HF's video
    processor class but not their timestamps)."""
    sampler = sampler_for_variant(variant)
    files = [] if path is None else [os.path.join(path, f) for f in (VIDEO_CONFIG_FILE, "preprocessor_config.json")]
    found = next((f for f in files if os.path.isfile(f)), None)
    base = {"video_processor_type": "Qwen3VLVideoProcessor" if sampler == "qwen3-vl" else "Qwen2VLVideoProcessor"}
    vp = PreprocessConfig.from_hf(found if found else base, video=True)
    return vp if sampler is None else dataclasses.replace(vp, video_sampler=sampler)


# ---- one value for all of a tower's preprocessing -----------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Preprocessing:
    """A tower's preprocessing as one value: `image` and `video` settings and the tower `variant`
    (its image processor's resize rule and row order). An encoder's is `enc.preprocessing`;
    `qvj.data.load` and `encode_files` take it as it is."""

    image: PreprocessConfig
    video: PreprocessConfig
    variant: str

    def __post_init__(self):
        for name in ("image", "video"):
            if not isinstance(getattr(self, name), PreprocessConfig):
                raise ValueError(f"Preprocessing.{name} must be a PreprocessConfig, got {getattr(self, name)!r}")
        if not isinstance(self.variant, str) or not self.variant:
            raise ValueError(f"Preprocessing.variant must be a tower variant name, got {self.variant!r}")

    @classmethod
    def defaults(cls, variant: str) -> Preprocessing:
        """HF's processor class defaults for a tower variant (no checkpoint files)."""
        return cls(image=image_config_for(variant), video=video_config_for(None, variant), variant=variant)

    def with_limits(
        self,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        *,
        fps: float | None = None,
        num_frames: int | None = None,
        max_frames: int | None = None,
        **video,
    ) -> Preprocessing:
        """These settings with other pixel limits (images' and videos' alike) and another video
        sampling: the one place that says what a request's (or `encode`'s flags') fps= /
        num_frames= / max_frames= do to a config. None leaves a setting as it is.

        fps, num_frames: sample each video so (exclusive): `do_sample_frames` on, the other off.
        max_frames: at most this many frames per video.
        video: other video fields as given (e.g. min_frames=2).
        """
        if fps is not None and num_frames is not None:
            raise ValueError("fps and num_frames are mutually exclusive: pass one")
        limits = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        sampling = {} if max_frames is None else {"max_frames": max_frames}
        if fps is not None or num_frames is not None:
            sampling.update(do_sample_frames=True, fps=None if fps is None else float(fps), num_frames=num_frames)
        return dataclasses.replace(
            self,
            image=dataclasses.replace(self.image, **limits) if limits else self.image,
            video=dataclasses.replace(self.video, **limits, **{**sampling, **video}),
        )


def preprocessing_from(
    preprocessing: Preprocessing | None, variant: str, old: dict[str, PreprocessConfig | str | None], caller: str
) -> Preprocessing:
    """`preprocessing`, or one made of the deprecated keywords in `old` (name -> value, in the order
    image config, video config[, variant]; None where not given), with a DeprecationWarning naming
    them; HF's defaults for `variant` fill what neither gives."""
    given = [k for k, v in old.items() if v is not None]
    if not given:
        return preprocessing if preprocessing is not None else Preprocessing.defaults(variant)
    if preprocessing is not None:
        raise ValueError(f"{caller}: pass preprocessing= or {' / '.join(given)}, not both")
    import warnings

    warnings.warn(
        f"{caller}: {', '.join(f'{k}=' for k in given)} are deprecated; pass "
        "preprocessing=qvj.Preprocessing(image=..., video=..., variant=...) (an encoder's: enc.preprocessing)",
        DeprecationWarning,
        stacklevel=3,
    )
    image, video, *rest = old.values()
    variant = (rest[0] if rest else None) or variant
    base = Preprocessing.defaults(variant)
    return Preprocessing(image=image or base.image, video=video or base.video, variant=variant)
