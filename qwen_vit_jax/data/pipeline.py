"""The host keeps the device fed: inputs -> read -> decode -> resize -> uint8 patches, in Grain worker
processes, delivered in input order.

    import qwen_vit_jax as qvj
    with qvj.data.load(paths, preprocessing=enc.preprocessing, workers=2) as items:
        for item in items:          # in the order of `paths`, whatever the worker count
            enc.encode(item.patches, item.grid)

Each worker process runs the whole per-input pipeline (`Prepare`) on its share of the inputs (Grain's
`mp_prefetch`: worker i takes inputs i, i + N, ...; the main process reads them back round-robin, so
the order, and every byte of every item, is the same for any N). The main process only packs items
into calls and dispatches them. An input that cannot be read arrives as an item with `error` set,
in its place, so the caller decides between stopping and skipping.

Long videos stream: with `piece_patches`, a video of more patches is only probed in its Grain
worker (its grid, timestamps and digest known, nothing decoded), and its item's `pieces` are
decoded in frame groups of at most `piece_patches` patches by a worker process of the loader's own
(`workers.WorkerPool`; a thread with workers=0) as the consumer reads them, a group or two ahead:
the memory a video costs follows a group, not its length. A video that fails after some of its
pieces were read raises `PieceError` from the pieces (those read before are void).

Workers are spawned processes (Grain's), so a script that starts them runs its work under
`if __name__ == "__main__":` (Python's rule for spawned workers: each re-imports the main module).
A worker's start-up (Python, then Grain, which imports jax; this module itself imports no jax) and
its cost per image beyond preprocessing (the patch rows' trip through shared memory) are in
benchmarks/RESULTS.md, "The host path and workers".

Workers and signals: the workers ignore SIGINT and SIGTERM (from their start: see
`_signals_for_workers`), so a Ctrl-C or a `kill` of the process group reaches the main process
alone, which saves its output and closes the workers; a worker that dies (killed, out of memory)
raises `WorkerError` in the main process. Closing the loader (a `with` block) stops the workers,
and a main process that dies however it dies (SIGKILL, out of memory) takes them with it
(`processes.die_with_parent`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

from qwen_vit_jax.data.items import Item, Job, Limits, failed, prepare, stream
from qwen_vit_jax.data.sources import Record, RecordReader
from qwen_vit_jax.data.workers import WorkerDied, WorkerPool, start_worker, tune_allocator
from qwen_vit_jax.preprocess.config import (
    PreprocessConfig,
    Preprocessing,
    preprocessing_from,
)
from qwen_vit_jax.preprocess.video import Piece

__all__ = ["Item", "Loader", "Prepare", "WorkerError", "load", "tune_allocator"]


class WorkerError(RuntimeError):
    """A preprocessing worker process died (killed, out of memory, crashed)."""


class PieceError(Exception):
    """A streamed video failed after some of its pieces were read: `item` holds its error (the
    pieces read before are void)."""

    def __init__(self, item: Item):
        super().__init__(item.error)
        self.item = item


class Prepare:
    """The per-input pipeline a Grain worker runs: (name, source) -> a dict, Grain's wire form (its
    one array, the patch rows, through shared memory; the rest numbers and strings): `items.prepare`
    of the input, its rows whole. A video over `budget` patches is not decoded here: its dict is the
    item's header ("stream": the main process streams it in frame groups, `Loader`).
    A source is a file path, a `sources.Record` (a tar member, a parquet or arrow row: read here, in
    the worker) or a decoded image (a PIL image or an HxWx3 uint8 array).
    Picklable: it is sent to the workers (each opens its own dataset files)."""

    def __init__(
        self,
        config: PreprocessConfig,
        video_config: PreprocessConfig,
        variant: str,
        fast_decode: bool,
        budget: int | None = None,
    ):
        self.preprocessing = Preprocessing(image=config, video=video_config, variant=variant)
        self.fast_decode, self.budget = fast_decode, budget
        self._reader = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None}  # open files stay in their process

    def __call__(self, element: tuple[str, object]) -> dict:
        name, source = element
        t0 = time.perf_counter()
        if self._reader is None:
            self._reader = RecordReader()
        try:
            item = prepare(Job(name, source), self.preprocessing, fast_decode=self.fast_decode, reader=self._reader)
            header = {
                "name": name,
                "grid": item.grid[0].tolist(),
                "timestamps": item.timestamps.tolist(),
                "video": item.is_video,
                "digest": item.digest,
                "note": item.note,
                "capped": item.capped,
                "frames": item.frames,
            }
            if item.is_video and self.budget is not None and int(np.prod(item.grid)) > self.budget:
                item.pieces.close()  # nothing decoded yet: the main process streams it
                return {**header, "stream": True, "seconds": time.perf_counter() - t0}
            rows = [piece.rows for piece in item.pieces]
            data = rows[0] if len(rows) == 1 else np.concatenate(rows)
            return {**header, "data": data, "seconds": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 (any decoder / preprocessing failure: named in its place)
            shard = f"in {source.path}: " if isinstance(source, Record) and source.kind != "file" else ""
            bad = failed(name, e, shard, time.perf_counter() - t0)
            return {"name": name, "error": bad.error, "failure": bad.failure, "seconds": bad.seconds}


class Loader:
    """Prepared inputs in input order (see the module docstring); iterate once, then `close` (or use
    a `with` block). `seconds_waiting`: time the consumer spent blocked on the next item (the
    device-idle time when the consumer keeps the device busy otherwise)."""

    def __init__(
        self,
        inputs: Sequence,
        *,
        config: PreprocessConfig,
        video_config: PreprocessConfig,
        variant: str,
        workers: int = 0,
        fast_decode: bool = False,
        buffer: int = 2,
        piece_patches: int | None = None,
    ):
        import grain
        from absl import flags

        if not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be an int >= 0, got {workers!r}")
        if not flags.FLAGS.is_parsed():  # Grain reads absl flags; a library must not parse argv
            flags.FLAGS.mark_as_parsed()
        self.workers = min(workers, len(inputs))
        self.preprocessing = Preprocessing(image=config, video=video_config, variant=variant)
        self.piece_patches, self._streams = piece_patches, None
        self._elements, self._read = (elements := [_element(i, x) for i, x in enumerate(inputs)]), 0
        prepare_one = Prepare(config, video_config, variant, fast_decode, piece_patches)
        ds = grain.MapDataset.source(elements).map(prepare_one)
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=buffer))
        if self.workers:
            options = grain.MultiprocessingOptions(num_workers=self.workers, per_worker_buffer_size=buffer)
            ds = ds.mp_prefetch(options, worker_init_fn=_start_worker)
        self._ds, self._it, self._head = ds, None, []
        self.seconds_waiting = 0.0

    def __iter__(self) -> Iterator[Item]:
        if self._it is not None:
            raise RuntimeError("a Loader is iterated once")
        t0 = time.perf_counter()
        if self.workers:
            with _signals_for_workers():  # each worker's first input comes once it has started
                self._it = iter(self._ds)
                try:
                    for _ in range(self.workers):
                        self._head.append(self._next())
                except StopIteration:
                    pass
        else:
            self._it = iter(self._ds)
        self.seconds_waiting += time.perf_counter() - t0
        while self._head:
            yield self._item(self._head.pop(0))
        while True:
            t0 = time.perf_counter()
            try:
                element = self._next()
            except StopIteration:
                return
            finally:
                self.seconds_waiting += time.perf_counter() - t0
            yield self._item(element)

    def _next(self) -> dict:
        try:
            return next(self._it)
        except RuntimeError as e:
            if "terminated unexpectedly" in str(e):
                raise WorkerError(f"a preprocessing worker process died ({_exit_reason(str(e))})") from None
            raise

    def _item(self, d: dict) -> Item:
        source = self._elements[self._read][1]  # in input order, whatever the worker count (names may repeat)
        self._read += 1
        if d.get("error"):
            return Item(d["name"], error=d["error"], failure=d.get("failure"), seconds=d["seconds"])
        video = bool(d.get("video", False))
        cfg = self.preprocessing.video if video else self.preprocessing.image
        if d.get("stream"):
            pieces = self._stream(Job(d["name"], source, "video", digest=d["digest"]))
        else:  # out of the worker's shared memory (freed with it)
            grid = tuple(d["grid"])
            pieces = (Piece(np.array(d["data"]), grid, None if not video else np.array(d["timestamps"]), 0),)
        return Item(
            d["name"],
            "video" if video else "image",
            d.get("digest"),
            np.array([d["grid"]], np.int64),
            np.array(d["timestamps"], np.float64),
            pieces,
            cfg,
            d.get("frames", 1),
            d.get("note"),
            d.get("capped"),
            d["seconds"],
        )

    def _stream(self, job: Job) -> Iterator[Piece]:
        """A long video's pieces, decoded in frame groups by a worker process of their own (a thread
        with workers=0), as they are read: PieceError when it fails after some were read."""
        if self._streams is None:
            args = (self.preprocessing, Limits(), self.piece_patches)
            self._streams = WorkerPool(stream, args, 1 if self.workers else 0, name="qvj-video")
        task = self._streams.submit(job)
        try:
            for message in task:
                if isinstance(message, Item):
                    if message.error is not None:
                        raise PieceError(message)
                    continue  # the header: the Grain worker's, again
                yield message
        except WorkerDied as e:
            hint = "; killed, e.g. by the out-of-memory killer" if e.reason == "SIGKILL" else ""
            raise WorkerError(f"a preprocessing worker process died ({e.reason}{hint})") from None

    def close(self) -> None:
        """Stop the workers, and free the shared memory their outputs came in."""
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        if self._streams is not None:
            self._streams.close(cancel=True)  # a video being streamed stops at its next group
            self._streams = None
        self._head = []
        _drain_shared_memory()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(
    inputs: Sequence,
    *,
    preprocessing: Preprocessing | None = None,
    workers: int = 0,
    fast_decode: bool = False,
    buffer: int = 2,
    piece_patches: int | None = None,
    config: PreprocessConfig | None = None,
    video_config: PreprocessConfig | None = None,
    variant: str | None = None,
) -> Loader:
    """The Grain pipeline over `inputs`: file paths (images or videos, told apart as the CLI does),
    dataset records (`sources.expand`: webdataset shards, parquet and HF datasets' rows), decoded
    images (PIL images, HxWx3 uint8 arrays) or (name, image) pairs.

    Args:
      preprocessing: image and video settings and the tower variant (its image processor's resize
        rule and row order); pass an encoder's `enc.preprocessing` to follow its checkpoint
        (default: HF's for Qwen2.5-VL). `config=` / `video_config=` / `variant=` still work,
        deprecated.
      workers: worker processes (0: in the calling process, one background thread).
      fast_decode: decode JPEGs at a reduced DCT scale when they are resized to half or less anyway
        (faster, not HF's pixels: see `qwen_vit_jax.data.inputs`).
      buffer: prepared inputs each worker keeps ready.
      piece_patches: a video of more patches comes in pieces of at most this many (frame groups,
        decoded as `Item.pieces` is read: memory follows a piece, not the video); None: whole.
    Returns:
      a `Loader`: iterate it for `Item`s in input order; close it (or use `with`).
    """
    p = preprocessing_from(
        preprocessing,
        "qwen2_5_vl",
        {"config": config, "video_config": video_config, "variant": variant},
        "qvj.data.load",
    )
    return Loader(
        inputs,
        config=p.image,
        video_config=p.video,
        variant=p.variant,
        workers=workers,
        fast_decode=fast_decode,
        buffer=buffer,
        piece_patches=piece_patches,
    )


def _drain_shared_memory() -> None:
    """Wait until Grain has freed the shared memory of the elements already read. It frees them from
    a thread pool of its own, which a process exiting right after a run would leave with work to do
    (the interpreter then warns of leaked segments at exit). Grain offers no public call for this:
    its pool is reached by name, and nothing happens where it is not found."""
    try:
        from grain._src.python.ipc.shared_memory_array import SharedMemoryArray
    except ImportError:
        return
    pool = getattr(SharedMemoryArray, "_del_thread_pool", None)
    if pool is not None:
        SharedMemoryArray._del_thread_pool = None  # later deletions run on the spot
        pool.close()
        pool.join()


@contextlib.contextmanager
def _signals_for_workers():
    """While the workers start: SIGINT ignored process-wide (a spawned process inherits that from
    any thread, so a Ctrl-C of the process group never interrupts a worker half-started; one typed
    in this window is lost), SIGTERM blocked in this thread (held, then delivered here once the
    workers run). Outside the main thread (no handlers there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _start_worker(worker: int, workers: int) -> None:
    """Grain's worker_init_fn: the one start-up of every worker process (workers.start_worker)."""
    start_worker()


def _element(i: int, x) -> tuple[str, object]:
    """(name, source) of input i: a record its key, a path its own name, an image "image i"."""
    if isinstance(x, Record):
        return x.key, x
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
        return x
    if isinstance(x, (str, os.PathLike)):
        return os.fspath(x), os.fspath(x)
    return f"image {i}", x


def _exit_reason(message: str) -> str:
    """Grain's "... with exit code -9 ..." in words."""
    import re

    m = re.search(r"exit code (-?\d+)", message)
    if m is None:
        return message
    code = int(m[1])
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = "; killed, e.g. by the out-of-memory killer" if -code == signal.SIGKILL else ""
        return f"{name}{hint}"
    return f"exit code {code}"
