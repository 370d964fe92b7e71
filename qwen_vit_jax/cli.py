"""`qwen-vit-jax`: convert | encode | verify | bench | demo.

    qwen-vit-jax demo                                    # random weights, no download, < 2 min
    qwen-vit-jax convert ~/Qwen2.5-VL-3B-Instruct q3b    # HF checkpoint -> our params
    qwen-vit-jax verify ~/Qwen2.5-VL-3B-Instruct q3b     # vs HF transformers (needs torch)
    qwen-vit-jax encode q3b photos/ clips/ -o emb.safetensors --fps 2
    qwen-vit-jax encode q3b photos/ -o emb.safetensors --coordinator h0:1234 --num-processes 2 --process-id 0
    qwen-vit-jax bench q3b --sizes 16x16,36x36

Argument parsing and command glue. encode's inputs (finding, loading images and videos, the loop
with progress, --keep-going and --resume) are encode_files.py, the embeddings file format
embeddings.py (re-exported here for old users: `qwen_vit_jax.cli.read_embeddings`), several
processes multihost.py.

Every command reports failures as one `error: ...` line on stderr and a non-zero exit status
(1; 2 for bad usage and for `verify` without torch / transformers), never a traceback for a bad
path or input. This module imports jax, torch and the model code only inside the commands that
need them (`verify` alone needs torch and transformers).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

from qwen_vit_jax.batching import Progress  # noqa: F401 (re-exported, its old home)
from qwen_vit_jax.embeddings import (  # noqa: F401 (read_embeddings: re-exported, its old home)
    FORMAT,
    LAYOUT,
    VERSION,
    Embeddings,
    read_embeddings,
    write_embeddings,
)
from qwen_vit_jax.encode_files import (  # noqa: F401 (load_image: re-exported, its old home)
    IMAGE_SUFFIXES,
    VIDEO_SUFFIXES,
    EncodeError,
    encode_files,
    find_inputs,
    input_patches,
    load_image,
    resume_from,
)

PROG = "qwen-vit-jax"


class CommandError(EncodeError):
    """A failure to report as `error: <message>` with exit status 1."""


def _error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


# ---- encode ---------------------------------------------------------------------------------------
def cmd_encode(args) -> int:
    from qwen_vit_jax import multihost
    from qwen_vit_jax.embeddings import check_suffix, index_path, read_names, shard_path, write_index

    out = pathlib.Path(args.output)
    check_suffix(out)
    if not out.parent.is_dir():
        raise CommandError(f"output folder not found: {out.parent}")
    try:  # fail now, not after encoding everything: OUT is written as a temporary sibling
        tempfile.TemporaryFile(dir=out.parent).close()
    except OSError as e:
        raise CommandError(f"output folder {out.parent} is not writable ({e.strerror})") from None
    for flag in ("batch_patches", "num_frames", "max_frames", "fps"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise CommandError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    # before anything touches a device: jax.distributed must start first
    cluster = multihost.initialize(args.coordinator, args.num_processes, args.process_id, args.distributed)
    sharded = cluster.count > 1
    if sharded and out.exists():
        raise CommandError(
            f"{out} exists as a single file, which read_embeddings({out.name}) would read instead "
            "of this run's shards: move or delete it"
        )
    target = shard_path(out, cluster.index, cluster.count) if sharded else out  # what this process writes
    # Every process checks every shard, so that all of them stop here together (on a shared file system).
    shards = [shard_path(out, i, cluster.count) for i in range(cluster.count)] if sharded else [out]
    if (found := [p for p in shards if p.exists()]) and not (args.resume or args.overwrite):
        raise CommandError(f"{found[0]} exists: --resume adds the missing inputs to it, --overwrite replaces it")
    paths = find_inputs(args.inputs, args.recursive)
    if not paths:
        raise CommandError(
            "no input images or videos found (folders are searched for "
            f"{', '.join(sorted(IMAGE_SUFFIXES | VIDEO_SUFFIXES))}; --recursive for sub-folders)"
        )

    enc = _load_encoder(args.checkpoint, args.dtype, args.compile_cache)
    limits = {k: v for k, v in (("min_pixels", args.min_pixels), ("max_pixels", args.max_pixels)) if v is not None}
    image_cfg = dataclasses.replace(enc.preprocess, **limits)
    video_cfg = dataclasses.replace(enc.video_preprocess, **limits, **_sampling(args))
    meta = {
        "format": FORMAT,
        "version": VERSION,
        # a directory by its absolute path, a hub id (not a path) as given
        "checkpoint": str(pathlib.Path(ckpt).resolve()) if os.path.exists(ckpt := args.checkpoint) else ckpt,
        "dtype": enc.dtype,
        "preprocess": image_cfg.to_dict(),
        "video_preprocess": video_cfg.to_dict(),
    }
    old = resume_from(target, meta) if args.resume and target.exists() else None
    done = set() if old is None else set(old.names)
    if args.resume and sharded:  # what the other processes' shards hold is done too
        for i in range(cluster.count):
            if i != cluster.index and shard_path(out, i, cluster.count).exists():
                done.update(read_names(shard_path(out, i, cluster.count)))
    if sharded:  # every process has read the shards before any process writes one
        multihost.barrier("qwen_vit_jax encode: start")
    todo = [p for p in paths if p not in done]
    if args.resume:
        where = f"the shards of {out}" if sharded else str(out)
        print(f"resume: {len(paths) - len(todo)} of {len(paths)} inputs already in {where}", file=sys.stderr)
        if not todo and not sharded:
            print(f"nothing to do: {out} holds all {len(paths)} inputs")
            return 0
    # This process's consecutive slice of the work, slices balanced by patch count (all when alone).
    paths = multihost.share(todo, image_cfg, cluster, lambda p: input_patches(p, image_cfg, video_cfg))
    if sharded:
        print(
            f"process {cluster.index} of {cluster.count}: {len(paths)} of {len(todo)} inputs -> {target}",
            file=sys.stderr,
        )
    # With several processes an unreadable input is skipped, as with --keep-going: every process must
    # reach the end, where the shards are indexed together.
    r = encode_files(
        enc,
        paths,
        target,
        meta,
        old,
        image_cfg=image_cfg,
        video_cfg=video_cfg,
        batch_patches=args.batch_patches or enc.max_batch_patches,
        keep_going=args.keep_going or sharded,
        save_empty=sharded,
    )
    held = len(r.names) + (0 if old is None else len(old.names))
    print(
        f"encoded {len(r.names)} inputs ({r.tokens:,} tokens x {enc.cfg.out_dim}) in {r.seconds:.1f} s "
        f"({len(r.names) / max(r.seconds, 1e-9):.1f} inputs/s on {len(enc.devices)} device(s); "
        f"{enc.compile_count} program(s) compiled in {sum(enc.compile_seconds.values()):.1f} s) -> {target} "
        f"({held} inputs)"
    )
    if sharded:
        multihost.barrier("qwen_vit_jax encode: all shards written")
        if cluster.index == 0:
            write_index(out, cluster.count)
            print(
                f"index: {index_path(out)} lists the {cluster.count} shards; read them with "
                f"qwen_vit_jax.read_embeddings({str(out)!r})"
            )
    if r.failed:
        raise CommandError(
            f"{len(r.failed)} of {len(paths)} inputs could not be read (listed above); "
            f"{target} holds the others: fix or remove them and rerun with --resume"
        )
    return 0


def _sampling(args) -> dict:
    """--fps / --num-frames / --max-frames as video PreprocessConfig fields (what a call's
    fps= / num_frames= / max_frames= do; recorded in OUT's metadata, checked by --resume)."""
    if args.fps is not None and args.num_frames is not None:
        raise CommandError("--fps and --num-frames are mutually exclusive")
    kw = {"max_frames": args.max_frames} if args.max_frames is not None else {}
    if args.fps is not None or args.num_frames is not None:
        kw.update(do_sample_frames=True, fps=args.fps, num_frames=args.num_frames)
    return kw


def _load_encoder(checkpoint: str, dtype: str, compile_cache: str | None = None):
    """VisionEncoder.from_pretrained on all of this process's devices (frames balanced across
    them when there are several). checkpoint: a converted dir, an HF dir or a cached hub id."""
    import jax

    from qwen_vit_jax.encoder import VisionEncoder

    devices = jax.local_devices()
    return VisionEncoder.from_pretrained(
        checkpoint, dtype=dtype, compilation_cache_dir=compile_cache, devices=devices if len(devices) > 1 else None
    )


# ---- verify ---------------------------------------------------------------------------------------
def cmd_verify(args) -> int:
    try:
        import torch  # noqa: F401 (only checked: verify without it exits 2)
        import transformers
    except ImportError as e:
        _error(
            f"verify runs HF transformers as the reference and needs torch and transformers "
            f"({e}); install them, e.g. pip install 'qwen_vit_jax[test]'"
        )
        return 2
    from qwen_vit_jax import hf_reference
    from qwen_vit_jax.config import VisionConfig
    from qwen_vit_jax.sources import HF_DIR, HUB, resolve_source

    src = resolve_source(args.hf_dir)  # an HF dir or a cached hub id
    if src.kind not in (HF_DIR, HUB):
        raise CommandError(f"HF_DIR must be an HF checkpoint (or a cached hub id), not a {src.kind} directory")
    hf_dir = src.path
    cfg = VisionConfig.from_hf(hf_dir)
    ckpt = args.checkpoint if args.checkpoint is not None else hf_dir  # default: HF_DIR itself, converted in memory
    dtypes = ["float32"] + (["bfloat16"] if args.bf16 else [])
    encoders = {d: _load_encoder(ckpt, d) for d in dtypes}
    if encoders["float32"].cfg != cfg:
        raise CommandError(f"{ckpt} holds a different tower than {hf_dir}: {encoders['float32'].cfg} vs {cfg}")
    t0 = time.perf_counter()
    hf = hf_reference.load_hf_vision_tower(hf_dir)
    print(
        f"{cfg.variant} vision tower: depth {cfg.depth}, width {cfg.width}, out_dim {cfg.out_dim}; "
        f"reference: HF transformers {transformers.__version__} float32 "
        f"(loaded in {time.perf_counter() - t0:.1f} s)"
    )
    print(
        f"{'dtype':<9} {'case':<34} {'tokens':>6} {'max abs':>9} {'/max|ref|':>9} {'rel err':>9} {'min cos':>9}  result"
    )
    ok = True
    for dtype, name, tokens, m, good in hf_reference.verify_cases(hf, encoders, cfg, args.seed):
        ok &= good
        print(
            f"{dtype:<9} {name:<34} {tokens:>6} {m['max_abs']:>9.2e} {m['max_rel']:>9.2e} "
            f"{m['rel']:>9.2e} {m['min_cos']:>9.6f}  {'PASS' if good else 'FAIL'}"
        )
    print("bars (docs/numerics.md): " + "; ".join(f"{d} {hf_reference.TOLERANCES[d].describe()}" for d in dtypes))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


# ---- bench ----------------------------------------------------------------------------------------
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


def cmd_bench(args) -> int:
    sizes = parse_sizes(args.sizes)
    if args.repeats <= 0:
        raise CommandError(f"--repeats must be positive, got {args.repeats}")
    enc = _load_encoder(args.checkpoint, args.dtype, args.compile_cache)
    cfg = enc.cfg
    print(
        f"{cfg.variant} depth {cfg.depth} width {cfg.width}, {enc.dtype}, on {enc.device.platform}, "
        f"median of {args.repeats}"
    )
    print(f"{'size':>10} {'patches':>8} {'bucket':>7} {'compile s':>10} {'median s':>9} {'patches/s':>10}")
    rng = np.random.default_rng(0)
    for t, h, w in sizes:
        grid = np.array([[t, h, w]])
        pixels = rng.standard_normal((t * h * w, cfg.patch_dim), dtype=np.float32)
        t0 = time.perf_counter()
        buckets = enc.warmup([grid])  # also validates the grid (h, w even); a huge grid may span several
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            enc.encode(pixels, grid)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        label = f"{h}x{w}" if t == 1 else f"{t}x{h}x{w}"
        rows = "+".join(str(b.patches) for b in buckets)
        print(f"{label:>10} {t * h * w:>8} {rows:>7} {compile_s:>10.2f} {med:>9.4f} {t * h * w / med:>10,.0f}")
    return 0


# ---- demo / convert -------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from qwen_vit_jax.demo import run_demo

    t0 = time.perf_counter()
    run_demo(args.size, args.cache_dir, args.out, variant=args.variant)
    print(f"demo finished in {time.perf_counter() - t0:.1f} s")
    return 0


# ---- the parser -----------------------------------------------------------------------------------
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
# demo.VARIANTS' keys (spelled out here: building the parser imports no model code)
DEMO_VARIANTS = (
    "qwen2.5-vl",
    "qwen3-vl",
    "qwen3-vl-moe",
    "qwen3.5-moe",
    "qwen4-exp",
    "qwen3-omni",
    "qwen2.5-omni",
    "paddleocr-vl",
    "glm-4v",
    "glm-4.5v",
)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=fmt,
        description="The Qwen2-VL / Qwen2.5-VL vision tower in JAX: convert HF checkpoints, encode\n"
        "images and videos, check against HF transformers, benchmark, and a no-download demo.",
        epilog=f"Start with `{PROG} demo`. `{PROG} COMMAND --help` explains each command.",
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    sub.add_parser("convert", add_help=False, help="HF checkpoint -> qwen_vit_jax params (HF_DIR OUT_DIR)")
    sub.add_parser(
        "export", add_help=False, help="a tower -> an HF checkpoint like HF_DIR (MODEL_DIR OUT_DIR --like HF_DIR)"
    )
    sub.add_parser("aot", add_help=False, help="compile for an H100 / H200 / TPU without one: memory, roofline")

    p = sub.add_parser(
        "encode",
        formatter_class=fmt,
        help="images and videos -> embeddings file (.safetensors / .npz)",
        description=ENCODE_HELP,
        epilog=f"example: {PROG} encode q3b photos/ clip.mp4 -o emb.safetensors --fps 2 --max-pixels 1003520",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="converted dir, HF checkpoint dir or hub id in the local cache")
    p.add_argument(
        "inputs",
        metavar="INPUT",
        nargs="+",
        help="image or video files, or folders: their image and video files ("
        + " ".join(sorted(IMAGE_SUFFIXES | VIDEO_SUFFIXES))
        + "), sorted by name",
    )
    p.add_argument("-o", "--output", metavar="OUT", required=True, help="output file, .safetensors or .npz")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype (default float32, exact vs HF; bfloat16 is ~2x faster on CPUs with bf16)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        action="store_true",
        help="if OUT exists, skip the inputs it already holds (by name) and write OUT again "
        "with the new ones appended; the checkpoint, dtype, pixel limits and frame sampling must match",
    )
    mode.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--recursive", action="store_true", help="also search the sub-folders of folder inputs")
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="skip inputs that cannot be read (each named in a warning; exit status 1) instead of stopping",
    )
    g = p.add_argument_group("video frame sampling (default: the checkpoint's video config)")
    g.add_argument("--fps", type=float, metavar="F", help="sample F frames per second of video")
    g.add_argument("--num-frames", type=int, metavar="N", help="or sample N frames spread evenly over each video")
    g.add_argument("--max-frames", type=int, metavar="N", help="sample at most N frames per video")
    p.add_argument(
        "--batch-patches",
        type=int,
        metavar="N",
        help="most patches per forward call (default: the encoder's, 16384 per device); larger "
        "batches amortise per-call costs, smaller ones use less memory",
    )
    p.add_argument(
        "--min-pixels",
        type=int,
        metavar="N",
        help="override the preprocessing min_pixels (also videos': per frame, Qwen3-VL: per clip)",
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        metavar="N",
        help="override max_pixels (the Qwen hub value, 12845056, keeps a 12 MP photo at full size: ~16k patches)",
    )
    p.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="keep compiled programs in DIR (JAX's persistent compilation cache): a later run "
        "loads them instead of compiling",
    )
    g = p.add_argument_group("several processes (one shard of OUT each)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0 (jax.distributed)")
    g.add_argument("--num-processes", type=int, metavar="N", help="how many processes run this command")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 .. N-1")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="let jax.distributed.initialize() find the cluster (SLURM, Open MPI, Cloud TPU, "
        "Kubernetes) instead of the three flags above",
    )

    p = sub.add_parser(
        "verify",
        formatter_class=fmt,
        help="compare with HF transformers on random inputs (needs torch)",
        description=VERIFY_HELP,
        epilog=f"example: {PROG} verify ~/Qwen2.5-VL-3B-Instruct q3b --bf16",
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="HF checkpoint directory (or hub id in the local cache)")
    p.add_argument(
        "checkpoint",
        metavar="CKPT",
        nargs="?",
        help="ours to check: a converted dir of it, or any source (default: HF_DIR itself, converted in memory)",
    )
    p.add_argument("--bf16", action="store_true", help="also check our bfloat16 mode")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")

    p = sub.add_parser(
        "bench",
        formatter_class=fmt,
        help="forward benchmark over a few sizes",
        description=BENCH_HELP,
        epilog=f"example: {PROG} bench q3b --sizes 16x16,36x36,2x24x24 --dtype bfloat16",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="converted dir, HF checkpoint dir or hub id in the local cache")
    p.add_argument(
        "--sizes",
        default="16x16,36x36",
        help="comma-separated grids in patches: HxW (an image) or TxHxW (a video); H and W even "
        "(default 16x16,36x36; 36x36 patches is a 504x504-pixel image)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per size (default 3)")
    p.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="keep compiled programs in DIR (JAX's persistent compilation cache): a later run "
        "loads them instead of compiling",
    )

    p = sub.add_parser(
        "demo",
        formatter_class=fmt,
        help="random-weight end-to-end demo, no download",
        description=DEMO_HELP,
        epilog=f"example: {PROG} demo --size tiny --out demo.png",
    )
    p.add_argument(
        "--variant",
        choices=DEMO_VARIANTS,
        default="qwen2.5-vl",
        help="tower family (default qwen2.5-vl)",
    )
    p.add_argument(
        "--size",
        choices=("tiny", "full", "3b"),
        default="tiny",
        help="tower size (default tiny; 3b: Qwen2.5-VL's full tower)",
    )
    p.add_argument("--out", default="qwen_vit_jax_demo.png", help="the PNG to write (default ./qwen_vit_jax_demo.png)")
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where checkpoints are kept (default $QWEN_VIT_JAX_CACHE, else ~/.cache/qwen_vit_jax)",
    )
    return ap


COMMANDS = {"encode": cmd_encode, "verify": cmd_verify, "bench": cmd_bench, "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    from qwen_vit_jax.convert import sigterm_as_interrupt

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["convert"]:  # convert.py owns that parser (also behind convert_weights.py)
            from qwen_vit_jax.convert import main as convert_main

            return convert_main(argv[1:], prog=f"{PROG} convert")
        if argv[:1] == ["export"]:  # export.py owns that parser
            from qwen_vit_jax.export import main as export_main

            return export_main(argv[1:], prog=f"{PROG} export")
        if argv[:1] == ["aot"]:  # aot.py owns its parser
            from qwen_vit_jax.aot import main as aot_main

            return aot_main(argv[1:], prog=f"{PROG} aot")
        args = build_parser().parse_args(argv)
        if args.command is None:
            build_parser().print_help(sys.stderr)
            return 2
        with sigterm_as_interrupt():  # a kill unwinds like Ctrl-C: temporary files are removed
            return COMMANDS[args.command](args)
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else 1
    except CommandError as e:
        _error(str(e))
        return 1
    except (OSError, ValueError) as e:  # missing files, bad checkpoints (CheckpointError), bad inputs
        _error(str(e))
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
