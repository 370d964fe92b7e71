"""The preparation worker pool: an item's bytes -> uint8 patch rows, in worker processes.

Each worker is a spawned process running the CLI's per-input pipeline (`qwen_vit_jax.data.pipeline.
Prepare`: decode, resize, patchify) on the bytes it is sent; a feeder thread in the server process
owns each worker, sends it one item at a time and waits for the answer or the worker's end. A
worker that dies (killed, out of memory) fails the item it held with `WorkerDied` (the request gets
503: nothing is lost silently) and is replaced at once by a fresh process; an idle worker that dies
is replaced within WATCH_S, before an item meets it. `workers=0` prepares in a
thread of the server process (tests; a process with nothing to spare).

Workers ignore SIGINT and SIGTERM: a signal to the process group reaches the server, which drains
what is in flight (the workers keep preparing) and then closes the pool. No jax here: a worker
imports numpy, PIL and the preprocessing only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import queue
import signal
import tempfile
import threading
from multiprocessing.connection import wait

WATCH_S = 0.1  # how often an idle feeder checks that its worker is alive


class WorkerDied(RuntimeError):
    """The worker process preparing an item died (the item was not prepared)."""


@dataclasses.dataclass(eq=False)
class Task:
    """One item to prepare: kind "image" or "video", its bytes, a video's fps (None: the checkpoint's
    sampling). `future` gets the worker's dict (Prepare's: data, grid, timestamps, digest; or error)."""

    kind: str
    payload: bytes
    fps: float | None = None
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    cancelled: bool = False


def prepare_item(config, video_config, variant: str, kind: str, payload: bytes, fps: float | None) -> dict:
    """What a worker does with one item: Prepare's dict for its bytes. A video goes through a
    temporary file of the worker's own (PyAV reads files); the request never names a path. Without
    PyAV a video's dict has "missing": "av" (the server's fault, answered 500, not the client's 400)."""
    from qwen_vit_jax.data.pipeline import Prepare
    from qwen_vit_jax.preprocess.config import Preprocessing

    if kind == "video":
        try:
            import av  # noqa: F401
        except ImportError:  # the server's lack, not the client's fault: a 5xx naming the extra
            return {"error": "PyAV is not installed: pip install 'qwen_vit_jax[serve]' carries it", "missing": "av"}
        if fps is not None:  # what fps= does, said once: Preprocessing.with_limits
            video_config = Preprocessing(image=config, video=video_config, variant=variant).with_limits(fps=fps).video
        with tempfile.NamedTemporaryFile(suffix=".mp4") as f:  # the suffix makes Prepare read it as a video
            f.write(payload)
            f.flush()
            out = Prepare(config, video_config, variant, False)(("video", f.name))
        if "error" in out:  # the worker's temporary file is no business of the client's
            out["error"] = out["error"].replace(f.name, "the video")
        return out
    return Prepare(config, video_config, variant, False)(("image", payload))


def _worker_main(conn, config, video_config, variant: str) -> None:
    """A worker's loop: (kind, payload, fps) in, Prepare's dict out, until None or the pipe closes."""
    from qwen_vit_jax.data.pipeline import tune_allocator
    from qwen_vit_jax.processes import die_with_parent

    die_with_parent()  # even while preparing an item (a long video) when the server is killed
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tune_allocator()
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        conn.send(prepare_item(config, video_config, variant, *job))


class PreparePool:
    """`workers` worker processes (0: one thread here) preparing `Task`s in submission order.

    on_replace: called (no arguments) each time a dead worker is replaced. `pids()` lists the
    current workers' process ids (what a test kills)."""

    def __init__(self, config, video_config, variant: str, workers: int, on_replace=None):
        self._args = (config, video_config, variant)
        self._tasks: queue.Queue[Task | None] = queue.Queue()
        self._on_replace = on_replace or (lambda: None)
        self._ctx = multiprocessing.get_context("spawn")  # never fork a process that runs jax
        self._procs: list = [None] * max(workers, 1)
        self._inline = workers == 0
        self._lock = threading.Lock()
        self.replaced = 0
        self._started = threading.Semaphore(0)
        self._busy = [False] * len(self._procs)
        self._threads = [
            threading.Thread(target=self._feed, args=(i,), name=f"qvj-prepare-{i}", daemon=True)
            for i in range(len(self._procs))
        ]
        for t in self._threads:
            t.start()

    def submit(self, task: Task) -> Task:
        self._tasks.put(task)
        return task

    def waiting(self) -> int:
        """Tasks not yet taken by a worker."""
        return self._tasks.qsize()

    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p, _ in (x for x in self._procs if x is not None)]

    def close(self) -> None:
        """Stop the feeders (after the tasks already queued) and end the workers."""
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join(timeout=30)

    # ---- a feeder thread per worker ------------------------------------------------------------
    def _start(self, i: int):
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, *self._args), name=f"qvj-prepare-{i}", daemon=True)
        proc.start()
        child.close()
        ready = wait([parent, proc.sentinel])
        if parent not in ready:
            raise WorkerDied(f"preparation worker {i} exited at start (exit code {proc.exitcode})")
        parent.recv()
        with self._lock:
            self._procs[i] = (proc, parent)
        return proc, parent

    def _stop(self, i: int) -> None:
        with self._lock:
            entry, self._procs[i] = self._procs[i], None
        if entry is None:
            return
        proc, conn = entry
        try:
            conn.send(None)
        except OSError:
            pass
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()

    def _feed(self, i: int) -> None:
        worker = None if self._inline else self._restart(i)  # started now: the first item pays no start-up
        self._started.release()
        try:
            while True:
                try:
                    task = self._tasks.get(timeout=WATCH_S)
                except queue.Empty:  # idle: a worker that died meanwhile is replaced before an item finds it
                    if worker is not None and not worker[0].is_alive():
                        worker = self._replace(i)
                    continue
                if task is None:
                    return
                if task.cancelled or not task.future.set_running_or_notify_cancel():
                    continue
                if self._inline:
                    try:
                        task.future.set_result(prepare_item(*self._args, task.kind, task.payload, task.fps))
                    except BaseException as e:  # noqa: BLE001 (handed to the waiting request)
                        task.future.set_exception(e)
                    continue
                try:
                    if worker is None:
                        worker = self._start(i)
                    self._busy[i] = True
                    result = self._ask(worker, task)
                except WorkerDied as e:
                    task.future.set_exception(e)  # its request answers 503
                    worker = self._replace(i)
                    continue
                finally:
                    self._busy[i] = False
                task.future.set_result(result)
        finally:
            if not self._inline:
                self._stop(i)

    def _restart(self, i: int):
        """A fresh worker i, or None when it cannot start (tried again with the next item)."""
        try:
            return self._start(i)
        except (WorkerDied, OSError):
            return None

    def _replace(self, i: int):
        self._stop(i)
        self.replaced += 1
        self._on_replace()
        return self._restart(i)

    def busy_pids(self) -> list[int]:
        """The workers preparing an item right now."""
        with self._lock:
            return [x[0].pid for x, b in zip(self._procs, self._busy) if x is not None and b]

    def wait_started(self, timeout: float | None = None) -> bool:
        """Block until every worker has started (its imports done); False on timeout."""
        for _ in self._threads:
            if not self._started.acquire(timeout=timeout):
                return False
        return True

    @staticmethod
    def _ask(worker, task: Task) -> dict:
        proc, conn = worker
        try:
            conn.send((task.kind, task.payload, task.fps))
            ready = wait([conn, proc.sentinel])
            if conn in ready:
                return conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            pass
        proc.join(timeout=5)
        raise WorkerDied(f"the preparation worker (pid {proc.pid}) died ({_exit_reason(proc.exitcode)})")


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "pipe closed"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
