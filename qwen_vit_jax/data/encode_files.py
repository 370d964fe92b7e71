"""The loop of `qwen-vit-jax encode`: inputs prepared by the worker pipeline (pipeline.py) in input
order, packed into calls by patch budget, encoded, and written to an embeddings file with progress,
periodic saves, --resume and --keep-going. cli.py parses the arguments and calls `encode_files`.

Nothing here is half-written: OUT is only ever replaced whole (embeddings.write_embeddings writes a
temporary sibling and renames it), with the inputs finished so far, whether the run ends, is
interrupted (Ctrl-C, SIGTERM) or loses a worker process.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator

import numpy as np

from qwen_vit_jax.data.embeddings import Embeddings, read_embeddings, write_embeddings
from qwen_vit_jax.data.inputs import EncodeError
from qwen_vit_jax.data.pipeline import Item, WorkerError, load
from qwen_vit_jax.data.stream import Progress, count
from qwen_vit_jax.plan.contract import Patches
from qwen_vit_jax.preprocess.config import PreprocessConfig
from qwen_vit_jax.runtime.batching import pack

SAVE_EVERY_S = 600.0  # OUT is rewritten with the inputs done so far at most this often
RESUME_KEYS = ("checkpoint", "dtype", "preprocess", "video_preprocess")  # must match to add to a file


# ---- resume --------------------------------------------------------------------------------------
def resume_from(target, meta: dict) -> Embeddings:
    """The embeddings already in `target`, checked to come from the same checkpoint and settings."""
    old = read_embeddings(target)
    for key in RESUME_KEYS:
        if key == "video_preprocess" and key not in old.metadata:
            continue  # written before videos were supported: it holds images only
        if old.metadata.get(key) != meta[key]:
            raise EncodeError(
                f"--resume: {target} was written with {key} {old.metadata.get(key)!r}, this run uses "
                f"{meta[key]!r}; mixing them in one file would be silently wrong"
            )
    return old


# ---- the loop ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    names: list[str]  # the inputs encoded by this run, in order
    tokens: int
    failed: list[tuple[str, str]]  # (path, reason) of the inputs skipped (--keep-going)
    seconds: float
    seconds_waiting: float  # of those, spent waiting for the workers (the device idle)


def batches(items: Iterator[Item], budget: int, failed: list, keep_going: bool) -> Iterator[list[Item]]:
    """Consecutive readable items in lists of at most `budget` patches (an item larger than the budget
    alone) whose pixels share one table. An unreadable item is recorded in `failed` as (name, reason)
    and skipped with `keep_going`, else ends the items there (the ones before it are still yielded)."""

    def readable() -> Iterator[Item]:
        for item in items:
            if item.error is None:
                yield item
                continue
            failed.append((item.name, item.error))
            if not keep_going:
                return

    return pack(readable(), budget, lambda item: len(item.patches), key=lambda item: item.patches.table.tobytes())


def encode_files(
    enc,
    inputs: list[str],
    target,
    meta: dict,
    old: Embeddings | None,
    *,
    video_cfg: PreprocessConfig,
    image_cfg: PreprocessConfig,
    batch_patches: int,
    keep_going: bool,
    save_empty: bool = False,
    workers: int = 0,
    fast_decode: bool = False,
) -> Result:
    """Encode `inputs` (consecutive inputs packed into calls of at most `batch_patches` patches) and
    write `old` + them to `target`.

    Saves every SAVE_EVERY_S, on Ctrl-C / SIGTERM (then KeyboardInterrupt, saying what was written),
    when a worker process dies and before reporting an unreadable input (without keep_going): an
    EncodeError then says how to continue. With keep_going unreadable inputs are skipped with a
    warning each. When nothing could be encoded, nothing is written unless `save_empty` (a process
    of a sharded run writes its shard all the same: the set must be complete).

    Returns:
      Result: names encoded, their token count, the skipped inputs, wall seconds, seconds waited.
    """
    failed: list[tuple[str, str]] = []
    names: list[str] = []
    grids: list[np.ndarray] = []  # [1, 3] each
    embs: list[np.ndarray] = []  # [tokens, D] each
    stamps: list[np.ndarray] = []  # [t] each

    def save() -> None:
        new = Embeddings(
            np.concatenate([np.zeros((0, enc.cfg.out_dim), np.float32), *embs]),
            np.concatenate([np.zeros((0, 3), np.int64), *grids]),
            np.concatenate([[0], np.cumsum([len(e) for e in embs])]).astype(np.int64),
            names,
            meta,
            np.concatenate([np.zeros(0), *stamps]),
        )
        write_embeddings(target, new if old is None else Embeddings.concatenate([old, new], meta))

    def written() -> str:
        return f"{count(len(names), 'new input')} written to {target}; the same command with --resume continues"

    t0 = last_save = time.perf_counter()
    progress = Progress(len(inputs), unit="inputs")
    loader = load(
        inputs,
        config=image_cfg,
        video_config=video_cfg,
        variant=enc.cfg.variant,
        workers=workers,
        fast_decode=fast_decode,
    )
    every_frame = not (video_cfg.do_sample_frames and (video_cfg.fps or video_cfg.num_frames))
    try:
        for batch in batches(iter(loader), batch_patches, failed, keep_going):
            for item in batch:
                if item.is_video and every_frame:  # HF's Qwen2-VL processor does the same; long clips cost a lot
                    print(
                        "note: videos use every frame (the checkpoint's video config samples none, as HF's "
                        "Qwen2VLVideoProcessor); --fps 2 is what Qwen's own tools use",
                        file=sys.stderr,
                    )
                    every_frame = False
                if item.note:
                    print(f"{item.note}, prepared in {item.seconds:.1f} s", file=sys.stderr, flush=True)
            grid = np.concatenate([item.grid for item in batch])  # [k, 3]
            emb = enc.encode(Patches.concatenate([item.patches for item in batch]), grid)
            embs += np.split(emb, np.cumsum([len(item.patches) // enc.cfg.merge_unit for item in batch])[:-1])
            grids += [g[None] for g in grid]
            names += [item.name for item in batch]
            stamps += [item.timestamps for item in batch]
            progress.update_to(len(names) + len(failed))  # failures are counted as processed
            if time.perf_counter() - last_save > SAVE_EVERY_S:  # a crash then costs at most this
                save()
                last_save = time.perf_counter()
        progress.update_to(len(names) + len(failed))
    except KeyboardInterrupt:
        loader.close()  # the workers go first: nothing keeps running while the output is saved
        if names:
            save()
            raise KeyboardInterrupt(written()) from None
        raise KeyboardInterrupt("nothing written") from None
    except WorkerError as e:
        loader.close()
        if names:
            save()
        raise EncodeError(f"{e}; " + (written() if names else "nothing written")) from None
    finally:
        loader.close()
        progress.close()
    seconds = time.perf_counter() - t0
    if failed and not keep_going:  # the inputs before it are encoded: keep them
        (path, reason), held = failed[0], ""
        if names:
            save()
            held = f"; the {count(len(names), 'input')} before it written to {target}, --resume continues"
        raise EncodeError(
            f"cannot read {path}: {reason}{held or '; nothing written'} (--keep-going skips unreadable inputs)"
        )
    for path, reason in failed:
        print(f"warning: skipped {path}: {reason}", file=sys.stderr)
    if not names and inputs and not save_empty:
        raise EncodeError(f"none of the {len(inputs)} inputs could be read; nothing written")
    save()
    return Result(names, sum(len(e) for e in embs), failed, seconds, loader.seconds_waiting)
