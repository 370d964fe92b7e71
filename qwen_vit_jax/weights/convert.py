"""Our converted directory: `convert_checkpoint` writes it from an HF checkpoint (hf_read.py),
`load_converted` reads it back.

A converted directory holds:
  config.json                {"format": "qwen_vit_jax", "format_version": 1, "vision_config": ...,
                              "source": {"hf_dir": ..., "keys_prefix": ...}, "dtype": ...}
  params.safetensors         flat NNX paths, blocks stacked over depth, deepstack mergers stacked
                             over their taps, kernels [in, out] (weights/keys.py)
  preprocessor_config.json   copied from the HF directory when present
  video_preprocessor_config.json   likewise (Qwen3-VL checkpoints ship one)
  hf_config.json             the HF config.json as it was: the language model's inputs (prompt/)
                             read its token ids and position rules from it
No torch, transformers or jax is imported here.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

from qwen_vit_jax.config import DTYPES, VisionConfig
from qwen_vit_jax.files import atomic_dir, fsync
from qwen_vit_jax.weights.hf_read import CONFIG_FILE, read_hf_vision
from qwen_vit_jax.weights.keys import expected_param_shapes
from qwen_vit_jax.weights.safetensors_io import (
    PARAM_DTYPES,
    ST_DTYPES,
    CheckpointError,
    LazyTensors,
    SafetensorsFile,
    write_safetensors,
)

FORMAT, FORMAT_VERSION = "qwen_vit_jax", 1
PARAMS_FILE, PREPROCESSOR_FILE = "params.safetensors", "preprocessor_config.json"
VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
HF_CONFIG_FILE = "hf_config.json"


def _check_replaceable(out: pathlib.Path, hf_dir) -> None:
    """Refuse to delete anything that is not an earlier output of ours (or an empty directory)."""
    ours = out.is_dir() and not out.is_symlink() and out.resolve() != pathlib.Path(hf_dir).resolve()
    if ours and any(out.iterdir()):
        try:
            ours = json.loads((out / CONFIG_FILE).read_text()).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            ours = False
    if not ours:
        raise FileExistsError(f"{out} exists and is not a {FORMAT} output directory; not replacing it")


def convert_checkpoint(
    hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | None = None, overwrite: bool = False
) -> pathlib.Path:
    """Convert an HF checkpoint's vision tower into `out_dir`, atomically.

    dtype: None keeps the checkpoint's dtype (bit-exact), "float32" / "bfloat16" cast.
    Everything is written into a temporary sibling directory, fsynced and renamed into place; on
    any failure it is removed, so nothing is left behind. An existing `out_dir` raises
    FileExistsError unless `overwrite` (it must then be an earlier output of ours, or empty).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be None or one of {tuple(DTYPES)}, got {dtype!r}")
    hf_dir, out = pathlib.Path(hf_dir), pathlib.Path(out_dir)
    if os.path.lexists(out):  # before reading a possibly huge checkpoint
        if not overwrite:
            raise FileExistsError(f"output directory exists: {out} (overwrite / --overwrite replaces it)")
        _check_replaceable(out, hf_dir)
    cfg, params, prefix = read_hf_vision(hf_dir)
    if dtype is not None:
        params = {k: v.astype(DTYPES[dtype], copy=False) for k, v in params.items()}
    names = sorted({v.dtype.name for v in params.values()})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "vision_config": cfg.to_dict(),
        "source": {"hf_dir": str(hf_dir.resolve()), "keys_prefix": prefix},
        "dtype": names[0] if len(names) == 1 else "mixed",
    }

    with atomic_dir(out) as tmp:
        write_safetensors(tmp / PARAMS_FILE, params, {"format": FORMAT, "version": str(FORMAT_VERSION)})
        with open(tmp / CONFIG_FILE, "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        for name, dest in ((PREPROCESSOR_FILE,) * 2, (VIDEO_PREPROCESSOR_FILE,) * 2, (CONFIG_FILE, HF_CONFIG_FILE)):
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, tmp / dest)
                fsync(tmp / dest)
    return out


def load_converted(out_dir: str | os.PathLike) -> tuple[VisionConfig, LazyTensors, dict]:
    """Load a converted directory: (cfg, params, config.json dict). params is a mapping that reads
    each tensor from params.safetensors when it is looked up (names, shapes and dtypes are checked
    from the header first).

    Raises FileNotFoundError for a missing directory or file, CheckpointError when the format
    marker, version, config or the param set (names, shapes, float dtypes) is wrong.
    """
    out = pathlib.Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"converted checkpoint directory not found: {out}")
    config_path, params_path = out / CONFIG_FILE, out / PARAMS_FILE
    for p in (config_path, params_path):
        if not p.is_file():
            raise FileNotFoundError(f"missing {p}")
    try:
        meta = json.loads(config_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f'{config_path}: not a {FORMAT} config (no "format": "{FORMAT}")')
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{config_path}: format_version {meta.get('format_version')!r}, this code reads {FORMAT_VERSION}"
        )
    try:
        cfg = VisionConfig.from_dict(meta["vision_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{config_path}: bad vision_config ({e})") from None
    params = LazyTensors(SafetensorsFile(params_path))
    shapes = expected_param_shapes(cfg)
    problems = [f"missing {k}" for k in sorted(set(shapes) - set(params))]
    problems += [f"unexpected {k}" for k in sorted(set(params) - set(shapes))]
    problems += [
        f"{k}: shape {params.shape(k)}, expected {s}" for k, s in shapes.items() if k in params and params.shape(k) != s
    ]
    problems += [
        f"{k}: dtype {_numpy_name(params.dtype_name(k))} is not a float dtype"
        for k in params
        if params.dtype_name(k) not in PARAM_DTYPES
    ]
    if problems:
        raise CheckpointError(
            f"{params_path}: params do not match the {cfg.variant} config: "
            + "; ".join(problems[:10])
            + (" ..." if len(problems) > 10 else "")
        )
    return cfg, params, meta


def _numpy_name(st: str) -> str:
    """A safetensors dtype by numpy's name ("I32" -> "int32"), or as it is."""
    return ST_DTYPES[st].name if st in ST_DTYPES else st
