"""`qwen-vit-jax`: convert | export | encode | serve | verify | bench | aot | demo, every one an argparse
subcommand of this parser (`set_defaults(func=...)`).

    qwen-vit-jax demo                                    # random weights, no download, < 2 min
    qwen-vit-jax convert ~/Qwen2.5-VL-3B-Instruct q3b    # HF checkpoint -> our params
    qwen-vit-jax verify ~/Qwen2.5-VL-3B-Instruct q3b     # vs HF transformers (needs torch)
    qwen-vit-jax encode q3b photos/ clips/ -o emb.safetensors --fps 2
    qwen-vit-jax encode q3b photos/ -o emb.safetensors --coordinator h0:1234 --num-processes 2 --process-id 0
    qwen-vit-jax bench q3b --sizes 16x16,36x36
    qwen-vit-jax aot --target h100 --variant qwen2.5-vl-3b

Argument parsing and command glue; the options several commands share and the long help texts
are args.py. encode's inputs (finding, loading images and videos, the loop with progress,
--keep-going and --resume) are data/inputs.py, pipeline.py and encode_files.py, the embeddings file format
data/embeddings.py, several processes runtime/multihost.py.

Every command reports failures as one `error: ...` line on stderr and a non-zero exit status
(`report`, the one mapping: 1 for a bad path, flag, checkpoint or input; 70 for the program's own
failure, `errors.Internal`; 75 for `errors.Unavailable` / `Overloaded`, worth a retry; 2 for bad
usage and for `verify` without torch / transformers; 130 when interrupted), never a traceback for a
bad path or input; a library's keywords in the message become the command's flags. Building the
parser imports no jax; each command imports what it needs (`verify` alone needs torch and
transformers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from qwen_vit_jax import errors
from qwen_vit_jax.config import parse_sizes
from qwen_vit_jax.files import sigterm_as_interrupt
from qwen_vit_jax.serve import cli as serve_cli
from qwen_vit_jax.tools import encode
from qwen_vit_jax.tools.args import (
    AOT_HELP,
    BENCH_HELP,
    CONVERT_HELP,
    DEMO_HELP,
    EXPORT_HELP,
    PROG,
    TOWERS,
    VERIFY_HELP,
    CommandError,
    add_checkpoint,
    add_compile_cache,
    add_dtype,
    add_overwrite,
    command_flags,
    compile_cache_dir,
    in_flags,
    load_encoder,
)


def _error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


# ---- convert / export ----------------------------------------------------------------------------
def cmd_convert(args) -> int:
    from qwen_vit_jax.weights.convert import convert_checkpoint, load_converted

    t0 = time.perf_counter()
    try:
        out = convert_checkpoint(args.hf_dir, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: convert_checkpoint removed its temporary output
        raise KeyboardInterrupt("nothing written") from None
    cfg, params, meta = load_converted(out)
    n = sum(int(np.prod(params.shape(k))) for k in params)
    print(
        f"converted {cfg.variant} vision tower (depth {cfg.depth}, width {cfg.width}): {n:,} params in "
        f"{len(params)} tensors, dtype {meta['dtype']}, {time.perf_counter() - t0:.1f} s -> {out}"
    )
    return 0


def cmd_export(args) -> int:
    from qwen_vit_jax.weights.export import export_params
    from qwen_vit_jax.weights.sources import load_source

    t0 = time.perf_counter()
    try:
        cfg, params, _ = load_source(args.model_dir)
        out = export_params(cfg, params, args.out_dir, like=args.like, overwrite=args.overwrite, link=not args.copy)
    except KeyboardInterrupt:
        raise KeyboardInterrupt("nothing written") from None
    print(f"exported {cfg.variant} vision tower into an HF checkpoint in {time.perf_counter() - t0:.1f} s -> {out}")
    return 0


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
        return USAGE
    from qwen_vit_jax.config import VisionConfig
    from qwen_vit_jax.tools import hf_reference
    from qwen_vit_jax.weights.sources import HF_DIR, HUB, resolve_source

    src = resolve_source(args.hf_dir)  # an HF dir or a cached hub id
    if src.kind not in (HF_DIR, HUB):
        raise CommandError(f"HF_DIR must be an HF checkpoint (or a cached hub id), not a {src.kind} directory")
    hf_dir = src.path
    cfg = VisionConfig.from_hf(hf_dir)
    ckpt = args.checkpoint if args.checkpoint is not None else hf_dir  # default: HF_DIR itself, converted in memory
    dtypes = ["float32"] + (["bfloat16"] if args.bf16 else [])
    encoders = {d: load_encoder(ckpt, d) for d in dtypes}
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
def cmd_bench(args) -> int:
    sizes = parse_sizes(args.sizes, "--sizes")
    if args.repeats <= 0:
        raise CommandError(f"--repeats must be positive, got {args.repeats}")
    enc = load_encoder(args.checkpoint, args.dtype, compile_cache_dir(args))
    cfg = enc.cfg
    from qwen_vit_jax import plan as planlib

    grids = []
    for size in sizes:  # every size checked before the first compile
        try:
            grids.append(planlib.as_grid([size], cfg))
        except ValueError as e:
            raise CommandError(f"--sizes: {'x'.join(map(str, size))}: {e}") from None
    print(
        f"{cfg.variant} depth {cfg.depth} width {cfg.width}, {enc.dtype}, on {enc.device.platform}, "
        f"median of {args.repeats}"
    )
    print(f"{'size':>10} {'patches':>8} {'bucket':>7} {'compile s':>10} {'median s':>9} {'patches/s':>10}")
    rng = np.random.default_rng(0)
    for grid in grids:
        ((t, h, w),) = grid.key
        pixels = rng.standard_normal((t * h * w, cfg.patch_dim), dtype=np.float32)
        t0 = time.perf_counter()
        buckets = enc.warmup([grid])  # a huge grid may span several
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


# ---- demo ---------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from qwen_vit_jax.tools.demo import run_demo

    t0 = time.perf_counter()
    compile_cache = compile_cache_dir(args, args.cache_dir)  # everything under --cache-dir when given
    run_demo(args.size, args.cache_dir, args.out, variant=args.variant, compile_cache=compile_cache)
    print(f"demo finished in {time.perf_counter() - t0:.1f} s")
    return 0


# ---- aot ------------------------------------------------------------------------------------------
def cmd_aot(args) -> int:
    from qwen_vit_jax.tools.aot import command  # jax: only for this command

    return command(args)


# ---- the parser -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from qwen_vit_jax.presets import PRESETS  # the tables the choices come from (no jax)
    from qwen_vit_jax.tools.demo import VARIANTS as DEMO_VARIANTS
    from qwen_vit_jax.tools.targets import TARGETS

    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=fmt,
        description=f"The vision towers of {TOWERS}\nin JAX: convert HF checkpoints, encode images and videos, check "
        "against HF transformers,\nbenchmark, compile for accelerators ahead of time, and a no-download demo.",
        epilog=f"Start with `{PROG} demo`. `{PROG} COMMAND --help` explains each command.",
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "convert", formatter_class=fmt, help="HF checkpoint -> qwen_vit_jax params", description=CONVERT_HELP
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (must not exist unless --overwrite)")
    add_dtype(p, None, "cast the params (default: keep the checkpoint's dtype)")
    add_overwrite(p, "output in OUT_DIR")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "export", formatter_class=fmt, help="a tower -> an HF checkpoint like HF_DIR", description=EXPORT_HELP
    )
    add_checkpoint(p, "model_dir", "MODEL_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the new HF checkpoint directory")
    p.add_argument("--like", metavar="HF_DIR", required=True, help="the HF checkpoint (dir or cached hub id)")
    add_overwrite(p, "export in OUT_DIR")
    p.add_argument("--copy", action="store_true", help="copy the shards without vision tensors (default: link)")
    p.set_defaults(func=cmd_export)

    encode.add_parser(sub, fmt)
    serve_cli.add_parser(sub, fmt)

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
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "bench",
        formatter_class=fmt,
        help="forward benchmark over a few sizes",
        description=BENCH_HELP,
        epilog=f"example: {PROG} bench q3b --sizes 16x16,36x36,2x24x24 --dtype bfloat16",
    )
    add_checkpoint(p)
    p.add_argument(
        "--sizes",
        default="16x16,36x36",
        help="comma-separated grids in patches: HxW (an image) or TxHxW (a video); H and W even "
        "(default 16x16,36x36; 36x36 patches is a 504x504-pixel image)",
    )
    add_dtype(p)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per size (default 3)")
    add_compile_cache(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "aot",
        formatter_class=fmt,
        help="compile for an H100 / H200 / TPU without one: memory, FLOPs, roofline",
        description=AOT_HELP,
        epilog=f"example: {PROG} aot --target tpu-v5e --variant qwen3-vl-8b --devices 8",
    )
    p.add_argument("checkpoint", nargs="?", help="a converted or HF checkpoint directory (only its config is read)")
    p.add_argument("--target", required=True, choices=tuple(TARGETS), help="the accelerator to compile for")
    p.add_argument("--variant", choices=tuple(PRESETS), help="a released tower's preset instead of a checkpoint")
    add_dtype(p, "bfloat16")
    p.add_argument(
        "--sizes",
        default="36x36,10x36x36,16x32x32",
        help="comma-separated requests in patches, HxW or TxHxW (default 36x36,10x36x36,16x32x32: a 36x36 "
        "image, a 10-frame video, a request that fills the largest bucket)",
    )
    p.add_argument("--devices", type=int, default=1, help="devices: N > 1 compiles the mesh program (default 1)")
    p.add_argument(
        "--attention", choices=("xla", "kernel"), default="xla", help="the XLA schedule or the platform's kernel"
    )
    p.add_argument("--json", metavar="PATH", help="also write the reports as JSON")
    p.set_defaults(func=cmd_aot)

    p = sub.add_parser(
        "demo",
        formatter_class=fmt,
        help="random-weight end-to-end demo, no download",
        description=DEMO_HELP,
        epilog=f"example: {PROG} demo --size tiny --out demo.png",
    )
    p.add_argument(
        "--variant", choices=tuple(DEMO_VARIANTS), default="qwen2.5-vl", help="tower family (default qwen2.5-vl)"
    )
    p.add_argument(
        "--size",
        choices=("tiny", "full", "3b"),
        default="tiny",
        help="tower size (default tiny; 3b: Qwen2.5-VL's full tower)",
    )
    p.add_argument("--out", help="the PNG to write (default: demo.png in the checkpoint's cache folder)")
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where checkpoints and (without --compile-cache) compiled programs are kept "
        "(default $QWEN_VIT_JAX_CACHE, else ~/.cache/qwen_vit_jax)",
    )
    add_compile_cache(p)
    p.set_defaults(func=cmd_demo)
    return ap


# What each failure exits with: the one table of the command line (the service's is serve/statuses.py).
EXIT_STATUS = {
    errors.BadInput: 1,  # and every other ValueError / OSError: a bad path, flag, checkpoint or input
    errors.TooLarge: 1,
    errors.Unsupported: 1,
    errors.Internal: 70,  # EX_SOFTWARE: this program's own failure, not the input's
    errors.Unavailable: 75,  # EX_TEMPFAIL: the same command may succeed later
    errors.Overloaded: 75,
}
USAGE, INTERRUPTED = 2, 130


def report(e: BaseException, flags: dict[str, str]) -> tuple[int, str]:
    """(exit status, the `error: ...` line's message) of a failure, in the command's flags (`flags`:
    args.command_flags): a library names settings by keyword, the error's `limit` the one it is about."""
    if isinstance(e, KeyboardInterrupt):
        said = str(e) if str(e) and not str(e).startswith("signal") else ""
        return INTERRUPTED, "interrupted" + (f"; {in_flags(said, flags)}" if said else "")
    status = next((EXIT_STATUS[k] for k in type(e).__mro__ if k in EXIT_STATUS), 1)
    if isinstance(e, errors.Error):
        return status, in_flags(e.message, flags, e.limit)
    return status, in_flags(str(e), flags)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (`report`: every failure's, one `error: ...` line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    flags: dict[str, str] = {}
    try:
        args = build_parser().parse_args(argv)
        if args.command is None:
            build_parser().print_help(sys.stderr)
            return USAGE
        flags = command_flags(args.command, vars(args))
        with sigterm_as_interrupt():  # a kill unwinds like Ctrl-C: temporary files are removed
            return args.func(args)
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else 1
    except (OSError, ValueError, errors.Error, KeyboardInterrupt) as e:  # CommandError, missing files, bad
        status, message = report(e, flags)  # checkpoints (CheckpointError), bad inputs, the library's kinds
        _error(message)
        return status


def run() -> None:
    """The console script: `main`, then exit. After an interrupt the process ends at once once every
    output is saved and every worker closed (`os._exit`): an interrupt can land while XLA compiles on
    its own threads, and finalising the interpreter under them crashed it (SIGSEGV)."""
    code = main()
    if code == INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)
    sys.exit(code)


if __name__ == "__main__":
    run()
