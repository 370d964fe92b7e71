"""Child processes that end with their parent, however the parent ends.

Every process the package starts (the encode pipeline's Grain workers, the service's preparation
workers) calls `die_with_parent` first thing. Without it a worker outlives a parent killed by
SIGKILL or the out-of-memory killer: it sits under init, holding its memory, and with it
multiprocessing's resource tracker. The tracker (multiprocessing starts it, with no initializer to
hook) needs no call: it ends by itself once every process holding its pipe (the parent and each
worker) has ended, after unlinking the shared memory they left.

The mechanism is a watch on a pipe from the parent, on Linux and macOS alike: a process started by
multiprocessing holds the read end of a pipe whose write end only its parent process holds, so
the read end reports end-of-file the moment the parent is gone, whichever way it went. A thread
waits on it and then kills its own process.

Linux's `prctl(PR_SET_PDEATHSIG)` is not used: it fires when the *thread* that started the child
ends (prctl(2)), not its process, and Grain starts its workers from its own prefetch threads, whose
lives are Grain's business: it would tie each worker to one of them. The watch has one limit: it
acts once the worker's main thread lets go of the GIL, so a C call that holds it finishes first
(decoders and resizes release it).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import wait


def die_with_parent() -> None:
    """In a process multiprocessing started with "spawn" (the package's method: it never forks a
    process that runs jax): from now on, end this process (SIGKILL: no cleanup of its own can hang)
    as soon as its parent process ends. A parent already gone ends it at once. Call it first in a
    worker's initializer. ("fork" children are not covered: a sibling forked later inherits the
    parent's end of the pipe and keeps it open.)

    Raises RuntimeError in a process that multiprocessing did not start (no parent pipe to watch).
    """
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        raise RuntimeError("die_with_parent: this process was not started by multiprocessing")
    threading.Thread(target=_watch, args=(parent.sentinel,), name="qvj-parent-watch", daemon=True).start()


def _watch(sentinel: int) -> None:
    wait([sentinel])  # end-of-file: the parent's end of the pipe is closed, i.e. the parent is gone
    os.kill(os.getpid(), signal.SIGKILL)
