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
import dataclasses
import hashlib
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from qwen_vit_jax.data.inputs import draft_size, is_video, load_image
from qwen_vit_jax.data.sources import Record, RecordReader
from qwen_vit_jax.preprocess.config import (
    PreprocessConfig,
    Preprocessing,
    preprocessing_from,
)
from qwen_vit_jax.preprocess.images import image_patches, pixel_table
from qwen_vit_jax.processes import die_with_parent

if TYPE_CHECKING:  # a worker process imports this module: no plan, no jax there
    from qwen_vit_jax.plan.contract import Patches


class WorkerError(RuntimeError):
    """A preprocessing worker process died (killed, out of memory, crashed)."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One input, prepared.

    name: its path, or "image i" for an in-memory image. patches: uint8 `Patches` [t * h * w, S, p, p, C]
    (None when it could not be read). grid: int64 [1, 3]. timestamps: float64 [t], seconds per
    temporal patch (NaN for images and for videos whose model reads no time). error: "Type: message"
    when it could not be read. note: a line for the log (a video's sampling). seconds: its
    preprocessing time in the worker.
    """

    name: str
    patches: Patches | None
    grid: np.ndarray | None
    timestamps: np.ndarray | None
    error: str | None = None
    note: str | None = None
    seconds: float = 0.0
    is_video: bool = False
    digest: str | None = None  # sha256 of the input's bytes (of an in-memory image: its pixels)


class Prepare:
    """The per-input pipeline a worker runs: (name, source) -> a dict (what Grain sends back: its one
    array, the patch rows, through shared memory, the rest as numbers and strings; `Loader` turns it
    into an `Item`).
    A source is a file path, a `sources.Record` (a tar member, a parquet or arrow row: read here, in
    the worker) or a decoded image (a PIL image or an HxWx3 uint8 array). Every input's `digest`,
    the sha256 of its bytes (an in-memory image: of its pixels), keys the content-hash cache.
    Picklable: it is sent to the workers (each opens its own dataset files)."""

    def __init__(self, config: PreprocessConfig, video_config: PreprocessConfig, variant: str, fast_decode: bool):
        self.config, self.video_config, self.variant, self.fast_decode = config, video_config, variant, fast_decode
        self._reader = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None}  # open files stay in their process

    def __call__(self, element: tuple[str, object]) -> dict:
        name, source = element
        t0 = time.perf_counter()
        try:
            out = self._prepare(name, source)
        except Exception as e:  # noqa: BLE001 (any decoder / preprocessing failure: named in its place)
            shard = f"in {source.path}: " if isinstance(source, Record) and source.kind != "file" else ""
            out = {"error": f"{shard}{type(e).__name__}: {e}"}
        return {"name": name, "seconds": time.perf_counter() - t0, **out}

    def _prepare(self, name: str, source) -> dict:
        if isinstance(source, Record):
            video = source.is_video
            if self._reader is None:
                self._reader = RecordReader()
            source = self._reader.read(source)  # bytes, or a file's path
            if isinstance(source, str) and not video:
                video = is_video(source)
        else:
            video = isinstance(source, (str, os.PathLike)) and is_video(os.fspath(source))
        if video:
            return self._video(name, source)
        if isinstance(source, (str, os.PathLike)):  # read once: hashed, then decoded from memory
            with open(source, "rb") as f:
                source = f.read()
        if isinstance(source, bytes):
            digest = hashlib.sha256(source).hexdigest()
            draft = draft_size(source, self.config, self.variant) if self.fast_decode else None
            source = load_image(source, draft_to=draft, name=name)
        else:
            digest = _pixels_digest(source)
        rows, grid = image_patches(source, self.config, self.variant, name)
        return {"data": rows, "grid": list(grid), "timestamps": [float("nan")], "digest": digest}

    def _video(self, name: str, source) -> dict:
        from qwen_vit_jax.preprocess.video import preprocess_video

        cfg = self.video_config
        with _as_file(source) as path:
            digest = _file_digest(path)
            patches, grid, ts = preprocess_video(path, config=cfg, uint8=True)
        t, h, w = grid[0].tolist()
        times = "no timestamps" if ts is None else f"{ts[0]:.2f}..{ts[-1]:.2f} s"
        note = f"video {name}: {t} x {h}x{w} patches ({len(patches) // cfg.merge_size**2:,} tokens), {times}"
        stamps = np.full(t, np.nan) if ts is None else np.asarray(ts, np.float64)
        return {
            "data": patches.data,
            "grid": [t, h, w],
            "timestamps": stamps.tolist(),
            "note": note,
            "video": True,
            "digest": digest,
        }


@contextlib.contextmanager
def _as_file(source):
    """A video's path: a file as it is, bytes (a tar member) in a temporary file for PyAV."""
    if not isinstance(source, bytes):
        yield os.fspath(source)
        return
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".video") as f:
        f.write(source)
        f.flush()
        yield f.name


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pixels_digest(image) -> str:
    """An in-memory image's digest: its mode or dtype, shape and pixels."""
    if hasattr(image, "tobytes") and hasattr(image, "mode"):  # PIL
        head, data = f"PIL {image.mode} {image.size}", image.tobytes()
    else:
        a = np.ascontiguousarray(image)
        head, data = f"array {a.dtype} {a.shape}", a.tobytes()
    return hashlib.sha256(head.encode() + b"\0" + data).hexdigest()


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
    ):
        import grain
        from absl import flags

        if not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be an int >= 0, got {workers!r}")
        if not flags.FLAGS.is_parsed():  # Grain reads absl flags; a library must not parse argv
            flags.FLAGS.mark_as_parsed()
        self.workers = min(workers, len(inputs))
        self._tables = {False: pixel_table(config), True: pixel_table(video_config)}
        self._t = {False: config.temporal_patch_size, True: video_config.temporal_patch_size}
        elements = [_element(i, x) for i, x in enumerate(inputs)]
        ds = grain.MapDataset.source(elements).map(Prepare(config, video_config, variant, fast_decode))
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
        if d.get("error"):
            return Item(d["name"], None, None, None, error=d["error"], seconds=d["seconds"])
        video = bool(d.get("video", False))
        data = np.array(d["data"])  # out of the worker's shared memory (freed with its element)
        from qwen_vit_jax.plan.contract import Patches

        patches = Patches(data, self._tables[video], self._t[video])
        return Item(
            d["name"],
            patches,
            np.array([d["grid"]], np.int64),
            np.array(d["timestamps"], np.float64),
            note=d.get("note"),
            seconds=d["seconds"],
            is_video=video,
            digest=d.get("digest"),
        )

    def close(self) -> None:
        """Stop the workers, and free the shared memory their outputs came in."""
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
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
    """A worker's start: it ends with the main process however that ends (SIGKILL included); Ctrl-C
    and SIGTERM are the main process's to handle (it saves, then closes the workers); the allocator
    set for image work."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tune_allocator()


def tune_allocator() -> bool:
    """glibc's malloc set for a process that decodes and resizes images one after another: buffers
    below 64 MiB come from the heap and stay there (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD), instead of
    fresh pages from the kernel for every decoded frame and every resize pass, whose page faults
    are slow on small VMs (the decode + resize before and after: benchmarks/history.md, "Host cost
    per input, one core"); the same pixels. Process-
    wide, so the worker processes and the CLI call it, never a library call on a user's process.
    Returns whether it applied (glibc only)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 64 << 20)) and bool(mallopt(m_trim_threshold, 256 << 20))


def default_workers() -> int:
    """The cores left after the main process (at least 0)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(cores - 1, 0)


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
