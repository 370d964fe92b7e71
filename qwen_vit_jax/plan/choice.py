"""Which buckets a request runs in, on one device: the encoder's bucket choice.

The words, here once:
  ladder, rung   BucketPolicy's geometric list of padded row counts N_pad; a chunk of a request
                 normally runs in the bucket of the smallest rung that holds it (buckets.py), so a
                 stream of arbitrary sizes compiles a bounded number of programs.
  chunk          a request above the per-program budget (policy.max_patches) is cut at frame
                 boundaries into chunks, one program call each (`split_grid`).
  tight bucket   a chunk's rows rounded up only as far as attention blocks need, its tiles sized
                 to its frames (BucketPolicy(tight=True)): less padding, one more program.
  declared size  a grid passed to `declare` (the encoder's `warmup(grids, tight=True)`): every
                 later request of exactly that grid runs in its tight buckets.
  recurring chunk  chunks of one request with the same frames (the equal chunks of a long video)
                 run in their tight bucket: a function of the request alone.
  batch plan     a request whose grid rows are independent items packed together (a service's
                 batch) may run in `batch_plans`: a bucket that depends on the rung and on the
                 class of its widest frame, not on the mix of sizes (assembly.make_batch_plan),
                 so random batches compile a bounded number of programs.
  tight_after    opt-in: a grid requested n times switches by itself to its tight buckets (at most
                 max_tight_buckets of them); its later results then differ from its first ones in
                 the last bits (float32: ~1e-6 relative, padding invariance).

Without tight_after a request's buckets are a function of its grid, the policy and the sizes
declared before it, so every call of a request gives the same bits, in any thread. Thread-safe:
one lock guards the declared sizes and the counts.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np

from ..config import VisionConfig
from .assembly import make_batch_plan, make_plan, make_plans
from .buckets import Bucket, BucketPolicy
from .contract import Plan
from .grid import Grid, as_grid


class BucketChoice:
    """The plans (so the buckets) of a request's program calls on one device.

    Args:
      cfg: the tower's config.
      policy: the ladder (default BucketPolicy()).
      tight_after: None, or an int n >= 1: a grid planned for its n-th encode switches to tight
        buckets (see the module docstring).
      max_tight_buckets: with tight_after, at most this many tight buckets are switched to; later
        recurring grids stay on the ladder. Declared sizes and recurring chunks do not count.
      capacity: grids whose encodes are counted (least recently encoded forgotten first).
    """

    def __init__(
        self,
        cfg: VisionConfig,
        policy: BucketPolicy | None = None,
        *,
        tight_after: int | None = None,
        max_tight_buckets: int = 16,
        capacity: int = 4096,
    ):
        if tight_after is not None and (not isinstance(tight_after, int) or tight_after < 1):
            raise ValueError(f"tight_after must be an int >= 1 or None, got {tight_after!r}")
        self.cfg, self.policy = cfg, policy or BucketPolicy()
        self.tight_after, self.max_tight_buckets, self.capacity = tight_after, max_tight_buckets, capacity
        self._seen: collections.OrderedDict[tuple, int] = collections.OrderedDict()  # grid -> encodes, LRU
        self._tight_buckets: set[Bucket] = set()  # switched to by tight_after
        self._declared: set[tuple] = set()
        self._lock = threading.Lock()

    def declare(self, grid_thw) -> Grid:
        """Declare a size that recurs: every later request of exactly this grid runs in its tight
        buckets. Returns the validated grid."""
        g = as_grid(grid_thw, self.cfg)
        with self._lock:
            self._declared.add(g.key)
        return g

    def is_declared(self, grid_thw) -> bool:
        g = as_grid(grid_thw, self.cfg)
        with self._lock:
            return g.key in self._declared

    def plans(self, grid_thw) -> list[Plan]:
        """The plans the next encode of this grid uses, one per program call: tight buckets for every
        chunk of a declared grid and, with tight_after, of a grid encoded tight_after - 1 times before
        (while fewer than max_tight_buckets such buckets exist); otherwise the ladder's, with tight
        buckets for the chunks whose frames recur within the request itself."""
        grid = as_grid(grid_thw, self.cfg)
        tight = dataclasses.replace(self.policy, tight=True)
        with self._lock:
            declared, seen = grid.key in self._declared, self._seen.get(grid.key, 0)
        if declared:
            return make_plans(grid, self.cfg, tight)
        if self.tight_after is not None and seen + 1 >= self.tight_after:
            plans = make_plans(grid, self.cfg, tight)
            with self._lock:
                new = {p.bucket for p in plans} - self._tight_buckets
                if len(self._tight_buckets) + len(new) <= self.max_tight_buckets:
                    self._tight_buckets |= new
                    return plans
        plans = make_plans(grid, self.cfg, self.policy)
        keys = [frames_key(p.grid_thw) for p in plans]
        repeats = collections.Counter(keys)
        if max(repeats.values()) < 2:
            return plans
        return [
            dataclasses.replace(make_plan(k, self.cfg, tight), span=p.span, grid_thw=p.grid_thw)
            if repeats[k] >= 2
            else p
            for p, k in zip(plans, keys)
        ]

    def batch_plans(self, grid_thw) -> list[Plan]:
        """The plans of a batch whose grid rows are independent items: one batch plan
        (`make_batch_plan`) when it holds several items within max_patches rows and is not a
        declared size, else `plans(grid)` (so an item alone runs as it would in `encode`)."""
        grid = as_grid(grid_thw, self.cfg)
        if len(grid.key) == 1 or grid.patches > self.policy.max_patches or self.is_declared(grid):
            return self.plans(grid)
        return [make_batch_plan(grid, self.cfg, self.policy)]

    def count(self, grid_thw) -> None:
        """One more encode of this grid (for tight_after; nothing without it)."""
        if self.tight_after is None:
            return
        g = as_grid(grid_thw, self.cfg)
        with self._lock:
            self._seen[g.key] = self._seen.pop(g.key, 0) + 1
            if len(self._seen) > self.capacity:
                self._seen.popitem(last=False)


def frames_key(grid_thw) -> tuple:
    """A chunk's frame sequence: its grid with adjacent rows of equal (h, w) merged (what a plan
    depends on), as a tuple of (t, h, w)."""
    rows: list[list[int]] = []
    for t, h, w in np.asarray(grid_thw).tolist():
        if rows and rows[-1][1:] == [h, w]:
            rows[-1][0] += t
        else:
            rows.append([t, h, w])
    return tuple(map(tuple, rows))
