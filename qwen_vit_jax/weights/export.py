"""Our tower back into the HF layout, beside an existing checkpoint: `export_hf(model, out_dir,
like=hf_dir)` and `qwen-vit-jax export MODEL_DIR OUT_DIR --like HF_DIR`.

The output is `like` with the vision tensors replaced:
  * every vision tensor of `like` is taken from the model (keys.py's key table run backwards:
    kernels [in, out] -> torch [out, in], the patch kernel [P, D] -> Conv3d [D, C, T, p, p], row l
    of a stacked [L, ...] param -> block l) and stored in that tensor's own dtype, at the same
    place in the same shard: the shard's header is kept byte for byte, only the vision tensors'
    data bytes are rewritten. An unchanged model therefore round-trips bit for bit, bf16 included
    (bf16 -> float32 -> bf16 is exact);
  * every other tensor is byte-identical (its bytes are never touched); shards that hold no vision
    tensor are hard-linked (copied across file systems), the index is kept as it is;
  * every other top-level file (config.json, generation_config.json, tokenizer and processor
    files, chat template) is copied unchanged.
The model's config must equal `like`'s vision config, and every one of the model's parameters
must land in exactly one tensor of `like` (and the other way round): otherwise ValueError.
LoRA adapters (lora.py) are merged into the exported weights; the model itself is not changed.
The write is atomic: a temporary sibling directory, fsynced and renamed into place; any failure
removes it. No torch, transformers or jax import at module level (jax only to read the model).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil

import numpy as np

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.files import atomic_dir, fsync
from qwen_vit_jax.weights.hf_read import CONFIG_FILE, copy_into, locate_tensors, vision_prefix
from qwen_vit_jax.weights.keys import INVERSE, RULES, Rule, dims_to_shape, expected_param_shapes
from qwen_vit_jax.weights.safetensors_io import ST_DTYPES, CheckpointError, SafetensorsFile
from qwen_vit_jax.weights.sources import CONVERTED, resolve_source


def hf_tensors_for(cfg: VisionConfig, keys: list[str], prefix: str, where: str) -> dict[str, tuple[Rule, int | None]]:
    """Each HF vision key of `keys` (matched without `prefix`) -> (rule, row), strictly: every key
    matches one rule and an existing row, and every param row of the config is claimed once.

    Raises CheckpointError naming the key (unknown, or claimed twice) or the param row left over.
    """
    rules = [(re.compile(r.pattern), r) for r in RULES if cfg.variant in r.variants]
    rules = [(rx, r) for rx, r in rules if not (r.per_block and r.rows(cfg) == 0)]
    out: dict[str, tuple[Rule, int | None]] = {}
    claimed: dict[tuple[str, int | None], str] = {}
    for key in keys:
        hits = [(r, m) for rx, r in rules if (m := rx.fullmatch(key[len(prefix) :]))]
        if len(hits) != 1:
            raise CheckpointError(f"{where}: vision tensor {key!r} matches {len(hits)} {cfg.variant} parameters")
        rule, m = hits[0]
        row = int(m[rule.stack]) if rule.per_block else None
        if row is not None and row >= rule.rows(cfg):
            raise CheckpointError(f"{where}: vision tensor {key!r}: row {row} >= {rule.rows(cfg)} of {rule.target}")
        if (rule.target, row) in claimed:
            raise CheckpointError(f"{where}: {key!r} and {claimed[rule.target, row]!r} both map to {rule.target}")
        claimed[rule.target, row] = key
        out[key] = (rule, row)
    left = [
        f"{r.target}" + ("" if i is None else f"[{i}]")
        for _, r in rules
        for i in (range(r.rows(cfg)) if r.per_block else [None])
        if (r.target, i) not in claimed
    ]
    if left:
        raise CheckpointError(f"{where}: no tensor for the model's {', '.join(left[:10])}")
    return out


def hf_tensor(rule: Rule, row: int | None, params: dict[str, np.ndarray], cfg: VisionConfig) -> np.ndarray:
    """Our param (row `row` of a stacked one) as the HF tensor of `rule`, still in our dtype."""
    w = np.asarray(params[rule.target])
    w = w if row is None else w[row]
    if w.dtype == np.uint16:  # bf16 weights held as bits (model.as_bits): reinterpret, exactly
        w = w.view(ST_DTYPES["BF16"])
    dst, src = dims_to_shape(rule.dst, cfg), dims_to_shape(rule.src, cfg)
    if rule.target.startswith("blocks.mlp.") and w.shape != dst and w.ndim == len(dst):
        # A tower built for a TPU stores the MLP's hidden width rounded up (Numerics.mlp_multiple)
        # with zero rows / columns, which stay zero in training (their activations and gradients
        # are zero): crop them back, refusing anything non-zero.
        crop = tuple(slice(0, d) for d in dst)
        rest = w.copy()
        rest[crop] = 0
        if any(a < d for a, d in zip(w.shape, dst)) or np.any(rest):
            raise ValueError(f"{rule.target}[{row}]: shape {w.shape} is not {dst} plus zero padding")
        w = w[crop]
    if w.shape != dst:
        raise ValueError(f"{rule.target}" + ("" if row is None else f"[{row}]") + f": shape {w.shape}, expected {dst}")
    return INVERSE[rule.transform](w, src)


def _check_out(out: pathlib.Path, like: pathlib.Path, overwrite: bool) -> None:
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise FileExistsError(f"output directory exists: {out} (overwrite / --overwrite replaces it)")
    same = out.resolve() == like.resolve() or like.resolve().is_relative_to(out.resolve())
    if same or out.is_symlink() or not out.is_dir():
        raise FileExistsError(f"{out} is not an earlier export (or is the source checkpoint); not replacing it")
    if any(out.iterdir()) and not (out / CONFIG_FILE).is_file():
        raise FileExistsError(f"{out} is not an HF checkpoint directory (no {CONFIG_FILE}); not replacing it")


def _carry(src: pathlib.Path, dst: pathlib.Path, link: bool) -> None:
    """dst: a hard link to src's file (a hub snapshot's symlink is followed to its blob), else a copy."""
    real = src.resolve()
    if link:
        try:
            os.link(real, dst)
            return
        except OSError:  # another file system, or links not allowed: copy
            pass
    shutil.copyfile(real, dst)
    fsync(dst)


def export_params(
    cfg: VisionConfig,
    params: dict[str, np.ndarray],
    out_dir: str | os.PathLike,
    *,
    like: str | os.PathLike,
    overwrite: bool = False,
    link: bool = True,
) -> pathlib.Path:
    """`like` (an HF checkpoint dir or a hub id in the local cache) with its vision tensors replaced
    by `params` (our flat params, as `load_source` / `convert.load_converted` return them), written
    atomically into `out_dir`. See the module docstring for what is kept.

    Args:
      cfg: the tower's config; must equal `like`'s vision config.
      params: flat params, e.g. `blocks.attn.qkv.kernel` [L, D, 3D] (any float dtype).
      out_dir: the new checkpoint directory (must not exist unless `overwrite`).
      like: the HF checkpoint to take the layout, the other tensors and the other files from.
      overwrite: replace an existing `out_dir` (an earlier export: a directory with config.json).
      link: hard-link the shards that hold no vision tensor (False: copy them).
    Returns:
      out_dir as a Path.
    Raises:
      ValueError (CheckpointError) for a config or parameter mismatch, naming the field or tensor;
      FileNotFoundError / FileExistsError for the paths.
    """
    src = resolve_source(like)
    if src.kind == CONVERTED:
        raise ValueError(f"like= must be an HF checkpoint, not a {src.kind} qwen_vit_jax directory: {like}")
    hf_dir, out = src.path, pathlib.Path(out_dir)
    theirs = VisionConfig.from_hf(hf_dir)
    if theirs != cfg:
        diff = [
            f"{f}: model {getattr(cfg, f)!r} vs like {getattr(theirs, f)!r}"
            for f in cfg.__dataclass_fields__
            if getattr(cfg, f) != getattr(theirs, f)
        ]
        raise ValueError(f"the model's tower differs from {hf_dir}'s vision config: {'; '.join(diff)}")
    shapes = expected_param_shapes(cfg)
    params = dict(params)  # each tensor read once (a converted checkpoint's are read when looked up)
    bad = sorted(set(shapes) ^ set(params))
    if bad:
        raise ValueError(f"params do not match the {cfg.variant} config: {', '.join(bad[:10])}")
    _check_out(out, hf_dir, overwrite)

    where, _ = locate_tensors(hf_dir)
    prefix = vision_prefix(where, hf_dir)
    vision = sorted(k for k in where if k.startswith(prefix))
    mapping = hf_tensors_for(cfg, vision, prefix, str(hf_dir))
    by_file: dict[pathlib.Path, list[str]] = {}
    for key in vision:
        by_file.setdefault(where[key], []).append(key)

    with atomic_dir(out) as tmp:
        for path, keys in by_file.items():  # shards holding vision tensors: copy, then rewrite in place
            f = SafetensorsFile(path)
            dst = tmp / path.name
            shutil.copyfile(path.resolve(), dst)
            with open(dst, "r+b") as w:
                for key in keys:
                    if key not in f.entries:
                        raise CheckpointError(f"{path}: the index places tensor {key!r} here, but the file lacks it")
                    st, shape, begin, end = f.entries[key]
                    a = hf_tensor(*mapping[key], params, cfg)
                    if a.shape != shape:
                        raise CheckpointError(f"{path}: tensor {key!r} has shape {shape}, the model's is {a.shape}")
                    b = np.empty(a.shape, ST_DTYPES[st])
                    copy_into(b, a)  # a Linear weight arrives transposed
                    a = b.view(np.uint8).reshape(-1)
                    assert a.size == end - begin  # dtype and shape equal: the bytes fit the slot exactly
                    w.seek(f.data_start + begin)
                    w.write(a.data)
                w.flush()
                os.fsync(w.fileno())
        for path in sorted(hf_dir.iterdir()):  # everything else at the top level, as it is
            if path.name.startswith(".") or not path.is_file() or (tmp / path.name).exists():
                continue
            _carry(path, tmp / path.name, link and path.suffix == ".safetensors")
    return out


def model_params(model) -> dict[str, np.ndarray]:
    """The model's flat params as host arrays, LoRA adapters merged (the model is not changed)."""
    from qwen_vit_jax.model.lora import merged_params

    return {k: np.asarray(v) for k, v in merged_params(model).items()}


def export_hf(
    model, out_dir: str | os.PathLike, *, like: str | os.PathLike, overwrite: bool = False, link: bool = True
) -> pathlib.Path:
    """Write `model` (a `load_model` tower, LoRA adapters merged first) as a complete HF checkpoint
    laid out like `like`: its vision tensors from the model in their own dtype, everything else
    byte-identical (module docstring). Atomic; returns `out_dir` as a Path.

    Args:
      model: the `VisionTransformer` (any dtype; with or without `add_lora` adapters).
      out_dir: the new checkpoint directory (must not exist unless `overwrite`).
      like: the HF checkpoint directory (or hub id in the local cache) the model came from.
      link: hard-link the shards without vision tensors (False: copy them).
    """
    return export_params(model.cfg, model_params(model), out_dir, like=like, overwrite=overwrite, link=link)
