"""Reading an HF checkpoint's vision tower into our flat params, strictly, through the key table.

Reading touches only the vision tensors: safetensors headers (or the shard index) say where each
tensor lives, only shards holding vision keys are opened, and tensors are read one at a time (a
72B checkpoint is ~144 GB, its vision tower ~1.3 GB). Every HF vision key must match exactly one
rule of `keys.RULES`, every one of our params (and every row of a stacked param: one per block, or
one per deepstack merger) must be filled exactly once, and shapes are checked before and after
each transform; anything else raises `CheckpointError`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Iterable

import numpy as np

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.families import PADDLEOCR_VL
from qwen_vit_jax.weights.keys import PROJECTOR_PREFIXES, RULES, dims_to_shape, expected_param_shapes
from qwen_vit_jax.weights.safetensors_io import PARAM_DTYPES, CheckpointError, SafetensorsFile, unique_keys

CONFIG_FILE = "config.json"

# hub / transformers 5.x saves, some 4.5x saves (and the MoE / Qwen4-Exp hub files), the Omni thinkers
_PREFIXES = ("visual.", "model.visual.", "thinker.visual.")
_BARE_ROOTS = ("patch_embed.", "blocks.", "merger.", "vision_model.")  # a vision-only checkpoint (any of its keys)


def locate_tensors(hf_dir: pathlib.Path) -> tuple[dict[str, pathlib.Path], dict[pathlib.Path, SafetensorsFile]]:
    """Every tensor name -> the file holding it, from model.safetensors' header or the shard index.

    Returns the map and the files already opened on the way (the single-file case).
    """
    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if single.is_file():  # transformers prefers it too when both exist
        f = SafetensorsFile(single)
        return dict.fromkeys(f.entries, single), {single: f}
    if not index.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {hf_dir}")
    try:
        d = json.loads(index.read_text(), object_pairs_hook=unique_keys)
    except ValueError as e:
        raise CheckpointError(f"{index}: not a valid JSON index ({e})") from None
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{index}: no 'weight_map' object of tensor name -> shard file name")
    odd = sorted({v for v in wm.values() if pathlib.PurePath(v).name != v or v in ("", ".", "..")})
    if odd:
        raise CheckpointError(f"{index}: shard names must be plain file names, got {odd[:3]}")
    return {k: hf_dir / v for k, v in wm.items()}, {}


def vision_prefix(keys: Iterable[str], where: pathlib.Path) -> str:
    keys = list(keys)
    found = {p: k for p in _PREFIXES for k in keys if k.startswith(p)}
    if len(found) > 1:
        raise CheckpointError(
            f"{where}: tensors under several tower prefixes are present (e.g. "
            + ", ".join(f"{k!r}" for k in found.values())
            + "): which is the tower?"
        )
    if found:
        return next(iter(found))
    if any(k.startswith(_BARE_ROOTS) for k in keys):
        return ""  # vision-only checkpoint: then every tensor in it must be a vision tensor
    raise CheckpointError(
        f"{where}: no vision tensors (keys under 'visual.', 'model.visual.', 'thinker.visual.' or bare "
        "'patch_embed.' / 'blocks.' / 'merger.')"
    )


def read_hf_vision(hf_dir: str | os.PathLike) -> tuple[VisionConfig, dict[str, np.ndarray], str]:
    """(cfg, our flat params in the source dtype, the tower's key prefix) of an HF checkpoint dir."""
    hf_dir = pathlib.Path(hf_dir)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"HF checkpoint directory not found: {hf_dir}")
    config_path = hf_dir / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in the HF checkpoint directory: {config_path}")
    try:
        cfg = VisionConfig.from_hf(config_path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    where, files = locate_tensors(hf_dir)
    prefix = vision_prefix(where, hf_dir)
    rules = [(re.compile(r.pattern), r) for r in RULES if r.applies(cfg)]

    # Pass 1, names only: every vision key maps to exactly one rule and an existing block.
    matched, unknown = [], []
    local = {k: k[len(prefix) :] for k in where if k.startswith(prefix)}  # key -> name the rules match
    if cfg.variant == PADDLEOCR_VL:
        local |= _projector_names(where, hf_dir)
    for key in sorted(local):
        hits = [(r, m) for rx, r in rules if (m := rx.fullmatch(local[key]))]
        rule = hits[0][0] if len(hits) == 1 else None
        layer = int(hits[0][1][rule.stack]) if rule is not None and rule.per_block else None
        if len(hits) != 1:
            unknown.append(f"{key!r} in {where[key]}" + (" (matches several rules)" if hits else ""))
        elif layer is not None and layer >= rule.rows(cfg):
            what = ("block", "depth") if rule.stack == "layer" else ("deepstack merger", "deepstack layers")
            unknown.append(f"{key!r} in {where[key]} ({what[0]} {layer} >= {what[1]} {rule.rows(cfg)})")
        else:
            matched.append((key, hits[0][0], layer))
    if unknown:
        raise CheckpointError(
            f"{hf_dir}: {len(unknown)} vision tensor(s) match no {cfg.variant} parameter: "
            + "; ".join(unknown[:10])
            + (" ..." if len(unknown) > 10 else "")
        )

    # Pass 2: open only the files holding vision tensors, check, transform, fill.
    shapes = expected_param_shapes(cfg)
    params: dict[str, np.ndarray] = {}
    filled: dict[tuple[str, int | None], str] = {}
    for key, rule, layer in matched:
        path = where[key]
        f = files[path] if path in files else files.setdefault(path, SafetensorsFile(path))
        if key not in f.entries:
            raise CheckpointError(f"{path}: the index places tensor {key!r} here, but the file lacks it")
        loc = f"{path}: tensor {key!r}"
        st, shape = f.entries[key][:2]
        src, dst = dims_to_shape(rule.src, cfg), dims_to_shape(rule.dst, cfg)  # dst: per row, per part
        if shape != src:
            raise CheckpointError(f"{loc}: shape {shape}, expected {src} = [{rule.src}] for {cfg.variant}")
        if st not in PARAM_DTYPES:
            raise CheckpointError(f"{loc}: dtype {st} is not one of {PARAM_DTYPES}")
        w = rule.transform(f.get(key), cfg)
        if w.shape != dst:  # a table bug, but never write a wrongly shaped param
            raise CheckpointError(f"{loc}: transformed to {w.shape}, expected {dst} for {rule.target}")
        slot = (rule.target, layer, rule.part)
        if slot in filled:
            what = f"{rule.target}[{layer}]" + ("" if rule.part is None else f" part {rule.part[0]} of {rule.part[1]}")
            raise CheckpointError(f"{loc}: {what} already filled from {filled[slot]!r}")
        filled[slot] = key
        if layer is None and rule.part is None:
            params[rule.target] = np.empty(w.shape, w.dtype)
            copy_into(params[rule.target], w)
            continue
        if rule.target not in params:  # preallocate [L, ...] (or the fused whole) in the source dtype
            params[rule.target] = np.empty(shapes[rule.target], w.dtype)
        stack = params[rule.target]
        if stack.dtype != w.dtype:
            raise CheckpointError(f"{loc}: dtype {w.dtype}, other parts of {rule.target}: {stack.dtype}")
        row = stack if layer is None else stack[layer]  # a view: writes land in the stack
        if rule.part is None:
            copy_into(row, w)
        else:  # the i-th of k column blocks of the last axis
            i, k = rule.part
            width = row.shape[-1] // k
            copy_into(row[..., i * width : (i + 1) * width], w)

    missing = [
        f"{'' if r.pattern.startswith('mlp_AR') else prefix}{r.hf_key(i)} (-> {r.target}"
        + ("" if i is None else f"[{i}]")
        + ")"
        for _, r in rules
        for i in (range(r.rows(cfg)) if r.per_block else [None])
        if (r.target, i, r.part) not in filled
    ]
    if missing:
        raise CheckpointError(
            f"{hf_dir}: {len(missing)} {cfg.variant} vision tensor(s) missing: "
            + "; ".join(missing[:10])
            + (" ..." if len(missing) > 10 else "")
        )
    return cfg, params, prefix


def copy_into(dst: np.ndarray, src: np.ndarray, columns: int = 64) -> None:
    """dst[...] = src, cast to dst's dtype. A transposed matrix (every Linear weight) is copied `columns`
    of its columns at a time: numpy's copy of a whole one misses the cache on every element (up to 5x
    slower at 2B sizes)."""
    if src.ndim != 2 or src.flags.c_contiguous:
        dst[...] = src
        return
    for j in range(0, src.shape[1], columns):
        dst[:, j : j + columns] = src[:, j : j + columns]


def _projector_names(where: dict[str, pathlib.Path], hf_dir) -> dict[str, str]:
    """PaddleOCR-VL's projector tensors (outside the tower's prefix) -> their `mlp_AR.*` names."""
    found = {p: [k for k in where if k.startswith(p)] for p in PROJECTOR_PREFIXES}
    if all(found.values()):
        raise CheckpointError(
            f"{hf_dir}: both 'mlp_AR.*' and 'model.projector.*' tensors are present (e.g. "
            f"{found['mlp_AR.'][0]!r}, {found['model.projector.'][0]!r}): which is the projector?"
        )
    return {k: "mlp_AR." + k[len(p) :] for p, keys in found.items() for k in keys}


def read_hf_vision_params(hf_dir: str | os.PathLike) -> tuple[VisionConfig, dict[str, np.ndarray]]:
    """Read the vision tower of an HF checkpoint directory into our flat params (source dtype kept).

    Returns (cfg, params) with params as in `expected_param_shapes(cfg)`, e.g. for Qwen2.5-VL
    `patch_embed.kernel` [P, D], `blocks.attn.qkv.kernel` [L, D, 3D], `merger.fc2.kernel` [4D, O].
    Raises FileNotFoundError for a missing directory / config.json / shard, CheckpointError otherwise.
    """
    cfg, params, _ = read_hf_vision(hf_dir)
    return cfg, params
