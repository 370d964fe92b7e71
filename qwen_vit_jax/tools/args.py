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


def load_encoder(checkpoint: str, dtype: str, compile_cache: str | None = None):
    """VisionEncoder.from_pretrained on all of this process's devices (frames balanced across
    them when there are several). checkpoint: a converted dir, an HF dir or a cached hub id."""
    import jax

    from qwen_vit_jax.runtime.encoder import VisionEncoder

    devices = jax.local_devices()
    return VisionEncoder.from_pretrained(
        checkpoint, dtype=dtype, compilation_cache_dir=compile_cache, devices=devices if len(devices) > 1 else None
    )


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
Encode images and videos (files, folders, webdataset .tar shards, .parquet files with an image
column, HF datasets) with a checkpoint and write every input's merged-token embeddings to one file,
atomically (a temporary file renamed into place). Images follow the checkpoint's
preprocessor_config.json (HF's defaults without one), EXIF orientation applied. Videos (told apart
by extension, else by content; decoding needs PyAV: pip install 'qwen_vit_jax[video]') are
decoded, sampled and sized as HF's video processor for the checkpoint does (its
video_preprocessor_config.json, else preprocessor_config.json): --fps, --num-frames and
--max-frames override its sampling; one progress line per video on stderr.

inputs, each detected by what it is (parquet and HF datasets need pip install 'qwen_vit_jax[data]'):
  files and folders   image and video files; a folder's images, videos, .tar and .parquet files
  NAME.tar            a webdataset shard: a sample's key is its __key__, its image the jpg / jpeg /
                      png / webp member, its video the mp4 / webm member (uncompressed tar)
  NAME.parquet        a row per input: --image-column (default image) holds the bytes or HF's
                      {{bytes, path}} struct; the key is --key-column's value, else NAME.parquet:ROW
  HF datasets         a folder written by datasets' save_to_disk (every split), or hf:NAME[:SPLIT]
                      from the local HF cache (offline: nothing is downloaded); keys SPLIT:ROW
  glob patterns       'shards/train-*.tar' (quoted: expanded here, sorted), and lists of all these
Every key must be unique (an error names the duplicates; --allow-duplicate-keys encodes them all).
A bad record is named by its shard and key.

{LAYOUT}
unreadable inputs: an input that cannot be decoded or preprocessed (a corrupt or truncated video,
say) stops the run with an error naming it; the inputs finished before it are written. With
--keep-going it is skipped with a warning instead, the others are encoded and written, and the
exit status is 1. Fix or remove the file, then rerun the same command with --resume to add it.

interruptions and --resume: what is done is saved every 10 minutes, on Ctrl-C / SIGTERM and when
a worker dies; the same command with --resume encodes exactly the inputs whose keys OUT does not
hold yet, so that after any interruption (or a crash: then at most 10 minutes are lost) every key
is in OUT once, with the bits of a clean run. The .safetensors / .npz forms hold the embeddings in
memory until written (4 bytes x tokens x D: ~2.7 MB for a 512x512 image with the 3B tower's
D = 2048); .parquet writes them as it goes (OUT.parquet.parts/, merged into OUT at the end), its
memory flat in the dataset's size: use it for large datasets.

the same bytes twice: an input whose bytes (sha256) appeared earlier in the run is not encoded
again: its row copies the first one's (the summary counts encoded and reused inputs). --cache DIR
keeps every embedding keyed by the checkpoint's files, the dtype, the preprocessing and the sha256
of the input's bytes, so that a later run reads what it has seen; an entry that fails its checksum
is recomputed, never returned.

devices: all of this process's devices (jax.local_devices()) share each call, frames balanced
across them; --batch-patches defaults to 16384 patches per device.

several processes / hosts: run the same command on the same inputs in every process, with
--coordinator HOST:PORT --num-processes N --process-id I (or --distributed under SLURM, Open MPI,
a Cloud TPU slice or Kubernetes). Files are cut into N consecutive slices of nearly equal patch
count; dataset records by whole shards (tar / parquet / arrow files, when there are at least N),
else by consecutive row ranges. Process I writes OUT-stem-0000I-of-0000N.suffix (e.g.
emb-00001-of-00002.parquet), and process 0, once every shard exists, OUT.index.json.
qwen_vit_jax.read_embeddings(OUT) reads the set in input order. --resume reads every process's
shard, so each key is encoded once in the whole set; unreadable inputs are skipped as with
--keep-going. See docs/multi_device.md, and docs/scale.md for Ray Data.
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
