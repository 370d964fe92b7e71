"""grid_thw validated once: `as_grid` checks a request's [k, 3] (t, h, w) rows and returns a `Grid`,
the typed value that travels from the encoder through the planner (and the mesh's steps): every
later step takes the Grid as it is, so a request is validated, and turned into its cache key, once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..config import VisionConfig

MAX_PATCHES = 2**30  # keeps every padded row index comfortably inside int32
_INT64 = np.dtype(np.int64)


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class Grid:
    """A validated grid_thw.

    array: int64 [k, 3], read-only, C order; key: its rows as a tuple of (t, h, w) ints (hashable:
    the plan caches' key); merge: the spatial_merge_size h and w are multiples of (1: unchecked);
    images_only: whether every row was checked to have t = 1.
    """

    array: np.ndarray
    key: tuple[tuple[int, int, int], ...]
    merge: int = 1
    images_only: bool = False

    @property
    def patches(self) -> int:
        """sum(t * h * w): the request's pixel_values rows."""
        return sum(t * h * w for t, h, w in self.key)

    @property
    def frames(self) -> int:
        """sum(t)."""
        return sum(t for t, _, _ in self.key)

    def __len__(self) -> int:
        return len(self.key)


def as_grid(grid_thw, cfg: VisionConfig | None = None, *, merge: int | None = None) -> Grid:
    """`grid_thw` ([k, 3] integer (t, h, w) in patches) checked, as a `Grid`; a Grid already
    checked for `cfg`'s constraints is returned as it is.

    Float arrays are rejected even when integral: a float grid is almost always a caller bug.
    With `cfg`, h and w must be multiples of `cfg.spatial_merge_size` (and t = 1 for a tower that
    takes images only); without it, of `merge`.
    """
    m = cfg.spatial_merge_size if cfg is not None else (merge or 1)
    images_only = cfg is not None and cfg.images_only
    if isinstance(grid_thw, Grid) and grid_thw.merge % m == 0 and (grid_thw.images_only or not images_only):
        return grid_thw
    arr, rows = checked_grid(grid_thw.array if isinstance(grid_thw, Grid) else grid_thw, m)
    if images_only and any(t != 1 for t, _, _ in rows):
        raise ValueError(f"{cfg.variant} takes images only: every grid_thw row needs t = 1, got {rows}")
    # Every value is now in (0, 2^30]: the cast is exact for any integer dtype.
    out = arr.astype(np.int64, order="C")
    out.setflags(write=False)
    return Grid(out, tuple(map(tuple, rows)), m, images_only)


def checked_grid(grid_thw, merge: int = 1) -> tuple[np.ndarray, list[list[int]]]:
    """as_grid's checks, without building a Grid: (the input as an array, its rows as Python ints).

    A non-empty [k, 3] integer array whose t, h, w are positive, h and w multiples of `merge`, at
    most MAX_PATCHES patches in all; ValueError naming the first bad row otherwise. For a caller
    that needs neither the Grid's private read-only copy nor its cache key (the language model's
    inputs: prompt/, a few microseconds a request)."""
    try:
        arr = grid_thw if type(grid_thw) is np.ndarray else np.asarray(grid_thw)
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"grid_thw is not a rectangular [k, 3] array: {e}") from None
    shape = arr.shape
    if len(shape) != 2 or shape[1] != 3:
        raise ValueError(f"grid_thw must have shape [k, 3] (rows of t, h, w), got shape {shape}")
    if shape[0] == 0:
        raise ValueError("grid_thw is empty: need at least one (t, h, w) row")
    if arr.dtype is not _INT64 and arr.dtype.kind not in "iu":  # bool is kind "b", floats "f", objects "O"
        raise ValueError(f"grid_thw must hold integers, got dtype {arr.dtype}")
    rows = arr.tolist()  # k is small: Python ints are faster than a handful of tiny numpy ops, and exact
    total = 0
    for t, h, w in rows:
        if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
            _raise_bad_row(rows, merge)
        total += t * h * w
    if total > MAX_PATCHES:
        raise ValueError(f"grid_thw describes {total} patches, more than {MAX_PATCHES}")
    return arr, rows


def validate_grid(grid_thw, cfg: VisionConfig | None = None) -> np.ndarray:
    """`as_grid(grid_thw, cfg)`'s array as a writable int64 [k, 3] C-order copy."""
    return as_grid(grid_thw, cfg).array.copy()


def _raise_bad_row(rows: list, m: int):
    """Raise the error for the first invalid row (as_grid's slow path)."""
    for i, row in enumerate(rows):
        for name, v in zip("thw", row):
            if v <= 0:
                raise ValueError(f"grid_thw row {i} = {row}: {name} must be positive, got {v}")
        if row[1] % m or row[2] % m:
            raise ValueError(
                f"grid_thw row {i} = {row}: h and w must be multiples of spatial_merge_size {m} (odd size)"
            )
    raise AssertionError("no invalid row")  # pragma: no cover
