"""Host-side planning: every index the vision forward needs, built in numba from `grid_thw`.

HF derives rotary ids, per-frame cu_seqlens and the Qwen2.5-VL window permutation with small
data-dependent torch ops (and host syncs) on every call. Here they are pure functions of
(grid_thw, config) computed on the host, padded to a static `Bucket`, cached by grid, and shipped
to the device as one pytree; the jitted forward only ever sees bucket shapes. Read in this order:

  grid.py       `as_grid`: grid_thw validated once into a `Grid` (the array and its cache key),
                which every later step takes as it is.
  reference.py  the HF-exact index functions (`rotary_ids`,
                `frame_cu_seqlens`, `window_index`), equal element for element to
                `transformers.vision_utils`; `to_spatial` undoes HF's patch order.
  kernels.py    the numba kernels: one walk over frames, one over windows, window packing,
                full-attention tiles, the whole plan in one call, the optimal split.
  buckets.py    static shapes: `Bucket`, `BucketPolicy` (the N_pad ladder), window-slot counts,
                `split_grid` (a request above the token budget cut at frame boundaries).
  contract.py   `Plan`, the form the device consumes (a registered pytree; the bucket is its
                static metadata), and `Patches`, the pixels as uint8 with their lookup table.
  assembly.py   `make_plan` / `make_plans`: validation, caching, the buffer pool; `make_batch_plan`
                for a service's batches (a bounded set of shapes).
  choice.py     `BucketChoice`: which buckets a request runs in (the ladder, declared sizes,
                tight_after); the vocabulary of buckets, explained once.

Rows stay in the ORIGINAL pixel_values order (no permutation of the residual stream): full
attention uses per-row frame ids plus a tile table (query blocks, split where they straddle long
frames, with the key window of their frames' rows), window attention gathers rows into fixed-size slots (whole
windows packed by best-fit decreasing, told apart by window id) and scatters them back.
"""

from .assembly import BufferPool, clear_caches, make_batch_plan, make_plan, make_plans, raster_to_merge_order
from .buckets import (
    Bucket,
    BucketPolicy,
    batch_key_rows,
    batch_rows,
    chunk_penalty,
    coarse_ladder_value,
    frame_class,
    split_grid,
    typical_windows,
    worst_windows,
)
from .choice import BucketChoice
from .contract import Patches, Plan
from .grid import Grid, as_grid, validate_grid
from .reference import (
    frame_cu_seqlens,
    rotary_ids,
    segment_lengths,
    to_spatial,
    window_index,
)

__all__ = [
    "Bucket",
    "Grid",
    "Patches",
    "as_grid",
    "BucketChoice",
    "BucketPolicy",
    "BufferPool",
    "Plan",
    "chunk_penalty",
    "clear_caches",
    "batch_key_rows",
    "batch_rows",
    "coarse_ladder_value",
    "frame_class",
    "frame_cu_seqlens",
    "make_batch_plan",
    "make_plan",
    "make_plans",
    "raster_to_merge_order",
    "rotary_ids",
    "segment_lengths",
    "split_grid",
    "to_spatial",
    "typical_windows",
    "validate_grid",
    "window_index",
    "worst_windows",
]
