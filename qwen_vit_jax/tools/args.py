"""What the `qwen-vit-jax` commands share: the program name, the error a command reports,
`--sizes` parsing, the options several commands take (defined once here) and the commands' longer
help texts. Light on purpose: building the parser (and `--help`) imports no jax, flax or model code.
"""

from __future__ import annotations

import argparse

from qwen_vit_jax.data.embeddings import LAYOUT
from qwen_vit_jax.families import DTYPE_NAMES

PROG = "qwen-vit-jax"
TOWERS = (
    "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Qwen4-Exp, Qwen3-VL-MoE, Qwen3.5-MoE, Qwen3-Omni, Qwen2.5-Omni, "
    "PaddleOCR-VL, GLM-4.1V and GLM-4.5V"
)


class CommandError(ValueError):
    """A failure to report as `error: <message>` with exit status 1."""


def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    """ "16x16,2x36x36" -> [(1, 16, 16), (2, 36, 36)]: HxW (an image) or TxHxW (a video), in patches."""
    sizes = []
    for item in text.split(","):
        try:
            dims = [int(v) for v in item.strip().lower().split("x")]
        except ValueError:
            dims = []
        if len(dims) not in (2, 3) or min(dims) <= 0:
            raise CommandError(f"--sizes: {item.strip()!r} is not HxW or TxHxW in patches (e.g. 16x16, 2x36x36)")
        sizes.append(tuple(dims) if len(dims) == 3 else (1, *dims))
    return sizes


# ---- options several commands take ----------------------------------------------------------------
def add_checkpoint(p: argparse.ArgumentParser, name: str = "checkpoint", metavar: str = "CKPT") -> None:
    p.add_argument(name, metavar=metavar, help="converted dir, HF checkpoint dir or hub id in the local cache")


def add_dtype(p: argparse.ArgumentParser, default: str | None = "float32", help: str = "compute dtype") -> None:
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=default, help=f"{help} (default {default})")


def add_compile_cache(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="keep compiled programs in DIR (JAX's persistent compilation cache): a later run "
        "loads them instead of compiling",
    )


def add_overwrite(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace an earlier {what}")


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

ENCODE_HELP = f"""\
Encode image and video files (or folders of them) with a converted checkpoint and write every
input's merged-token embeddings to one file, atomically (a temporary file renamed into place).
Images follow the checkpoint's preprocessor_config.json (HF's defaults without one), EXIF
orientation applied. Videos (told apart by extension, else by content; decoding needs PyAV:
pip install 'qwen_vit_jax[video]') are decoded, sampled and sized as HF's video processor for the
checkpoint does (its video_preprocessor_config.json, else preprocessor_config.json): --fps,
--num-frames and --max-frames override its sampling; one progress line per video on stderr.

{LAYOUT}
unreadable inputs: a file that cannot be decoded or preprocessed (a corrupt or truncated video,
say) stops the run with an error naming it; the inputs finished before it are written. With
--keep-going it is skipped with a warning instead, the others are encoded and written, and the
exit status is 1. Fix or remove the file, then rerun the same command with --resume to add it.

interruptions: OUT is rewritten with the inputs done so far every 10 minutes and on Ctrl-C;
the same command with --resume continues from there. The embeddings are held in memory until
written (4 bytes x tokens x D: ~2.7 MB for a 512x512 image with the 3B tower's D = 2048), so
encode very large collections into several files.

devices: all of this process's devices (jax.local_devices()) share each call, frames balanced
across them; --batch-patches defaults to 16384 patches per device.

several processes / hosts: run the same command on the same inputs in every process, with
--coordinator HOST:PORT --num-processes N --process-id I (or --distributed under SLURM, Open MPI,
a Cloud TPU slice or Kubernetes). The inputs are cut into N consecutive slices of nearly equal
patch count; process I writes OUT-stem-0000I-of-0000N.suffix (e.g. emb-00001-of-00002.safetensors),
and process 0, once every shard exists, OUT.index.json. qwen_vit_jax.read_embeddings(OUT) reads
the set in input order. --resume works per shard (same inputs, same N); unreadable inputs are
skipped as with --keep-going. See docs/multi_device.md.
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
calls (host planning, transfer, compute and fetch; no image preprocessing).
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
