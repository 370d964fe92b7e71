"""One VisionEncoder shared by several threads: the plan cache (and its buffer pool) and the
per-bucket compile cache are shared state; results must equal the serial ones bit for bit, and a
bucket two threads ask for at the same time must be compiled once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.runtime import program as program_module
from qwen_vit_jax.runtime.encoder import VisionEncoder

# Small buckets so that some requests split into chunks (several programs per call).
POLICY = planlib.BucketPolicy(max_patches=256)
REQUESTS = [
    [[1, 8, 8]],
    [[1, 16, 12]],
    [[3, 8, 10]],  # 240 rows: one chunk
    [[2, 12, 12], [1, 4, 6]],  # 312 rows: split at a frame boundary
    [[1, 10, 14], [1, 2, 2], [2, 6, 8]],
    [[4, 10, 10]],  # 400 rows: split inside the video
]


def _pixels(grid, seed):
    n = sum(t * h * w for t, h, w in grid)
    return np.random.default_rng(seed).standard_normal((n, 1176)).astype(np.float32)


def _run_threads(n_threads, target):
    barrier = threading.Barrier(n_threads)
    errors = []

    def body(i):
        try:
            barrier.wait()
            target(i)
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("declared", [False, True], ids=["ladder", "declared-tight"])
def test_four_threads_give_the_serial_results(tiny_dirs, declared):
    """Results do not depend on call history: every thread's every call equals one serial pass bit
    for bit, whatever the other threads ran before it (the default; and with some sizes declared
    tight by warmup, which then run their tight buckets from the first call on)."""
    inputs = [(_pixels(g, i), g) for i, g in enumerate(REQUESTS)]
    tight = REQUESTS[1::2]  # half the sizes declared: they and the ladder's sizes race

    def encoder():
        enc = VisionEncoder.from_pretrained(tiny_dirs[1], policy=POLICY)
        if declared:
            enc.warmup(tight, tight=True)
        return enc

    serial_enc = encoder()
    serial = [serial_enc.encode(px, g) for px, g in inputs]  # one serial pass

    # A fresh encoder and cold plan caches: compiles and plan builds race as well.
    planlib.clear_caches()
    enc = encoder()
    results = {}

    def work(i):
        order = np.random.default_rng(i).permutation(len(inputs))  # each thread its own order
        for _ in range(2):
            for j in order:
                out = enc.encode(*inputs[j])
                results.setdefault(j, []).append(out)

    _run_threads(4, work)
    for j in range(len(inputs)):
        assert len(results[j]) == 8
        for out in results[j]:
            np.testing.assert_array_equal(out, serial[j])
    assert enc.compile_count == serial_enc.compile_count
    assert set(enc.compile_seconds) == set(serial_enc.compile_seconds)
    if declared:  # the declared sizes did run other (tight) buckets than the ladder would
        ladder = VisionEncoder.from_pretrained(tiny_dirs[1], policy=POLICY)
        assert any(ladder.cost_report(g)["buckets"] != enc.cost_report(g)["buckets"] for g in tight)


def test_one_bucket_requested_by_two_threads_compiles_once(tiny_dirs, monkeypatch):
    enc = VisionEncoder.from_pretrained(tiny_dirs[1])
    starts = []
    input_specs = program_module.input_specs

    def slow_input_specs(*args):  # the first step of a compile: count it, and widen the race
        starts.append(threading.get_ident())
        time.sleep(0.3)
        return input_specs(*args)

    # (JAX itself dedups concurrent traces of one function, so counting traces would not see a
    # double compile; counting our compile's first step does.)
    monkeypatch.setattr(program_module, "input_specs", slow_input_specs)
    (bucket,) = enc.warmup([[[1, 12, 12]]])
    assert len(starts) == 1 and enc.compile_count == 1
    other = [[1, 30, 30]]  # another bucket: 900 rows
    assert planlib.make_plan(other, enc.cfg).bucket != bucket
    px = _pixels(other, 0)
    outs = [None, None]

    def work(i):
        outs[i] = enc.encode(px, other)

    _run_threads(2, work)
    assert len(starts) == 2 and enc.compile_count == 2
    np.testing.assert_array_equal(outs[0], outs[1])
