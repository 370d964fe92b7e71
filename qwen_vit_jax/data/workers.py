"""How many preparation worker processes: one rule for `qwen-vit-jax encode`, `qvj.data.load`'s
callers and `qwen-vit-jax serve`. Imports nothing heavy (the CLIs' --help reads it)."""

from __future__ import annotations

import os


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
