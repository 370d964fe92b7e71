"""Inputs grouped into calls by patch budget (`pack`: `VisionEncoder.encode_images`, the CLI's
encode loop) and sequences cut into consecutive ranges of nearly equal size (`split_even`: rounds
over devices, slices over processes). No jax here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def pack(items: Iterable[T], budget: int, size: Callable[[T], int]) -> Iterator[list[T]]:
    """Consecutive items in lists whose sizes sum to at most `budget` (an item larger than the
    budget alone), in order. Lazy: an item is read only when the list before it is full."""
    if budget <= 0:
        raise ValueError(f"the patch budget must be positive, got {budget}")
    batch: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if batch and total + n > budget:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += n
    if batch:
        yield batch


def split_even(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Cut a sequence into `parts` consecutive [start, stop) ranges of nearly equal total size.

    Cut i sits at the item boundary whose prefix total is closest to i / parts of the whole (ties:
    the earlier boundary), so a range is off the mean by at most about one item. Consecutive on
    purpose: the ranges concatenated are the input order, so per-range outputs concatenate to the
    single-range output. Deterministic (every process computes the same ranges); a range may be
    empty when there are fewer items than parts.
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    cum = np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))])  # [n + 1] prefix totals
    cuts = [0]
    for i in range(1, parts):
        target = cum[-1] * i / parts
        j = int(np.searchsorted(cum, target))  # first boundary with prefix >= target
        if j > 0 and target - cum[j - 1] <= cum[j] - target:
            j -= 1
        cuts.append(max(j, cuts[-1]))
    cuts.append(len(cum) - 1)
    return list(zip(cuts[:-1], cuts[1:]))
