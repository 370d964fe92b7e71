"""Ray Data stages (`qvj.ray`; pip install 'qwen_vit_jax[ray]'): Ray's batch-inference pattern, a
CPU stage that decodes and resizes and an accelerator stage that encodes, each scaled on its own.

    import ray, qwen_vit_jax as qvj
    ds = ray.data.read_parquet("images/")                      # an image column of bytes
    ds = ds.map_batches(qvj.ray.preprocess, fn_kwargs={"checkpoint": CKPT}, batch_format="pyarrow")
    ds = ds.map_batches(
        qvj.ray.Encoder, fn_constructor_kwargs={"checkpoint": CKPT, "dtype": "bfloat16"},
        concurrency=4, num_gpus=1, batch_size=64, batch_format="pyarrow",
    )
    ds.write_parquet("embeddings/")                            # key columns, embedding, grid_thw

`preprocess` adds the uint8 patch rows (`qvj_patches`, binary: 588 bytes per 14x14 patch, what the
device normalises) and `grid_thw`; `Encoder` turns them into `embedding` (list<fixed_size_list<
float32, D>>, as `encode -o OUT.parquet` writes) and drops `qvj_patches`. Every other column stays.
An Encoder given batches without `qvj_patches` decodes them itself (one stage; the accelerator then
waits for the decode). Images only: videos go through `qwen-vit-jax encode`.

Batches come in any of Ray's formats (a pyarrow Table, a pandas DataFrame, a dict of numpy arrays);
both stages return pyarrow Tables. Nothing here imports ray: these are plain functions and classes
that Ray calls, and that tests call directly.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np

from qwen_vit_jax.data.parquet import embedding_array, grid_array
from qwen_vit_jax.data.sources import image_cell

PATCHES = "qvj_patches"  # binary: an image's uint8 patch rows [n, 1, p, p, 3], C order
GRID = "grid_thw"
EMBEDDING = "embedding"


def _table(batch):
    """A Ray batch as a pyarrow Table."""
    import pyarrow as pa

    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, dict):
        return pa.table(
            {k: pa.array(list(v) if isinstance(v, np.ndarray) and v.dtype == object else v) for k, v in batch.items()}
        )
    return pa.Table.from_pandas(batch, preserve_index=False)  # a pandas DataFrame


def preprocess(
    batch,
    *,
    checkpoint: str | None = None,
    preprocessing=None,
    image_column: str = "image",
    variant: str | None = None,
    config=None,
):
    """Ray Data's CPU stage: decode, resize and cut each image of `image_column` into uint8 patch rows.

    Args:
      batch: a Ray batch (pyarrow Table, pandas DataFrame or dict of numpy arrays) whose
        `image_column` holds image bytes or HF's {"bytes", "path"} struct.
      checkpoint: the checkpoint whose preprocessing to follow (only its config files are read);
        or `preprocessing` (a `qvj.Preprocessing`, e.g. an encoder's `enc.preprocessing`).
        `variant=` / `config=` still work, deprecated.
    Returns:
      the batch as a pyarrow Table with `qvj_patches` (binary) and `grid_thw` (3 int64) added.
    """
    import dataclasses

    import pyarrow as pa

    from qwen_vit_jax.data.items import Job, prepare
    from qwen_vit_jax.preprocess.config import Preprocessing

    if variant is not None or config is not None:
        warnings.warn(
            "qvj.ray.preprocess: variant= / config= are deprecated; pass preprocessing=qvj.Preprocessing(...) "
            "(an encoder's: enc.preprocessing) or checkpoint=",
            DeprecationWarning,
            stacklevel=2,
        )
    if checkpoint is not None and preprocessing is None:
        preprocessing = _preprocessing(checkpoint)  # its variant wins over variant=, as it always did
    elif preprocessing is None and variant is not None:
        preprocessing = Preprocessing.defaults(variant)
    if preprocessing is None:
        raise ValueError("qvj.ray.preprocess needs checkpoint= or preprocessing=")
    if config is not None:
        preprocessing = dataclasses.replace(preprocessing, image=config)
    table = _table(batch)
    if image_column not in table.column_names:
        raise ValueError(f"no column {image_column!r} in the batch (image_column=); its columns: {table.column_names}")
    rows, grids = [], []
    for i, value in enumerate(table.column(image_column).to_pylist()):  # the item path of encode and serve
        cell = image_cell(value, f"row {i} of the batch", image_column)
        (piece,) = prepare(Job(f"row {i}", cell, "image"), preprocessing).pieces
        rows.append(piece.rows.tobytes())
        grids.append(piece.grid)
    table = _drop(table, PATCHES, GRID).append_column(PATCHES, pa.array(rows, pa.binary()))
    return table.append_column(GRID, grid_array(grids))


@functools.lru_cache(maxsize=8)
def _preprocessing(checkpoint: str):
    """A checkpoint's `Preprocessing`, read once per process (not per batch)."""
    from qwen_vit_jax.preprocess.config import Preprocessing
    from qwen_vit_jax.weights.sources import preprocessing

    variant, image, video = preprocessing(checkpoint)
    return Preprocessing(image=image, video=video, variant=variant)


def _drop(table, *names):
    """`table` without the columns `names` (a batch from an earlier run's output: replaced, not doubled)."""
    return table.drop_columns([n for n in names if n in table.column_names])


class Encoder:
    """Ray Data's accelerator stage, a callable class for `map_batches` (Ray builds it once per
    actor, so the checkpoint loads and programs compile once; an actor given several devices
    shares each call across all of them).

    Args:
      checkpoint: a converted dir, an HF checkpoint dir or a hub id in the local cache.
      dtype: "float32" (exact vs HF) or "bfloat16".
      image_column: decoded here when a batch lacks `qvj_patches` (no preprocess stage before).
      batch_patches: most patches per forward call (default: the encoder's).
      compile_cache: JAX's persistent compilation cache directory (actors then share programs).
    """

    def __init__(
        self,
        checkpoint: str,
        dtype: str = "float32",
        image_column: str = "image",
        batch_patches: int | None = None,
        compile_cache: str | None = None,
    ):
        import jax

        from qwen_vit_jax.runtime.encoder import VisionEncoder

        kw = {"max_batch_patches": batch_patches} if batch_patches else {}
        kw["devices"] = jax.local_devices()  # what Ray gave this actor (num_gpus=2, resources={"TPU": 4}): all of them
        self.enc = VisionEncoder.from_pretrained(checkpoint, dtype=dtype, compilation_cache_dir=compile_cache, **kw)
        self.image_column = image_column

    def __call__(self, batch):
        """The batch as a pyarrow Table with `embedding` (and `grid_thw`, when the preprocess stage
        did not add it), without `qvj_patches`."""
        from qwen_vit_jax.preprocess.images import patches_of

        table = _table(batch)
        if PATCHES not in table.column_names:
            table = preprocess(table, preprocessing=self.enc.preprocessing, image_column=self.image_column)
        cfg, p = self.enc.preprocess, self.enc.preprocess.patch_size
        grids = np.asarray(table.column(GRID).to_pylist(), np.int64).reshape(-1, 3)  # [k, 3]
        items = []
        for data, grid in zip(table.column(PATCHES).to_pylist(), grids):
            rows = np.frombuffer(data, np.uint8).reshape(-1, 1, p, p, 3)  # [t * h * w, 1, p, p, 3]
            if len(rows) != int(np.prod(grid)):
                raise ValueError(
                    f"qvj_patches holds {len(rows)} patches, grid_thw {grid.tolist()} says {int(np.prod(grid))}"
                )
            items.append((patches_of(rows, cfg), grid[None]))
        embs = self.enc.encode_patches(items) if items else []
        table = _drop(table, PATCHES, EMBEDDING)
        return table.append_column(EMBEDDING, embedding_array(embs, self.enc.cfg.out_dim))
