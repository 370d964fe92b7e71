"""Static shapes: the bucket ladder, window-slot counts, and splitting requests into chunks.

Every distinct `Bucket` is a compiled program, so buckets are few by construction: N_pad comes from a
geometric ladder (1 to 4 rungs per octave by default, denser for larger inputs), W_pad is a function
of N_pad for all ordinary inputs, and for single frames K = N_pad and the block (so T) follow from
N_pad too, so a stream of single images compiles at most one program per rung. A request above
the per-program token budget (`max_patches`) is cut at frame boundaries into chunks that each fill a
rung well (`split_grid`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools

import numpy as np

from ..config import VisionConfig
from . import kernels
from .grid import MAX_PATCHES, validate_grid


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Static shapes of one compiled forward."""

    patches: int  # padded patch rows N_pad: a rung of the policy's ladder
    windows: int  # window slots W_pad (0 when the config has no windows)
    key_rows: int  # K: rows of every full-attention tile's key window, 1 <= K <= patches
    block: int  # rows per query block of full attention (a multiple of 4, divides patches)
    tiles: int  # T: full-attention tiles, patches // block (one per query block) + extra tiles
    window_rows: int = 0  # S: rows per window slot (cfg.window_patches; 0 without a window size)
    pos_embed_rows: int = 0  # rows of the position-table plan: `patches` with a learned table (Qwen3), else 0
    pos_embed_taps: int = 4  # table rows per patch in that plan: 4 (bilinear) or 16 (bicubic: GLM)


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """How real sizes round up to bucket sizes.

    The N_pad ladder is geometric: `per_octave` rungs per doubling from `dense_from` rows up, half
    as many for each factor of 4 below it (never fewer than one), i.e. 2^k * (1 + j / p),
    j = 0 .. p - 1, rounded up to a multiple of 4, from `min_patches` up. Default: 64, 128, 256, 384, 512, 768,
    1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, ... Denser where larger because a
    rung of ratio r wastes ~(r - 1) / 2 of the work of the inputs it serves, and work grows with
    size (rows times FLOPs per row, and attention adds per-row FLOPs as frames grow), while a
    program costs one compile at any size: on random image sizes this ladder compiles about as many
    programs as a uniform 2-per-octave one and wastes far fewer FLOPs (`python -m benchmarks compile`;
    benchmarks/RESULTS.md, "Compile and padding cost"). `dense_from=0` gives the uniform ladder. The
    default `min_patches` is 64, not smaller, for exactness: XLA's CPU dot takes another kernel
    (another summation order) below ~60 rows, so a tiny image in a tiny bucket would differ (~1e-6)
    from the same image in a larger one; from 64 rows up every row's result is bitwise independent
    of the row count (docs/numerics.md). A rung of N_pad rows is cut into ceil(N_pad / block) equal
    blocks of a multiple of 4 rows (merge units never straddle a block); a rung for which that does
    not divide is snapped up to the next size that does. `max_patches` is the token budget of one
    program: `make_plans` splits larger requests at frame boundaries (`split_grid`).

    `frame_block` is the block of a chunk that is a single frame (an image): its blocks never
    straddle frames, and XLA's CPU dots run full attention's tiles faster with 512 query
    rows than with 128 (bench_profile.py --parts attn, retired; benchmarks/history.md, "AMD Zen 5,
    2026-12-01 (third session)": 42.8 against 62.1 ms a layer); multi-frame chunks keep `block`,
    so the blocks that straddle two frames cost little.

    `tight=True` rounds each chunk's rows only as far as attention blocks need instead of up to a
    rung (`padded_rows`), and sizes its attention tiles to the chunk's frames (kernels.choose_tiles;
    a chunk of at most min_patches rows keeps the ladder's bucket): for sizes that recur (the
    encoder switches a grid to it once the grid repeats), where one more program pays for itself.
    The split into chunks still follows the ladder.
    """

    block: int = 128
    frame_block: int = 512
    per_octave: int = 4
    dense_from: int = 1024
    min_patches: int = 64
    max_patches: int = 16384
    tight: bool = False

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.block) or self.block <= 0 or self.block % 4:
            raise ValueError(f"BucketPolicy.block must be a positive multiple of 4, got {self.block!r}")
        if not is_int(self.frame_block) or self.frame_block < self.block or self.frame_block % 4:
            raise ValueError(
                f"BucketPolicy.frame_block must be a multiple of 4 >= block {self.block}, got {self.frame_block!r}"
            )
        if not is_int(self.per_octave) or self.per_octave < 1:
            raise ValueError(f"BucketPolicy.per_octave must be an int >= 1, got {self.per_octave!r}")
        if not is_int(self.dense_from) or self.dense_from < 0:
            raise ValueError(f"BucketPolicy.dense_from must be an int >= 0, got {self.dense_from!r}")
        if not is_int(self.min_patches) or self.min_patches <= 0 or self.min_patches % 4:
            raise ValueError(f"BucketPolicy.min_patches must be a positive multiple of 4, got {self.min_patches!r}")
        if not is_int(self.max_patches) or self.max_patches < self.min_patches:
            raise ValueError(
                f"BucketPolicy.max_patches must be an int >= min_patches {self.min_patches}, got {self.max_patches!r}"
            )
        if not isinstance(self.tight, bool):
            raise ValueError(f"BucketPolicy.tight must be a bool, got {self.tight!r}")

    def rungs(self, limit: int) -> list[int]:
        """All N_pad rungs up to (and including) the first one >= `limit`."""
        table = rung_table(self)
        return list(table[: bisect.bisect_left(table, limit) + 1])

    def rung(self, n: int) -> int:
        """Smallest rung >= n (n may exceed max_patches: one frame over budget gets its own rung)."""
        table = rung_table(self)
        return table[bisect.bisect_left(table, n)]

    def tight_for(self, n: int) -> bool:
        """Whether a chunk of n real rows gets tight rows and tiles: with `tight`, above min_patches
        (chunks of at most min_patches rows stay on the ladder: its smallest rung keeps XLA's CPU
        dots bucket-invariant)."""
        return self.tight and n > self.min_patches

    def padded_rows(self, n: int, one_frame: bool = False) -> int:
        """N_pad of a chunk of n real rows (`one_frame`: a single frame): `rung(n)`, or where
        `tight_for(n)` the least rows >= n that equal blocks of a multiple of 4 rows tile:
        NB = ceil(n / block) blocks for several frames (1296 -> 1320 = 11 blocks of 120), for one
        frame any NB from ceil(n / frame_block) to twice that (1296 = 3 blocks of 432), where the
        ladder gives 1536."""
        if not self.tight_for(n):
            return self.rung(n)
        if one_frame:
            nb = -(-n // self.frame_block)
            return min(k * 4 * -(-n // (4 * k)) for k in range(nb, 2 * nb + 1))
        nb = -(-n // self.block)
        return nb * 4 * -(-n // (4 * nb))

    def block_size(self, patches: int, one_frame: bool = False) -> int:
        """Rows per block of a `patches`-row bucket: patches // ceil(patches / block); for a single
        frame patches // NB with NB the least count >= ceil(patches / frame_block) that divides
        patches into blocks of a multiple of 4 rows."""
        if not one_frame:
            return patches // -(-patches // self.block)
        nb = -(-patches // self.frame_block)
        while patches % (4 * nb):  # ends by patches / 4 at the latest
            nb += 1
        return patches // nb


def _snap(r: int, block: int) -> int:
    """Smallest r' >= r (r a multiple of 4) that ceil(r' / block) blocks of a multiple of 4 rows
    tile exactly. Two rounds at most: once r' is a multiple of 4 * nb with nb = ceil(r / block),
    r' <= nb * block (itself such a multiple), so nb no longer changes."""
    while True:
        step = 4 * -(-r // block)
        r2 = -(-r // step) * step
        if r2 == r:
            return r
        r = r2


@functools.lru_cache(maxsize=32)
def rung_table(policy: BucketPolicy) -> tuple[int, ...]:
    """The ladder from min_patches until past 2 * MAX_PATCHES (every valid grid has a rung), as
    Python ints: `rung` bisects it on every uncached plan."""
    rungs = [_snap(policy.min_patches, policy.block)]
    k = 0
    while rungs[-1] < 2 * MAX_PATCHES:
        p, below = policy.per_octave, policy.dense_from
        while 2**k < below and p > 1:  # half the rungs per octave for each factor of 4 below dense_from
            p, below = p // 2, below // 4
        for j in range(p):
            v = _snap(-(-(2**k * (p + j)) // (4 * p)) * 4, policy.block)  # ceil4(2^k (1 + j/p)), exact
            if v > rungs[-1]:
                rungs.append(v)
        k += 1
    return tuple(rungs)


def coarse_ladder_value(n: int) -> int:
    """Smallest of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5x them) >= n; 0 for n <= 0."""
    return int(kernels.coarse(int(n)))


# ---- batch shapes -------------------------------------------------------------------------------
FRAME_CLASS_UNIT = 64  # rows: frame classes are this times 1, 2, 3, 4, 6, 8, 12, ... (coarse_ladder_value)


def batch_rows(n: int, policy: BucketPolicy) -> int:
    """N_pad of a batch plan of n real rows: the rung of a ladder of two rungs per octave (64, 96,
    128, 192, 256, 384, 512, 768, 1024, 1536, ...; the policy's own min_patches and block). Coarser
    than the policy's ladder above 1024 rows on purpose: a batch plan's bucket also follows its
    frame class, and fewer rungs mean fewer programs, for padding of at most a third."""
    if n > policy.max_patches:
        raise ValueError(f"a batch plan holds at most max_patches = {policy.max_patches} rows, got {n}")
    return dataclasses.replace(policy, per_octave=2, dense_from=0, tight=False).rung(n)


def frame_class(rows: int) -> int:
    """The frame class of a frame of `rows` rows: the least of 64 * (1, 2, 3, 4, 6, 8, 12, ...) >= rows.
    A batch plan's key window follows the class of its widest frame, not the frame itself."""
    return FRAME_CLASS_UNIT * coarse_ladder_value(-(-rows // FRAME_CLASS_UNIT))


def batch_key_rows(n_pad: int, block: int, frame_rows: int) -> int:
    """K of a batch plan whose frames have at most `frame_rows` rows: the frames that share a block
    of `block` rows span at most block + 2 * (frame_rows - 1) rows (the first may start frame_rows
    - 1 rows before the block, the last end frame_rows - 1 rows after it), so one key window of
    this many rows holds them all and every block is one tile. At most n_pad."""
    return min(n_pad, int(kernels.align_up(block + 2 * frame_rows, kernels.KEY_ALIGN)))


# ---- window slots -----------------------------------------------------------------------------
# The W windows of a plan (each <= S = window_patches rows, a multiple of the merge unit mu) are
# packed by best-fit decreasing into W_pad slots of S rows. A single image tiled into 64-row windows
# needs about N / S slots plus a few for its edge windows, which pair up; so
#     typical(N_pad) = ceil(9/8 * N_pad / S) + 2
# covers every ordinary input (tests check all single images up to 64 x 64 patches), and then W_pad
# is a function of N_pad alone: one bucket per rung. Only inputs made mostly of windows just over
# S/2 rows (e.g. many 6 x 6-patch frames) need more; they get
#     worst(N_pad) = ceil(N_pad / f) + 1,  f = mu * (S // (2 mu) + 1)  (= S/2 + mu when S/mu is even)
# which always suffices: with best-fit (or first-fit) decreasing at most one slot ends up at most
# half full. (If slots A, then B, both held <= S/2 rows at the end, the window that opened B did
# not fit into A, whose room was then >= S/2, so that window alone exceeded S/2.) Every other slot
# holds > S/2 rows, i.e. >= f rows as fills are multiples of mu, hence slots <= floor(N / f) + 1.
def typical_windows(n_pad: int, cfg: VisionConfig) -> int:
    """W_pad of ordinary inputs of a bucket with n_pad rows (0 without windows)."""
    if not cfg.windowed:
        return 0
    return -(-n_pad * 9 // (8 * cfg.window_patches)) + 2


def worst_windows(n_pad: int, cfg: VisionConfig) -> int:
    """W_pad that any packing of n_pad rows fits (0 without windows); see the comment above."""
    if not cfg.windowed:
        return 0
    mu = cfg.merge_unit
    return -(-n_pad // (mu * (cfg.window_patches // (2 * mu) + 1))) + 1


# ---- splitting large requests ------------------------------------------------------------------
def chunk_penalty(policy: BucketPolicy) -> int:
    """What one more chunk costs in `split_grid`'s objective, in padded rows: max_patches // 100
    (at least min_patches). It stands for a program launch, a transfer and a likelier extra compile,
    and makes a request that fits the budget split only when that saves more than 1% of a full
    program (e.g. [[5, 36, 36]]: 8192 rows as one chunk, 4096 + 3072 as two)."""
    return max(policy.min_patches, policy.max_patches // 100)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Split:
    """A request cut into chunks (`split`). Chunk c is rows[starts[c]:starts[c + 1]] (the grid rows
    it takes frames from, int64 [k_c, 3]); its plan key, the same frames with adjacent rows of equal
    (h, w) merged, is keys[key_starts[c]:key_starts[c + 1]]."""

    rows: np.ndarray
    starts: list[int]
    keys: np.ndarray
    key_starts: list[int]

    def chunk(self, c: int) -> np.ndarray:
        return self.rows[self.starts[c] : self.starts[c + 1]]

    def key(self, c: int) -> np.ndarray:
        return self.keys[self.key_starts[c] : self.key_starts[c + 1]]

    def __len__(self) -> int:
        return len(self.starts) - 1


def split(g: np.ndarray, policy: BucketPolicy) -> Split:
    """split_grid of a validated int64 [k, 3] grid, with every chunk's plan key (kernels.split_chunks)."""
    k = g.shape[0]
    n_frames = int(g[:, 0].sum())
    rows, keys = np.empty((k + n_frames, 3), np.int64), np.empty((k + n_frames, 3), np.int64)
    starts, key_starts = np.empty(n_frames + 1, np.int64), np.empty(n_frames + 1, np.int64)
    rungs = np.array(rung_table(policy), np.int64)  # [R]
    n_chunks = kernels.split_chunks(
        g, rungs, policy.max_patches, chunk_penalty(policy), policy.min_patches, rows, starts, keys, key_starts
    )
    return Split(
        rows=rows, starts=starts[: n_chunks + 1].tolist(), keys=keys, key_starts=key_starts[: n_chunks + 1].tolist()
    )


def split_grid(grid_thw, cfg: VisionConfig, policy: BucketPolicy = BucketPolicy()) -> list[np.ndarray]:
    """Cut a request into consecutive chunks of frames, each an int64 [k_i, 3] grid.

    Frames are independent, so a video row [t, h, w] may be cut along t. Each chunk holds at most
    policy.max_patches rows (a single larger frame is a chunk of its own), and the cut minimises
    sum(rung(chunk rows)) + chunk_penalty * chunks exactly, by dynamic programming over frame
    boundaries. Concatenating the chunks' frames gives the request's frames in order.
    """
    s = split(validate_grid(grid_thw, cfg), policy)
    return [s.chunk(c) for c in range(len(s))]
