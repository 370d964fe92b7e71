"""What the `qwen-vit-jax` commands share: the program name, the error a command reports,
`--sizes` parsing, the user's cache folder, the options several commands take (defined once here)
and the commands' longer help texts. Light on purpose: building the parser (and `--help`) imports
no jax, flax or model code.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

from qwen_vit_jax.families import DTYPE_NAMES

PROG = "qwen-vit-jax"
TOWERS = (
    "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Qwen4-Exp, Qwen3-VL-MoE, Qwen3.5-MoE, Qwen3-Omni, Qwen2.5-Omni, "
    "PaddleOCR-VL, GLM-4.1V and GLM-4.5V"
)


class CommandError(ValueError):
    """A failure to report as `error: <message>` with exit status 1."""


def command_flags(command: str | None, dests) -> dict[str, str]:
    """A command's keyword -> flag table, from its parsed arguments' names (`vars(args)`): `serve`'s
    are its Settings fields' flags (request_timeout_s -> --timeout), the others' their own names
    (keep_going -> --keep-going)."""
    if command == "serve":
        from qwen_vit_jax.serve.settings import FIELDS, flag

        return {d: flag(d) for d in dests if d in FIELDS}
    return {d: "--" + d.replace("_", "-") for d in dests if d not in ("command", "func")}


_KEYWORD = re.compile(r"\b([a-z][a-z0-9_]*)=(True|False|[^\s,;)]+)")


def in_flags(text: str, flags: dict[str, str], limit: str | None = None) -> str:
    """A library's message in a command's words: each `keyword=value` of one of the command's flags
    spelled as the flag (`keep_going=True` -> `--keep-going`, `fps=2` -> `--fps 2`), and the
    setting the failure is about (an error's `limit`), where the message names it by no flag, added
    as `(--flag)`. The library names keywords; only this edge knows their flags."""

    def spell(m: re.Match) -> str:
        name, value = m[1], m[2]
        if name not in flags:
            return m[0]
        return flags[name] if value == "True" else f"{flags[name]} {value}"

    text = _KEYWORD.sub(spell, text)
    if limit in flags and flags[limit] not in text:
        text += f" ({flags[limit]})"
    return text


def default_cache_dir() -> pathlib.Path:
    """The user's cache folder for this package: $QWEN_VIT_JAX_CACHE, else $XDG_CACHE_HOME/qwen_vit_jax,
    else ~/.cache/qwen_vit_jax (the demo's checkpoints, and compiled programs under jax/)."""
    if os.environ.get("QWEN_VIT_JAX_CACHE"):
        return pathlib.Path(os.environ["QWEN_VIT_JAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "qwen_vit_jax"


# ---- options several commands take ----------------------------------------------------------------
def add_checkpoint(p: argparse.ArgumentParser, name: str = "checkpoint", metavar: str = "CKPT") -> None:
    p.add_argument(name, metavar=metavar, help="converted dir, HF dir or hub id (local cache)")


def add_dtype(p: argparse.ArgumentParser, default: str | None = "float32", help: str = "compute dtype") -> None:
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=default, help=f"{help} (default {default})")


def add_compile_cache(p) -> None:
    """--compile-cache DIR / --no-compile-cache (`compile_cache_dir` reads them)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="programs kept in DIR (~/.cache/qwen_vit_jax/jax)",
    )
    g.add_argument("--no-compile-cache", action="store_true", help="compile every program, keep none")


def compile_cache_dir(args, root: str | os.PathLike | None = None) -> str | None:
    """The persistent compilation cache of a command: on by default, so that a second run of the same
    command compiles nothing (it loads its programs). --compile-cache DIR, else JAX's own
    $JAX_COMPILATION_CACHE_DIR, else `root`/jax (a command's own cache folder, `demo --cache-dir`),
    else `default_cache_dir()`/jax; None with --no-compile-cache (then JAX's cache is switched off for
    this process, $JAX_COMPILATION_CACHE_DIR included)."""
    if args.no_compile_cache:
        import jax

        jax.config.update("jax_enable_compilation_cache", False)
        return None
    root = pathlib.Path(root) if root is not None else default_cache_dir()
    return args.compile_cache or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(root / "jax")


def add_overwrite(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace an earlier {what}")


_loaded = [0]  # programs this process loaded from the persistent compilation cache (`cache_loads`)
_listening: list[bool] = []  # whether `_count_loads` listens to JAX's events


def _count_loads(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _loaded[0] += 1


def cache_loads() -> int:
    """Programs this process has loaded from the persistent compilation cache (instead of compiling
    them) since `load_encoder` switched it on: JAX's own monitoring event, counted."""
    return _loaded[0]


def load_encoder(checkpoint: str, dtype: str, compile_cache: str | None = None):
    """VisionEncoder.from_pretrained on all of this process's devices (frames balanced across
    them when there are several). checkpoint: a converted dir, an HF dir or a cached hub id.
    compile_cache: the persistent compilation cache's folder (`compile_cache_dir`); one that cannot
    be created (a read-only home) is a warning, and the programs are compiled as without it."""
    import jax

    from qwen_vit_jax.runtime.encoder import VisionEncoder, enable_compilation_cache

    if compile_cache is not None:
        try:
            enable_compilation_cache(compile_cache)
        except OSError as e:  # a file where the folder should be stays a ValueError: a usage error
            print(f"warning: compiled programs are not kept: {compile_cache}: {e.strerror or e}", file=sys.stderr)
        else:
            if not _listening:  # once, however many encoders
                jax.monitoring.register_event_listener(_count_loads)
                _listening.append(True)
    return VisionEncoder.from_pretrained(checkpoint, dtype=dtype, devices=jax.local_devices())  # one: a mesh of one


# ---- help texts -----------------------------------------------------------------------------------
CONVERT_HELP = f"""\
Convert the vision tower of an HF checkpoint ({TOWERS}) to qwen_vit_jax params, atomically:
a temporary sibling directory renamed into place, nothing left behind on failure. Only the vision
tensors are read.
"""

EXPORT_HELP = """\
Write a tower (a converted directory, e.g. fine-tuned) as a complete HF checkpoint laid out like
HF_DIR: the vision tensors from MODEL_DIR in HF_DIR's dtypes, every other tensor and file unchanged.
"""

AOT_HELP = """\
Compile the encoder's programs for an accelerator this machine does not have (deviceless, ahead of
time) and print per bucket: compile seconds; argument, output and temp memory per device and
whether the peak fits; matmul FLOPs and bytes moved (our own count over the traced program, loop
bodies times their trip counts); a roofline time at the target's published peaks (an estimate);
and host ops in the program (0 expected). Needs the accel extra: pip install 'qwen_vit_jax[accel]'.
"""

ENCODE_HELP = """\
Encode images, videos and datasets with a checkpoint: every input's merged-token
embeddings to OUT (.safetensors, .npz or .parquet; qwen_vit_jax.read_embeddings
reads them), written atomically. Preprocessing and frame sampling follow the
checkpoint's HF processor configs. What is done is saved every --save-every
seconds: .safetensors and .npz hold every embedding in memory and rewrite OUT
whole at each save, .parquet writes as it goes (the format for long runs). One
run writes an OUT at a time. In full (inputs, output layout, --resume, caches,
faults, several processes): docs/encode.md. With --vllm-store STORE every input
also goes into vLLM's encoder-cache store, -o then optional: docs/vllm.md.
"""

VERIFY_HELP = """\
Run HF transformers' vision tower (float32, weights read from HF_DIR) and ours on the same
random pixel inputs (an image whose sides divide into windows, two images with edge windows,
a 3-frame video) and print, per case, the max abs error, relative Frobenius error and minimum
per-token cosine similarity, against the bars of docs/numerics.md:
  float32:  rel err <= 1e-5 and max abs <= 1e-4 * max|ref|
  bfloat16: min cos >= 0.999 and rel err <= 2e-2       (--bf16; still vs HF float32)
Only the vision tensors are read: a 7B checkpoint's language model is never loaded.
Exit status: 0 if every case passes, 1 if one fails, 2 without torch / transformers.
"""

BENCH_HELP = """\
Time the forward of a checkpoint (converted dir, HF dir or cached hub id) on random inputs.
Per size: the compile time of its bucket's program, and the median wall time of --repeats
calls (host planning, transfer, compute and fetch; no image preprocessing). The same `encode`
call is what the repository's forward suite times beside HF on random real-size towers
(`python -m benchmarks forward`, in a checkout: benchmarks/README.md).
"""

DEMO_HELP = """\
No download: write a random-weight checkpoint in the real HF layout (cached), convert it with
the real converter, preprocess a few generated images, encode them twice (compile, then a warm
call), print shapes, timings and compile counts, and save a picture: each image next to the
first three principal components of its tokens as RGB.
  --variant qwen2.5-vl (default) or qwen3-vl (learned position table, deepstack mergers); the
            same towers as other families write those families' layouts: qwen3-vl-moe,
            qwen3.5-moe, qwen4-exp, qwen3-omni, qwen2.5-omni; paddleocr-vl, glm-4v, glm-4.5v (docs/family.md)
  tiny: a 4-block tower in float32; well under a minute on 2 CPU cores
  full: the variant's released tower (Qwen2.5-VL-3B, alias 3b; Qwen3-VL-8B; the families' presets),
        random bfloat16 weights (1.3 / 1.2 GB on disk), run in bfloat16
"""
