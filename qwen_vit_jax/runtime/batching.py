"""Which items share a device call (`Grouping`: the one rule, for `VisionEncoder.encode_patches`,
the CLI's encode loop and the service's batcher), the one packer of consecutive pieces into calls
(`Packer`: grouping, join, encode, split; `encode_patches`, the encode loop and Ray's stage), the
batch shapes a service warms up before it is ready (`warm_batches`), and sequences cut into
consecutive ranges of nearly equal size (`split_even`: rounds over devices, slices over processes).
No device work here but the `encode` a Packer is given.

The rule: items share a call when they have one pixel form (the same Patches table, temporal
patch size and frames per row; or float rows of one width) and their patches fit the budget; a
larger item runs alone. Calls that run in batch plans (`VisionEncoder.prepare_batch`, the
service) also keep frame classes close: a batch plan's key window follows its widest frame's
class, which much smaller frames would pay for, so an item joins only if its widest frame's class
is the head's or up to SPREAD times smaller. Ladder plans choose their key window and tiles per
call (plan/kernels.py), so there sizes mix freely and packs fill the budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import numpy as np

from qwen_vit_jax.plan import BucketPolicy, Patches, batch_rows, frame_class

T = TypeVar("T")
SPREAD = 4  # batch plans: an item's widest frame class is the head's or up to this many times smaller


@dataclasses.dataclass(frozen=True)
class Shape:
    """What grouping reads of one item: its patch rows, its pixel form (items of two forms never
    share a call) and the frame class of its widest frame (plan.frame_class)."""

    rows: int
    form: tuple
    widest: int


def shape_of(pixels, grid) -> Shape:
    """The `Shape` of an item: uint8 `Patches` or float rows [N, patch_dim], its grid [k, 3]."""
    g = np.asarray(grid).reshape(-1, 3)
    if isinstance(pixels, Patches):
        form = (pixels.table.tobytes(), pixels.temporal_patch_size, pixels.frames_per_patch)
    else:
        form = ("rows", np.shape(pixels)[-1])
    return Shape(len(pixels), form, frame_class(int((g[:, 1] * g[:, 2]).max())))


@dataclasses.dataclass(frozen=True)
class Grouping:
    """The rule (see the module docstring): at most `budget` patches per call; `batched`: the calls
    run in batch plans, so frame classes stay within SPREAD of the head's."""

    budget: int
    batched: bool = False

    def __post_init__(self):
        if not isinstance(self.budget, int) or self.budget <= 0:
            raise ValueError(f"the patch budget must be a positive int, got {self.budget!r}")

    def admits(self, head: Shape, item: Shape) -> bool:
        """Whether `item` may share a call led by `head`, its rows aside."""
        if item.form != head.form:
            return False
        return not self.batched or head.widest <= SPREAD * item.widest <= SPREAD * head.widest

    def joins(self, head: Shape | None, rows: int, item: Shape) -> bool:
        """Whether `item` joins a call led by `head` that holds `rows` patches (an empty call, head
        None: always)."""
        return head is None or (self.admits(head, item) and rows + item.rows <= self.budget)

    def pack(self, items: Iterable[T], shape: Callable[[T], Shape]) -> Iterator[list[T]]:
        """Consecutive items in calls, in order: a call ends where the next item does not join it.
        Lazy: an item is read only when the call before it is full."""
        batch: list[T] = []
        head, rows = None, 0
        for item in items:
            s = shape(item)
            if not self.joins(head, rows, s):
                yield batch
                batch, head, rows = [], None, 0
            batch.append(item)
            head, rows = head or s, rows + s.rows
        if batch:
            yield batch

    def take(self, queue: Iterable[T], shape: Callable[[T], Shape]) -> tuple[list[T], bool]:
        """The call the first item of a queue leads: it plus the later items it admits, in order,
        passing over the others, until one would not fit. Returns (those items, whether the call is
        full: an admitted item did not fit, or the budget is reached)."""
        batch: list[T] = []
        head, rows = None, 0
        for item in queue:
            s = shape(item)
            if head is not None and not self.admits(head, s):
                continue
            if not self.joins(head, rows, s):
                return batch, True
            batch.append(item)
            head, rows = head or s, rows + s.rows
        return batch, rows >= self.budget


class Packer:
    """Consecutive pieces (an image's rows, a video's frame group) in device calls: a call ends where
    the next piece does not join it (`Grouping`), its pixels are joined, encoded with `encode`
    (`VisionEncoder.encode`: ladder plans; a batch-plan encode works the same) and its rows split
    back per piece. Each piece carries a tag, handed back with its rows.

        packer = Packer(enc.encode, Grouping(budget), enc.cfg.merge_unit)
        done = packer.add(tag, pixels, grid)      # [(tag, tokens)] of the call this piece closed
        done += packer.flush()                    # the last call
    """

    def __init__(self, encode: Callable, grouping: Grouping, merge_unit: int):
        self.encode, self.grouping, self.merge_unit = encode, grouping, merge_unit
        self.calls = 0  # device calls made
        self._batch: list[tuple] = []  # (tag, pixels, grid [k, 3])
        self._head: Shape | None = None
        self._rows = 0

    def __len__(self) -> int:
        """Pieces waiting for their call."""
        return len(self._batch)

    def add(self, tag, pixels, grid) -> list[tuple]:
        """Queue a piece: pixels (`Patches` or float rows) and its grid [k, 3]. Returns the pieces
        (tag, float32 tokens [rows / merge_unit, D]) of the call it closed, if it closed one."""
        shape = shape_of(pixels, grid)
        done = [] if self.grouping.joins(self._head, self._rows, shape) else self.flush()
        self._batch.append((tag, pixels, np.asarray(grid).reshape(-1, 3)))
        self._head, self._rows = self._head or shape, self._rows + shape.rows
        return done

    def flush(self) -> list[tuple]:
        """Encode the pieces waiting, as one call: [(tag, tokens)], in order."""
        if not self._batch:
            return []
        tags, pixels, grids = zip(*self._batch)
        self._batch, self._head, self._rows = [], None, 0
        tokens = self.encode(join(list(pixels)), np.concatenate(grids))  # [sum rows / mu, D]
        self.calls += 1
        return list(zip(tags, split(tokens, [len(px) // self.merge_unit for px in pixels])))


def join(parts: list):
    """Items' pixels one after another, for one call: `Patches` (Patches.concatenate: an image's
    frame repeated beside a video's T) or float rows."""
    if all(isinstance(p, Patches) for p in parts):
        return parts[0] if len(parts) == 1 else Patches.concatenate(parts)
    if any(isinstance(p, Patches) for p in parts):
        raise ValueError("uint8 Patches and float pixel rows cannot share a call")
    return parts[0] if len(parts) == 1 else np.concatenate([np.asarray(p) for p in parts])


def split(rows: np.ndarray, tokens: Sequence[int]) -> list[np.ndarray]:
    """A call's result rows [sum(tokens), ...] -> one array (a view) per item of `tokens` rows."""
    return np.split(rows, np.cumsum(tokens)[:-1])


def warm_batches(sizes: Sequence[tuple[int, int, int]], grouping: Grouping, policy: BucketPolicy) -> list[list[tuple]]:
    """Batches of these item sizes (grids (t, h, w): t > 1 a video's, else an image's) that land in
    every batch-plan shape a batched `grouping` can form of them: with each size at the head, one
    batch per rung of the batch-rows ladder (plan.batch_rows) from two items up to the budget,
    filled with the sizes the head admits, largest first. One batch per (rung, frame class, pixel
    form): what a service compiles before it is ready (its declared sizes under its budget)."""
    cap = min(grouping.budget, policy.max_patches)  # a batch plan holds at most max_patches rows
    sizes = sorted({tuple(int(x) for x in s) for s in sizes})
    shapes = {(t, h, w): Shape(t * h * w, ("video" if t > 1 else "image",), frame_class(h * w)) for t, h, w in sizes}
    out, seen = [], set()
    for head in sizes:
        mates = sorted((g for g in sizes if grouping.admits(shapes[head], shapes[g])), key=lambda g: -shapes[g].rows)
        low = shapes[head].rows + shapes[mates[-1]].rows  # the fewest rows of two items
        rung, below = (batch_rows(low, policy), 0) if low <= cap else (None, 0)
        while rung is not None:
            batch, rows = [head], shapes[head].rows
            for g in mates:  # largest first, as many as fit under the rung
                k = (min(rung, cap) - rows) // shapes[g].rows
                batch, rows = batch + [g] * k, rows + k * shapes[g].rows
            key = (rung, shapes[head].widest, shapes[head].form)
            if len(batch) > 1 and rows > below and key not in seen:
                seen.add(key)
                out.append(batch)
            below, rung = rung, batch_rows(rung + 1, policy) if rung < cap else None
    return out


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
