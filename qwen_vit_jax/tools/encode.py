"""`qwen-vit-jax encode`: its options (`add_parser`) and the command (`command`): list the inputs
(data/sources.py: files, folders, webdataset shards, parquet files, HF datasets), check their keys,
open the output (data/sinks.py) and leave out what it holds (--resume), share the rest between
processes, then run the encode loop (data/encode_files.py). Building the parser imports no jax.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import tempfile
from collections import Counter

from qwen_vit_jax.data.sinks import SAVE_EVERY_S
from qwen_vit_jax.data.stream import count
from qwen_vit_jax.data.workers import cores, default_workers
from qwen_vit_jax.files import output_lock
from qwen_vit_jax.tools.args import (
    ENCODE_HELP,
    PROG,
    CommandError,
    add_checkpoint,
    add_compile_cache,
    add_dtype,
    add_overwrite,
    cache_loads,
    command_flags,
    compile_cache_dir,
    in_flags,
    load_encoder,
)
from qwen_vit_jax.vllm import flags as vllm_flags

# Below this many inputs the default prepares them in this process (a background thread) instead of
# starting worker processes: a worker's start-up (Python, then Grain, which imports jax) outweighs the
# preprocessing a few dozen photos would move off this process. Whole `encode` runs of 1, 13 and 240
# photos, --workers 0 vs the default: benchmarks/RESULTS.md, "The host path and workers".
SMALL_RUN = 32


def add_parser(sub, fmt) -> None:
    """The options by topic, one line of help each (the details: docs/encode.md, ENCODE_HELP)."""

    def formatter(prog):  # room for the option column, so that each help stays on one line
        return fmt(prog, max_help_position=32)

    p = sub.add_parser(
        "encode",
        formatter_class=formatter,
        usage=f"{PROG} encode CKPT INPUT [INPUT ...] -o OUT [options]",
        help="images, videos and datasets -> embeddings file (.safetensors / .npz / .parquet)",
        description=ENCODE_HELP,
        epilog=f"examples:\n  {PROG} encode q3b photos/ clip.mp4 -o emb.safetensors --fps 2\n"
        f"  {PROG} encode q3b 'shards/*.tar' -o emb.parquet --cache emb_cache/\n"
        f"  {PROG} encode q3b laion.parquet --key-column url -o emb.parquet\n"
        f"  {PROG} encode q3b photos/ --vllm-store /shared/ec_store   (docs/vllm.md)",
    )
    add_checkpoint(p)
    p.add_argument(
        "inputs",
        metavar="INPUT",
        nargs="+",
        help="files, folders, .tar, .parquet, hf:NAME, globs",
    )
    g = p.add_argument_group("output")
    g.add_argument("-o", "--output", metavar="OUT", help="the file: .safetensors, .npz or .parquet")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="keep what OUT holds, encode the missing inputs")
    add_overwrite(mode, "OUT")
    g.add_argument("--keep-going", action="store_true", help="skip unreadable inputs (warned; exit status 1)")
    g.add_argument("--cache", metavar="DIR", help="reuse embeddings of inputs met before (sha256)")
    g.add_argument(
        "--save-every",
        type=float,
        metavar="S",
        default=SAVE_EVERY_S,
        help=f"save what is done every S seconds ({SAVE_EVERY_S:.0f})",
    )
    vllm_flags.add_flags(g)  # vLLM's encoder-cache store, with or without -o (docs/vllm.md)
    g = p.add_argument_group("inputs")
    g.add_argument("--recursive", action="store_true", help="also search the sub-folders of folder inputs")
    g.add_argument("--image-column", metavar="NAME", default="image", help="parquet / dataset image column (image)")
    g.add_argument("--key-column", metavar="NAME", help="the column of each row's key (default FILE:ROW)")
    g.add_argument("--allow-duplicate-keys", action="store_true", help="encode inputs that share a key")
    g = p.add_argument_group("preprocessing (default: the checkpoint's configs)")
    g.add_argument("--min-pixels", type=int, metavar="N", help="override the configs' min_pixels")
    g.add_argument("--max-pixels", type=int, metavar="N", help="override the configs' max_pixels")
    g.add_argument("--fps", type=float, metavar="F", help="sample F frames per second of video")
    g.add_argument("--num-frames", type=int, metavar="N", help="or N frames spread over each video")
    g.add_argument("--max-frames", type=int, metavar="N", help="at most N frames per video")
    g.add_argument("--fast-decode", action="store_true", help="JPEGs decoded at 1/2..1/8 scale (not HF pixels)")
    small = f"0 under {SMALL_RUN} inputs"
    g.add_argument("--workers", type=int, metavar="N", help=f"input-preparing processes ({small})")
    g = p.add_argument_group("compute")
    add_dtype(g)
    g.add_argument("--batch-patches", type=int, metavar="N", help="patches per forward call (16384 per device)")
    add_compile_cache(g)
    g = p.add_argument_group("several processes (one shard of OUT each)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0 (jax.distributed)")
    g.add_argument("--num-processes", type=int, metavar="N", help="how many processes run this command")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 .. N-1")
    g.add_argument("--distributed", action="store_true", help="or let jax find the cluster (SLURM, MPI, TPU)")
    p.set_defaults(func=command)


def command(args) -> int:
    with contextlib.ExitStack() as held:  # the lock on OUT (taken once OUT is known), for the whole run
        return _command(args, held)


def _command(args, held: contextlib.ExitStack) -> int:
    from qwen_vit_jax.data import parquet
    from qwen_vit_jax.data.embeddings import check_suffix, index_path, read_names, run_metadata, shard_path, write_index
    from qwen_vit_jax.data.encode_files import encode_files
    from qwen_vit_jax.data.pipeline import tune_allocator
    from qwen_vit_jax.data.sinks import open_sink
    from qwen_vit_jax.data.sources import duplicate_keys, expand, need_pyarrow, suffixes
    from qwen_vit_jax.runtime import multihost

    if args.output is None and args.vllm_store is None:  # a usage error, in argparse's words and status
        print(
            f"{PROG} encode: error: the following arguments are required: -o/--output (or --vllm-store)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    vllm_flags.check(args.vllm_store, args.vllm_ids, args.vllm_model)
    out = pathlib.Path(args.output) if args.output else None  # None: the store alone
    if out is None and (args.resume or args.overwrite):
        raise CommandError("--resume and --overwrite are about -o OUT; the store's items are replaced as they come")
    if out is not None and check_suffix(out) == ".parquet":
        need_pyarrow(f"-o {out}")
    if out is not None and not out.parent.is_dir():
        raise CommandError(f"output folder not found: {out.parent}")
    if args.vllm_store:
        os.makedirs(args.vllm_store, exist_ok=True)
    for folder in [*([out.parent] if out else []), *([args.vllm_store] if args.vllm_store else [])]:
        try:  # fail now, not after encoding everything: OUT is written as a temporary sibling
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            raise CommandError(f"output folder {folder} is not writable ({e.strerror})") from None
    for flag in ("batch_patches", "num_frames", "max_frames", "fps"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise CommandError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.workers is not None and args.workers < 0:
        raise CommandError(f"--workers must be >= 0, got {args.workers}")
    if not args.save_every >= 0:  # (NaN too)
        raise CommandError(f"--save-every must be >= 0 seconds, got {args.save_every}")
    asked = capped_workers(args.workers)
    tune_allocator()  # this process decodes too with --workers 0 (and packs every batch)
    # before anything touches a device: jax.distributed must start first
    cluster = multihost.initialize(args.coordinator, args.num_processes, args.process_id, args.distributed)
    sharded = cluster.count > 1
    if sharded and out is not None and out.exists():
        raise CommandError(
            f"{out} exists as a single file, which read_embeddings({out.name}) would read instead "
            "of this run's shards: move or delete it"
        )
    target = shard_path(out, cluster.index, cluster.count) if sharded and out else out  # what this process writes
    # One writer per output: a second run on it stops here, before it reads or removes anything.
    lock = held.enter_context(output_lock(target)) if out else None  # (a store takes many writers)
    if lock and lock.note:
        print(lock.note, file=sys.stderr)
    # Every process checks every shard, so that all of them stop here together (on a shared file system).
    shards = ([shard_path(out, i, cluster.count) for i in range(cluster.count)] if sharded else [out]) if out else []
    found = [p for s in shards for p in (s, parquet.parts_dir(s)) if p.exists()]
    if found and not (args.resume or args.overwrite):
        what = "an interrupted run's parts" if found[0].suffix == ".parts" else "it"
        raise CommandError(f"{found[0]} exists: --resume adds the missing inputs to {what}, --overwrite replaces it")
    records = expand(args.inputs, recursive=args.recursive, image_column=args.image_column, key_column=args.key_column)
    if not records:
        raise CommandError(
            f"no input images, videos or datasets found (folders are searched for {', '.join(sorted(suffixes()))}; "
            "--recursive for sub-folders)"
        )
    if (dups := duplicate_keys(records)) and not args.allow_duplicate_keys:
        shown = ", ".join(f"{k!r} ({n}x)" for k, n in list(dups.items())[:5])
        more = f" and {len(dups) - 5:,} more" if len(dups) > 5 else ""
        raise CommandError(
            f"{count(len(dups), 'key')} occur more than once: {shown}{more}; a key must name one input "
            "(--key-column picks another column; --allow-duplicate-keys encodes each all the same)"
        )

    if args.fps is not None and args.num_frames is not None:
        raise CommandError("--fps and --num-frames are mutually exclusive")
    enc = load_encoder(args.checkpoint, args.dtype, compile_cache_dir(args))
    # the flags as a call's fps= / num_frames= / max_frames= and pixel limits: recorded in OUT's
    # metadata (checked by --resume) and in the cache's key
    prep = enc.preprocessing.with_limits(
        args.min_pixels, args.max_pixels, fps=args.fps, num_frames=args.num_frames, max_frames=args.max_frames
    )
    # a directory by its absolute path, a hub id (not a path) as given
    ckpt = str(pathlib.Path(args.checkpoint).resolve()) if os.path.exists(args.checkpoint) else args.checkpoint
    meta = run_metadata(ckpt, enc.dtype, prep)
    sink = open_sink(target, meta, enc.cfg.out_dim, args.resume) if out else None
    if args.vllm_store:  # every row into the store too (vllm/sink.py), deepstack features included
        from qwen_vit_jax.vllm.sink import StoreSink, with_deepstack

        if enc.cfg.deepstack_layers and args.cache:
            raise CommandError("--cache holds no deepstack features, which --vllm-store needs for this tower")
        writer = vllm_flags.writer(args.vllm_store, args.vllm_ids, args.vllm_model, enc.cfg)
        sink = StoreSink(writer, sink, out_dim=enc.cfg.out_dim, records=records)
        enc = with_deepstack(enc) if writer.needs_deepstack else enc
    target = target or pathlib.Path(args.vllm_store)  # what the messages name
    held = Counter(sink.done)  # keys, counted: with --allow-duplicate-keys a key may stand for several inputs
    if args.resume and sharded:  # what the other processes' shards hold is done too
        for i in range(cluster.count):
            other = shard_path(out, i, cluster.count)
            if i != cluster.index:
                held.update(read_names(other) if other.exists() else [])
                held.update(k for part in parquet.part_files(other) for k in parquet.read_keys(part))
    if sharded:  # every process has read the shards before any process writes one
        multihost.barrier("qwen_vit_jax encode: start")
    # This process's part of the inputs (all when alone), fixed by the inputs alone: a resumed run
    # gives each process the part it had, and packs what is left of it as the clean run did.
    mine = _share(records, cluster, prep.image, prep.video, enc.cfg.variant)
    todo = _left(mine, held)
    if args.resume:
        where = f"the shards of {out}" if sharded else str(out)
        left = len(_left(records, held)) if sharded else len(todo)
        print(f"resume: {len(records) - left} of {count(len(records), 'input')} already in {where}", file=sys.stderr)
        if not todo and not sharded:
            if parquet.part_files(target):  # an interrupted run's parts, all there: merged into OUT
                sink.finish()
            else:
                sink.abandon()
            print(f"nothing to do: {out} holds all {count(len(records), 'input')}")
            return 0
    if sharded:
        print(
            f"process {cluster.index} of {cluster.count}: {len(todo)} of {count(len(records), 'input')} -> {target}",
            file=sys.stderr,
        )
    workers = choose_workers(asked, len(todo), default_workers())
    loads = cache_loads()
    # With several processes an unreadable input is skipped, as with --keep-going: every process must
    # reach the end, where the shards are indexed together.
    r = encode_files(
        enc,
        todo,
        target,
        meta,
        preprocessing=prep,
        batch_patches=args.batch_patches or enc.max_batch_patches,
        keep_going=args.keep_going or sharded,
        resume=args.resume,
        save_empty=sharded,
        workers=workers,
        fast_decode=args.fast_decode,
        cache=_cache(args, enc.dtype),
        sink=sink,
        progress=_Shown(command_flags("encode", vars(args))),
        save_every=args.save_every,
    )
    print(
        f"encoded {count(len(r.names), 'input')} ({r.tokens:,} tokens x {enc.cfg.out_dim}) in {r.seconds:.1f} s "
        f"({len(r.names) / max(r.seconds, 1e-9):.3g} inputs/s on {len(enc.devices)} device(s), "
        f"{count(workers, 'worker')}, {r.seconds_waiting / max(r.seconds, 1e-9):.0%} of it waiting for inputs; "
        f"{enc.compile_count} program(s) compiled in {sum(enc.compile_seconds.values()):.1f} s"
        f"{_loaded_note(cache_loads() - loads)}) -> {target} "
        f"({count(len(sink.done) + len(r.names), 'input')})"
    )
    print(
        f"  {r.encoded:,} encoded, {r.reused:,} reused (the same bytes earlier in this run), "
        f"{r.cached:,} from the cache" + (f" ({args.cache})" if args.cache else ""),
    )
    if sharded:
        multihost.barrier("qwen_vit_jax encode: all shards written")
        if cluster.index == 0 and out is not None:
            write_index(out, cluster.count)
            print(
                f"index: {index_path(out)} lists the {cluster.count} shards; read them with "
                f"qwen_vit_jax.read_embeddings({str(out)!r})"
            )
    if r.failed:
        raise CommandError(
            f"{len(r.failed)} of {count(len(todo), 'input')} could not be read (listed above); "
            f"{target} holds the others: fix or remove them and rerun with --resume"
        )
    return 0


def _loaded_note(n: int) -> str:
    """How many of the programs came from the compile cache (a second run of a command: all)."""
    return f", {n} of them loaded from the compile cache" if n else ""


def capped_workers(asked: int | None) -> int | None:
    """--workers as asked, at most one per core: more only share the same cores, and each costs a
    start (a warning names both numbers). None stays None (`choose_workers` decides)."""
    if asked is not None and asked > (n := cores()):
        instead = count(n, "worker")
        print(
            f"warning: --workers {asked} is more than the cores this process may use ({n}): {instead} instead",
            file=sys.stderr,
        )
        return n
    return asked


def choose_workers(asked: int | None, inputs: int, default: int) -> int:
    """The worker processes for a run of `inputs` inputs: `asked` when given; else none below
    SMALL_RUN inputs (starting workers costs more than they save), else `default`."""
    if asked is not None:
        return asked
    return 0 if inputs < SMALL_RUN else default


class _Shown:
    """encode_files' progress on stderr: a bar (data/stream.py) and its notes, in this command's flags
    (`flags`: args.command_flags)."""

    def __init__(self, flags: dict[str, str]):
        self.bar, self.closed, self.flags = None, False, flags

    def __call__(self, update) -> None:
        from qwen_vit_jax.data.stream import Progress

        if self.bar is None:
            self.bar = Progress(update.total, unit="inputs")
        if update.note is not None:
            print(in_flags(update.note, self.flags), file=sys.stderr, flush=True)
        elif update.finished and not self.closed:
            self.bar.close()
            self.closed = True
        elif not update.finished:
            self.bar.total = update.total  # an input that failed leaves the count
            self.bar.update_to(update.done, None if update.frames is None else (*update.frames, "frames"))


def _left(records: list, held: Counter) -> list:
    """The records `held` does not account for: a key held n times accounts for its first n
    records (keys are unique unless --allow-duplicate-keys)."""
    held = Counter(held)
    todo = []
    for r in records:
        if held[r.key] > 0:
            held[r.key] -= 1
        else:
            todo.append(r)
    return todo


def _share(records: list, cluster, image_cfg, video_cfg, variant: str) -> list:
    """This process's part of `records`. Files: consecutive slices balanced by patch count (from their
    headers). Dataset records: whole shards (tar, parquet or arrow files), balanced by record count,
    when there are at least as many shards as processes, else consecutive row ranges."""
    from qwen_vit_jax.data.inputs import input_patches
    from qwen_vit_jax.runtime import multihost

    if cluster.count == 1:
        return records
    if all(r.kind == "file" for r in records):
        return multihost.share(records, cluster, lambda r: input_patches(r.path, image_cfg, video_cfg, variant))
    groups: dict[str, list] = {}
    for r in records:
        groups.setdefault(r.shard, []).append(r)
    if len(groups) >= cluster.count:
        return [r for g in multihost.share(list(groups.values()), cluster, len) for r in g]
    return multihost.share(records, cluster, lambda r: 1)


def _cache(args, dtype: str):
    """The content-hash cache of --cache: entries keyed by the checkpoint's files, the dtype, each
    item's kind and preprocessing (data/cache.py's one recipe, the service's too)."""
    if not args.cache:
        return None
    from qwen_vit_jax.data.cache import ContentCache, checkpoint_fingerprint
    from qwen_vit_jax.weights.sources import resolve_source

    weights = checkpoint_fingerprint(resolve_source(args.checkpoint).path)
    return ContentCache(args.cache, weights, dtype, fast_decode=args.fast_decode)  # --fast-decode: other pixels
