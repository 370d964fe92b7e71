"""What `load_model` and `VisionEncoder.from_pretrained` were given: a converted directory, an HF
checkpoint directory, or a hub repo id in the local HF cache.

  converted dir   config.json with "format": "qwen_vit_jax" + params.safetensors (convert.py)
  HF dir          config.json + model.safetensors or shards with model.safetensors.index.json:
                  the vision tensors are read and converted in memory (keys.py's key table,
                  lazily: shards holding only text weights are never opened); nothing is written
  hub id          "Org/Name" or "Org/Name@revision", looked up only in the local HF cache, laid
                  out as huggingface_hub writes it:
                    $HF_HUB_CACHE/models--Org--Name/refs/<revision>    (a commit hash)
                    $HF_HUB_CACHE/models--Org--Name/snapshots/<commit>/ (an HF dir)
                  The cache is HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
                  else ~/.cache/huggingface/hub (huggingface_hub's own order). Never the network:
                  an id that is not there raises FileNotFoundError naming the id, the directory
                  searched and the command that downloads it.

An existing path always wins over a hub id of the same spelling. No torch or transformers is
imported here, jax only by `load_model`; huggingface_hub is not needed (the layout is read directly).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re

import numpy as np

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.preprocess.config import PreprocessConfig, image_config_for, video_config_for
from qwen_vit_jax.weights.convert import FORMAT, PREPROCESSOR_FILE, load_converted
from qwen_vit_jax.weights.hf_read import CONFIG_FILE, read_hf_vision_params

CONVERTED, HF_DIR, HUB = "converted", "hf", "hub"
# huggingface_hub's repo id rule: two names of [A-Za-z0-9_.-], no leading/trailing "-" or ".", no
# "--" or ".."; an optional @revision (a branch, tag or commit hash) is ours.
_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[A-Za-z0-9_./-]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclasses.dataclass(frozen=True)
class Source:
    """A resolved source. kind: "converted", "hf" or "hub"; path: the directory to read (for a hub
    id, its snapshot directory, an HF dir); name: what the user passed."""

    kind: str
    path: pathlib.Path
    name: str

    @property
    def preprocessor_config(self) -> pathlib.Path | None:
        """The checkpoint's preprocessor_config.json, when it has one (both layouts keep it)."""
        p = self.path / PREPROCESSOR_FILE
        return p if p.is_file() else None


def hub_cache_dir() -> pathlib.Path:
    """The local HF hub cache, from the environment at call time (tests point HF_HUB_CACHE at a
    temporary directory after import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return pathlib.Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return pathlib.Path(xdg).expanduser() / "huggingface" / "hub"


def is_hub_id(name: str) -> bool:
    """Whether `name` is spelled like a hub repo id ("Org/Name", optionally "@revision")."""
    m = _HUB_ID.fullmatch(name)
    return m is not None and ".." not in m["repo"] and "--" not in m["repo"]


def resolve_hub_id(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The snapshot directory of hub id `name` ("Org/Name" or "Org/Name@revision", default
    revision "main") in the local HF cache; never the network.

    Raises FileNotFoundError naming the id, the directory searched and the download command when
    the repo, the revision or its snapshot is not in the cache.
    """
    m = _HUB_ID.fullmatch(name)
    if m is None or not is_hub_id(name):
        raise ValueError(f"not a hub repo id (Org/Name or Org/Name@revision): {name!r}")
    repo, revision = m["repo"], m["revision"] or "main"
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else hub_cache_dir()
    root = cache / ("models--" + repo.replace("/", "--"))
    download = f"hf download {repo}" + (f" --revision {revision}" if m["revision"] else "")

    def missing(what: str) -> FileNotFoundError:
        return FileNotFoundError(
            f"hub id {name!r}: {what} in the local HF cache (searched {root}; cache from HF_HUB_CACHE / "
            f"HF_HOME). Nothing is downloaded at run time: fetch it first with `{download}`, or pass a "
            "checkpoint directory"
        )

    if not root.is_dir():
        raise missing("not found")
    ref = root / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
    elif _COMMIT.fullmatch(revision):
        commit = revision
    else:
        raise missing(f"no revision {revision!r} (no refs/{revision})")
    snapshot = root / "snapshots" / commit
    if not (snapshot / CONFIG_FILE).is_file():
        raise missing(f"revision {revision!r} -> snapshot {commit} has no {CONFIG_FILE}")
    return snapshot


def resolve_source(source: str | os.PathLike) -> Source:
    """Which of the three kinds `source` is, and the directory to read.

    An existing directory is ours when its config.json says "format": "qwen_vit_jax", an HF
    checkpoint otherwise. A path that does not exist is looked up as a hub id when spelled like one.
    Raises FileNotFoundError for a missing path (or hub id), a directory without config.json.
    """
    name = os.fspath(source)
    path = pathlib.Path(name).expanduser()
    if not path.exists():
        if is_hub_id(name):
            return Source(HUB, resolve_hub_id(name), name)
        raise FileNotFoundError(f"checkpoint not found: {name} (not a directory, and not an Org/Name hub id)")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint must be a directory, got a file: {path}")
    config = path / CONFIG_FILE
    if not config.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in the checkpoint directory {path}")
    try:
        ours = json.loads(config.read_text()).get("format") == FORMAT
    except (ValueError, AttributeError):
        ours = False  # not ours: the HF reader reports what is wrong with it
    return Source(CONVERTED if ours else HF_DIR, path, name)


def load_source(source: str | os.PathLike | Source) -> tuple[VisionConfig, dict[str, np.ndarray], Source]:
    """(cfg, our flat params, the resolved Source) of any of the three kinds.

    Converted: params read from params.safetensors as they are looked up. HF dir / hub id: the vision tensors
    converted in memory into our layout (source dtype kept), e.g. `blocks.attn.qkv.kernel` [L, D, 3D].
    Raises FileNotFoundError / CheckpointError (a ValueError) naming the file and tensor.
    """
    src = source if isinstance(source, Source) else resolve_source(source)
    if src.kind == CONVERTED:
        cfg, params, _ = load_converted(src.path)
    else:
        cfg, params = read_hf_vision_params(src.path)
    return cfg, params, src


def preprocessing(source: str | os.PathLike | Source) -> tuple[str, PreprocessConfig, PreprocessConfig]:
    """(variant, image preprocessing, video preprocessing) of a checkpoint, from its config files
    alone (no weights read): its preprocessor_config.json (HF's defaults for the tower without one)
    and its video config (preprocess.config.video_config_for)."""
    src = source if isinstance(source, Source) else resolve_source(source)
    if src.kind == CONVERTED:
        cfg = VisionConfig.from_dict(json.loads((src.path / CONFIG_FILE).read_text())["vision_config"])
    else:
        cfg = VisionConfig.from_hf(src.path)
    image = PreprocessConfig.from_hf(src.preprocessor_config) if src.preprocessor_config else None
    return cfg.variant, image or image_config_for(cfg.variant), video_config_for(src.path, cfg.variant)


def load_model(path: str | os.PathLike, dtype: str = "float32", device=None, attention: str = "xla"):
    """The tower of `path`, as an `nnx.Module` with `.cfg`: a directory written by
    `convert_checkpoint`, an HF checkpoint directory (converted in memory) or a hub id in the local
    HF cache (see `resolve_source`).

    dtype: "float32" (exact vs HF float32) or "bfloat16" (bf16 matmul operands, float32
    accumulation; norms, rotary, softmax and the residual stream stay float32). The numerics
    follow `device` (default jax.devices()[0]): on CPU, full attention runs its tiles as 2-D dot
    loops, and bf16 dots are native only with avx512_bf16 / AMX (`numerics_for`). attention: "xla"
    (the default) or "kernel", the device's Pallas attention kernel (Triton on an NVIDIA GPU, splash
    on a TPU).
    """
    from qwen_vit_jax.model.numerics import numerics_for  # jax: only when a model is built
    from qwen_vit_jax.model.vit import model_from_params

    num = numerics_for(dtype, device, attention)
    cfg, params, _ = load_source(path)
    return model_from_params(cfg, params, num, device)
