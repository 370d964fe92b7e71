"""The preparation worker pool: a request's item -> its header and its pieces, in worker processes.

The pool is `data.workers.WorkerPool` running `data.items.stream`: the item path `qwen-vit-jax
encode` takes (one start-up for every worker, one `prepare`), on the bytes a request sent, with the
service's `Limits` checked before anything is decoded. A video comes back as its header (grid,
timestamps, known from its container) and then its frame groups, one piece of at most the patch
budget at a time, decoded as the service hands them to the batcher: a long video holds a few
groups, never itself, and shares the device with other requests group by group.

A worker that dies (killed, out of memory) fails the item it held with `WorkerDied` (the request gets
503, errors.Unavailable: nothing is lost silently) and is replaced at once; an idle worker that dies
is replaced within WATCH_S. `workers=0` prepares in a thread of the server process (tests; a process with nothing to
spare). Workers ignore SIGINT and SIGTERM: a signal to the process group reaches the server, which
drains what is in flight (the workers keep preparing) and then closes the pool. No jax in a worker.
"""

from __future__ import annotations

from qwen_vit_jax.data.items import Job, Limits, stream
from qwen_vit_jax.data.workers import END, WorkerDied, WorkerPool

__all__ = ["END", "Job", "Limits", "WorkerDied", "preparation_pool"]


def preparation_pool(preprocessing, limits: Limits, budget: int, workers: int, on_replace=None) -> WorkerPool:
    """The service's pool: `workers` processes (0: a thread) preparing `Job`s under `preprocessing`
    and `limits`, a video's pieces of at most `budget` patches. `pool.submit(Job(...))` -> a Task
    whose messages are the item's header (a `data.items.Item` without pieces), then its pieces."""
    return WorkerPool(stream, (preprocessing, limits, budget), workers, on_replace, name="qvj-prepare")
