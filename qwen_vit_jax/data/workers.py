"""Worker processes: how many by default (one rule for `qwen-vit-jax encode`, `qvj.data.load`'s
callers and `qwen-vit-jax serve`), how every worker starts (`start_worker`: the Grain workers of
`encode` and the pools below alike), and `WorkerPool`: spawned processes that each run a job
function on one job at a time and stream what it yields back in order.

    pool = WorkerPool(work, args, workers=2)     # work(*args, job) -> an iterator of messages
    task = pool.submit(job)
    for message in task:                          # in order, as the worker makes them
        ...
    pool.close()

A task's messages flow with backpressure: a worker stops when `ahead` messages wait for its
consumer (the pipe holds one more), so a long job's memory follows a few messages, not the job.
A worker that dies (killed, out of memory) fails its task with `WorkerDied` and is replaced at once;
an idle worker that dies is replaced within WATCH_S. `workers=0` runs jobs in a thread of this
process. No jax here: a worker imports numpy, PIL and the preprocessing only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait

WATCH_S = 0.1  # how often an idle feeder checks that its worker is alive
AHEAD = 2  # messages a task holds for its consumer before its worker waits


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_workers() -> int:
    """Worker processes by default: one per core the main process leaves (it dispatches the
    device's calls and packs them, or serves HTTP), at least one, so that decoding never runs in
    the main process (a decoder that crashes or stalls costs a worker, which is replaced, not the
    run or the server). No upper bound: a fast accelerator can use a dozen cores of decode and
    resize (benchmarks/history.md, the cores each device needs). `encode` still prepares runs of
    fewer than 32 inputs in its own process (a worker's start costs more than it saves)."""
    return max(cores() - 1, 1)


def start_worker() -> None:
    """The start of every worker process the package spawns (Grain's and `WorkerPool`'s): it ends
    with its parent however that ends (SIGKILL included); Ctrl-C and SIGTERM are the parent's to
    handle (it saves or drains, then closes the workers); the allocator set for image work."""
    from qwen_vit_jax.processes import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tune_allocator()


def tune_allocator() -> bool:
    """glibc's malloc set for a process that decodes and resizes images one after another: buffers
    below 64 MiB come from the heap and stay there (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD), instead of
    fresh pages from the kernel for every decoded frame and every resize pass, whose page faults
    are slow on small VMs (the decode + resize before and after: benchmarks/history.md, "Host cost
    per input, one core"); the same pixels. Process-wide, so the worker processes and the CLI call
    it, never a library call on a user's process. Returns whether it applied (glibc only)."""
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


class WorkerDied(RuntimeError):
    """The worker process running a task died (the task did not finish); `reason` in words."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


END = object()  # what `Task.next()` gives after the last message


class Task:
    """One job for the pool, and the messages its worker yields, in order. Iterate it (blocking), or
    await `next()` futures (a service's event loop); `cancel()` drops what is left: the worker stops
    at its next message."""

    def __init__(self, job, ahead: int = AHEAD):
        self.job, self.ahead = job, ahead
        self.cancelled = False
        self._cond = threading.Condition()
        self._items: collections.deque = collections.deque()
        self._waiter: concurrent.futures.Future | None = None

    def next(self) -> concurrent.futures.Future:
        """A future of the next message (END after the last one); its exception is the task's
        failure (WorkerDied, or what the job raised in a thread pool)."""
        f: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._items:
                _settle(f, self._items.popleft())
                self._cond.notify_all()
            else:
                self._waiter = f
        return f

    def __iter__(self) -> Iterator:
        try:
            while (message := self.next().result()) is not END:
                yield message
        finally:
            self.cancel()

    def cancel(self) -> None:
        with self._cond:
            self.cancelled = True
            self._cond.notify_all()

    def _put(self, item) -> bool:
        """The feeder's: deliver `item` (a message, END or an exception), waiting while `ahead`
        messages wait; False once the task is cancelled."""
        with self._cond:
            while len(self._items) >= self.ahead and not self.cancelled:
                self._cond.wait(WATCH_S)
            if self.cancelled:
                return False
            waiter, self._waiter = self._waiter, None
            if waiter is None:
                self._items.append(item)
        if waiter is not None:
            _settle(waiter, item)
        return True


def _settle(f: concurrent.futures.Future, item) -> None:
    if isinstance(item, BaseException):
        f.set_exception(item)
    else:
        f.set_result(item)


def _worker_main(conn, work: Callable, args: tuple) -> None:
    """A worker's loop: a job in, ("msg", m) per message out, then ("end", None); a "stop" from the
    feeder between messages ends the job early."""
    start_worker()
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
            while isinstance(job, str):  # a "stop" that came after its job had ended
                job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        for message in work(*args, job):
            conn.send(("msg", message))
            if conn.poll() and conn.recv() == "stop":
                break
        conn.send(("end", None))


class WorkerPool:
    """`workers` worker processes (0: one thread here) running `work(*args, job)` on `Task`s, in
    submission order (module docstring). `work` and `args` are pickled to each worker: a
    module-level function and plain values.

    on_replace: called (no arguments) each time a dead worker is replaced. `pids()` lists the
    current workers' process ids, `busy_pids()` those running a task (what a test kills)."""

    def __init__(self, work: Callable, args: tuple, workers: int, on_replace=None, name: str = "qvj-worker"):
        self._work, self._args, self._name = work, args, name
        self._tasks: queue.Queue[Task | None] = queue.Queue()
        self._on_replace = on_replace or (lambda: None)
        self._ctx = multiprocessing.get_context("spawn")  # never fork a process that runs jax
        self._procs: list = [None] * max(workers, 1)
        self._inline = workers == 0
        self._lock = threading.Lock()
        self.replaced = 0
        self._started = threading.Semaphore(0)
        self._busy = [False] * len(self._procs)
        self._running: list[Task | None] = [None] * len(self._procs)  # each feeder's task
        self._threads = [
            threading.Thread(target=self._feed, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(len(self._procs))
        ]
        for t in self._threads:
            t.start()

    def submit(self, job) -> Task:
        task = Task(job)
        self._tasks.put(task)
        return task

    def waiting(self) -> int:
        """Tasks not yet taken by a worker."""
        return self._tasks.qsize()

    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p, _ in (x for x in self._procs if x is not None)]

    def busy_pids(self) -> list[int]:
        """The workers running a task right now."""
        with self._lock:
            return [x[0].pid for x, b in zip(self._procs, self._busy) if x is not None and b]

    def wait_started(self, timeout: float | None = None) -> bool:
        """Block until every worker has started (its imports done); False on timeout."""
        for _ in self._threads:
            if not self._started.acquire(timeout=timeout):
                return False
        return True

    def close(self, cancel: bool = False) -> None:
        """Stop the feeders (after the tasks already queued; with `cancel`, those and the running
        ones dropped: their workers stop at their next message) and end the workers."""
        if cancel:
            while True:
                try:
                    task = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task.cancel()
            for task in list(self._running):
                if task is not None:
                    task.cancel()
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join(timeout=30)

    # ---- a feeder thread per worker ------------------------------------------------------------
    def _feed(self, i: int) -> None:
        worker = None if self._inline else self._restart(i)  # started now: the first task pays no start-up
        self._started.release()
        try:
            while True:
                try:
                    task = self._tasks.get(timeout=WATCH_S)
                except queue.Empty:  # idle: a worker that died meanwhile is replaced before a task finds it
                    if worker is not None and not worker[0].is_alive():
                        worker = self._replace(i)
                    continue
                if task is None:
                    return
                if task.cancelled:
                    continue
                self._running[i] = task
                try:
                    if self._inline:
                        self._run_here(task)
                        continue
                    if worker is None:
                        worker = self._start(i)
                    self._busy[i] = True
                    self._ask(worker, task)
                except WorkerDied as e:
                    task._put(e)
                    worker = self._replace(i)
                finally:
                    self._busy[i] = False
                    self._running[i] = None
        finally:
            if not self._inline:
                self._stop(i)

    def _run_here(self, task: Task) -> None:
        messages = self._work(*self._args, task.job)
        try:
            for message in messages:
                if not task._put(message):
                    return
        except BaseException as e:  # noqa: BLE001 (handed to the task's consumer)
            task._put(e)
            return
        finally:
            messages.close()
        task._put(END)

    @staticmethod
    def _ask(worker, task: Task) -> None:
        """Run `task` on `worker`, its messages handed over as they come; WorkerDied if it dies."""
        proc, conn = worker
        stopped = False
        try:
            conn.send(task.job)
            while True:
                if conn not in wait([conn, proc.sentinel]):
                    break
                kind, message = conn.recv()
                if kind == "end":
                    task._put(END)
                    return
                if not stopped and not task._put(message):  # cancelled: stop the job, read what it sent
                    conn.send("stop")
                    stopped = True
        except (EOFError, OSError, BrokenPipeError):
            pass
        proc.join(timeout=5)
        reason = _exit_reason(proc.exitcode)
        raise WorkerDied(f"the preparation worker (pid {proc.pid}) died ({reason})", reason)

    def _start(self, i: int):
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_worker_main, args=(child, self._work, self._args), name=f"{self._name}-{i}", daemon=True
        )
        proc.start()
        child.close()
        ready = wait([parent, proc.sentinel])
        if parent not in ready:
            raise WorkerDied(f"worker {i} exited at start (exit code {proc.exitcode})")
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

    def _restart(self, i: int):
        """A fresh worker i, or None when it cannot start (tried again with the next task)."""
        try:
            return self._start(i)
        except (WorkerDied, OSError):
            return None

    def _replace(self, i: int):
        self._stop(i)
        self.replaced += 1
        self._on_replace()
        return self._restart(i)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "pipe closed"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
