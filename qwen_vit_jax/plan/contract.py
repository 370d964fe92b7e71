"""What the host sends the device: the Plan (one chunk of a request, planned) and its pixels, as
HF's float rows or as uint8 `Patches` (the pixels as decoded, an eighth of the bytes for an image).

Built by `assembly.make_plans` and preprocess/; read by the model (`model/vit.py`) and attention
(`model/attention.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from .buckets import Bucket

_CHUNK = 256  # patch rows per host-side lookup step (Patches.to_float)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """One chunk of a request, planned for the device: the host-to-device contract of the forward.

    A registered JAX pytree. Its leaves are the arrays below (int32 indices and `span`; the
    position table's weights are float32); its static metadata is the `bucket` alone, so a
    `jax.jit` taking a Plan compiles once per bucket, whatever the grid; `jax.device_put(plan)`
    moves every array in one call; `Plan.abstract(bucket)` is the shape-only plan of a bucket, for
    ahead-of-time compiles. Host arrays are read-only (plans are shared through the cache).
    N = n_patches, N_pad = bucket.patches, B = bucket.block,
    S = bucket.window_rows, W_pad = bucket.windows, T = bucket.tiles, K = bucket.key_rows.

    Rows stay in the request's original order (frames contiguous, each run of merge_unit rows one
    merge unit); rows N .. N_pad - 1 are padding.

    Window attention: slot w holds whole windows packed one after another (window_tokens[w] their
    rows, window_ids[w] their window ids); a row attends to the keys of its slot with the same
    window id (window_ids[q] == window_ids[k] != -1).

    Full attention: tile t is query block tile_block[t] restricted to frames tile_first_frame[t] ..
    tile_last_frame[t], whose keys all lie in the K rows from tile_key_start[t] (its key window,
    inside the bucket's rows). Tiles 0 .. N_pad / B - 1 are the blocks in order; the rest are extra
    tiles for blocks that straddle frames (attention.segment_attention adds them back). An empty
    tile has first frame 0, last frame -1 and window start 0.

    `grid_thw` (this chunk's grid) is host-only: a Plan rebuilt from its leaves (after
    `jax.device_put`, or inside a traced function) has grid_thw None. `span` travels as a leaf, so
    `n_patches`, `take` and `unpad` work on any concrete plan.
    """

    bucket: Bucket
    pos_ids: np.ndarray  # int32 [N_pad, 2] rotary (h, w) ids; padding rows 0
    segment_ids: np.ndarray  # int32 [N_pad] frame index, -1 for padding rows
    window_tokens: np.ndarray  # int32 [W_pad, S] row at each slot entry, -1 = empty
    window_ids: np.ndarray  # int32 [W_pad, S] window (0..W-1, HF order) at each slot entry, -1 = empty
    window_slot: np.ndarray  # int32 [N_pad] flat slot entry (w * S + j) of each real row; padding 0
    tile_block: np.ndarray  # int32 [T] query block of each full-attention tile
    tile_first_frame: np.ndarray  # int32 [T] first frame of the tile's run of frames
    tile_last_frame: np.ndarray  # int32 [T] last frame of the run (-1: empty tile)
    tile_key_start: np.ndarray  # int32 [T] first row of the tile's key window (0 .. N_pad - K)
    span: np.ndarray  # int32 [3]: this chunk's first row in the request, its real rows N, the request's rows
    # The learned position table's resampling (posembed.py): per row A = bucket.pos_embed_taps table
    # rows (4 bilinear, 16 bicubic) and their weights; padding rows index 0, weight 0. P =
    # bucket.pos_embed_rows (N_pad with a table, 0 without: the tree has the same leaves for every config).
    pos_embed_index: np.ndarray  # int32 [P, A] rows of the flattened [side * side, D] table
    pos_embed_weight: np.ndarray  # float32 [P, A]
    grid_thw: np.ndarray | None = None  # int64 [k, 3] this chunk's grid (host only)

    ARRAYS = (
        "pos_ids",
        "segment_ids",
        "window_tokens",
        "window_ids",
        "window_slot",
        "tile_block",
        "tile_first_frame",
        "tile_last_frame",
        "tile_key_start",
        "span",
        "pos_embed_index",
        "pos_embed_weight",
    )

    @classmethod
    def abstract(cls, bucket: Bucket) -> Plan:
        """The plan of `bucket` as shape/dtype structs (what `jax.jit(...).lower` takes)."""
        n, t, w, s = bucket.patches, bucket.tiles, bucket.windows, bucket.window_rows
        shapes = dict(
            pos_ids=(n, 2),
            segment_ids=(n,),
            window_tokens=(w, s),
            window_ids=(w, s),
            window_slot=(n,),
            tile_block=(t,),
            tile_first_frame=(t,),
            tile_last_frame=(t,),
            tile_key_start=(t,),
            span=(3,),
            pos_embed_index=(bucket.pos_embed_rows, bucket.pos_embed_taps),
            pos_embed_weight=(bucket.pos_embed_rows, bucket.pos_embed_taps),
        )
        return cls(
            bucket=bucket,
            **{
                k: jax.ShapeDtypeStruct(v, np.float32 if k == "pos_embed_weight" else np.int32)
                for k, v in shapes.items()
            },
        )

    @property
    def offset(self) -> int:
        """This chunk's first row in the request's pixel_values."""
        return self._span(0)

    @property
    def n_patches(self) -> int:
        """Real rows (patches) of this chunk."""
        return self._span(1)

    @property
    def request_patches(self) -> int:
        """Rows of the whole request this chunk was planned from."""
        return self._span(2)

    def _span(self, i: int) -> int:
        try:
            return int(self.span[i])
        except Exception as e:  # a traced plan: jax.errors.ConcretizationTypeError and kin
            raise TypeError(
                "this Plan is traced (it was passed into a jitted function): row counts and "
                "unpad/take need a concrete plan; close over the plan instead of passing it "
                "as an argument, or call unpad outside the function"
            ) from e

    def take(self, pixel_values, dtype=None) -> np.ndarray:
        """This chunk's rows of the request's pixel_values, zero-padded to the bucket.

        Args:
          pixel_values: [request_patches, patch_dim] the whole request's rows (HF patch order), or
            its `Patches`.
          dtype: of the result (default: pixel_values' dtype if floating, else float32).
        Returns:
          np.ndarray [bucket.patches, patch_dim]: rows offset .. offset + n_patches, then zeros (or
          `Patches` of bucket.patches rows).
        """
        px = pixel_values if isinstance(pixel_values, Patches) else np.asarray(pixel_values)
        if not isinstance(px, Patches) and px.ndim != 2:
            raise ValueError(f"pixel_values must be 2-D [N, patch_dim], got shape {px.shape}")
        if len(px) != self.request_patches:
            raise ValueError(
                f"pixel_values has {len(px)} rows but the plan's request has sum(t*h*w) = {self.request_patches}"
            )
        return self.pad_rows(px, dtype)

    def pad_rows(self, pixel_values, dtype=None):
        """`take` without its checks, for a caller that has checked the request's pixels itself
        (the encoder, once per request). `Patches` are padded with zero bytes (whatever padding rows
        hold never reaches a real row)."""
        if isinstance(pixel_values, Patches):
            return dataclasses.replace(pixel_values, data=self.pad_rows(pixel_values.data, np.uint8))
        px = pixel_values
        if dtype is None:
            dtype = px.dtype if np.issubdtype(px.dtype, np.floating) else np.float32
        out = np.zeros((self.bucket.patches, *px.shape[1:]), dtype)  # [N_pad, ...]
        a, n = self.offset, self.n_patches
        out[:n] = px[a : a + n]
        return out

    def unpad(self, y):
        """The real rows of a forward output: y[..., :rows, :] where y's second-to-last axis has the
        bucket's patch rows (hidden states: n_patches real rows) or its merged rows, bucket.patches
        / merge_unit (tokens: n_patches / merge_unit real rows). NumPy or JAX arrays; inside a
        traced function only for a plan it closes over."""
        rows, padded = y.shape[-2], self.bucket.patches
        if rows == 0 or padded % rows or self.n_patches % (padded // rows):
            raise ValueError(
                f"unpad: y has {rows} rows on its second-to-last axis; this plan's bucket has "
                f"{padded} patch rows (or that divided by the merge unit)"
            )
        return y[..., : self.n_patches // (padded // rows), :]

    def _flatten_with_keys(self):
        return [(jax.tree_util.GetAttrKey(k), getattr(self, k)) for k in self.ARRAYS], self.bucket

    @classmethod
    def _unflatten(cls, bucket, leaves):
        return cls(bucket, *leaves)


jax.tree_util.register_pytree_with_keys(Plan, Plan._flatten_with_keys, Plan._unflatten)


@dataclasses.dataclass(frozen=True, eq=False)
class Patches:
    """Pixels as uint8 patches: what the host sends for the device to turn into HF's float rows.

    A registered JAX pytree (leaves `data` and `table`; `temporal_patch_size` is static), accepted
    wherever pixel_values are: `VisionEncoder.encode`, the module, `Plan.take`. An image's frame
    travels once, not once per temporal slot: 588 bytes per patch against HF's 4,704 (float32).

    data: uint8 [N, S, p, p, C]: for each patch row in HF's order, its S frames' p x p x C pixels as
      decoded; S = 1 (an image: the frame fills all T temporal slots) or S = T (a video's T frames).
    table: float32 [C, 256]: channel c's byte value v -> its rescaled and normalised float, computed
      on the host with HF's own arithmetic (preprocess.images.pixel_table). On the host `to_float`
      looks values up: HF's pixel_values bit for bit. On the device (JAX arrays) it applies the
      affine map through the table's ends, one multiply-add per value: within one float32 ulp of
      the table (docs/numerics.md).
    temporal_patch_size: T, the slots of a row (1 for PaddleOCR-VL).
    """

    data: np.ndarray
    table: np.ndarray
    temporal_patch_size: int = 2

    def __len__(self) -> int:
        return self.data.shape[0]

    @property
    def frames_per_patch(self) -> int:
        """S: 1 (an image's frame fills every temporal slot) or T (a video's frames)."""
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.table.nbytes)

    def to_float(self):
        """HF's rows: float32 [N, C * T * p * p], each (C, T, p, p) flattened. NumPy in, NumPy out
        (the table's values); JAX arrays (or tracers: inside the compiled forward) in, JAX out (its
        affine map)."""
        n, s, p, _, c = self.data.shape
        t = self.temporal_patch_size
        if isinstance(self.data, np.ndarray):  # on the host: in row chunks that stay in cache
            out = np.empty((n, c, t, p, p), np.float32)
            flat, offsets = np.asarray(self.table, np.float32).reshape(-1), 256 * np.arange(c)  # channel c at c * 256
            for i in range(0, n, _CHUNK):
                x = np.take(flat, self.data[i : i + _CHUNK] + offsets)  # [k, S, p, p, C]
                out[i : i + _CHUNK] = x.transpose(0, 4, 1, 2, 3)  # [k, C, S, p, p]; an image fills every slot
            return out.reshape(n, c * t * p * p)
        # On the device the table's two ends give each channel's affine map (rescale then normalise is
        # affine in the byte), applied as one multiply-add that fuses into the patch embedding's
        # input: a gather of the table cost XLA's CPU backend 4x the whole program of a small tower
        # (docs/numerics.md, "uint8 patches"). Within one float32 ulp of the table's values.
        jnp = jax.numpy
        table = jnp.asarray(self.table, jnp.float32)  # [C, 256]
        slope = (table[:, 255] - table[:, 0]) * np.float32(1 / 255)  # [C]
        x = self.data.astype(jnp.float32) * slope + table[:, 0]  # [N, S, p, p, C]
        x = x.transpose(0, 4, 1, 2, 3)  # [N, C, S, p, p]
        if s != t:  # an image: its frame in every temporal slot
            x = jnp.broadcast_to(x, (n, c, t, p, p))
        return x.reshape(n, c * t * p * p)  # [N, C * T * p * p]

    @classmethod
    def concatenate(cls, parts: list[Patches]) -> Patches:
        """Requests one after another; images (S = 1) next to videos (S = T) get their frame
        repeated into every slot (the same rows). The tables must agree."""
        first = parts[0]
        if any(
            not np.array_equal(p.table, first.table) or p.temporal_patch_size != first.temporal_patch_size
            for p in parts
        ):
            raise ValueError("Patches made with different preprocessing settings cannot share a call")
        s = max(p.frames_per_patch for p in parts)
        data = [p.data if p.frames_per_patch == s else np.repeat(p.data, s, axis=1) for p in parts]
        return cls(data[0] if len(data) == 1 else np.concatenate(data), first.table, first.temporal_patch_size)

    def _flatten_with_keys(self):
        keys = (jax.tree_util.GetAttrKey("data"), jax.tree_util.GetAttrKey("table"))
        return list(zip(keys, (self.data, self.table))), self.temporal_patch_size

    @classmethod
    def _unflatten(cls, temporal_patch_size, leaves):
        return cls(*leaves, temporal_patch_size)


jax.tree_util.register_pytree_with_keys(Patches, Patches._flatten_with_keys, Patches._unflatten)
