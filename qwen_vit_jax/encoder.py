"""VisionEncoder: host plan + one transfer + one compiled program per bucket + unpadding.

    enc = VisionEncoder.from_pretrained(out_dir, dtype="float32")
    emb = enc.encode(pixel_values, grid_thw)      # np.ndarray [N // 4, out_dim]

Per call: validate on the host, plan (numba, cached by grid), pad pixels to the bucket,
put pixels and plan on the device in one `jax.device_put`, run the bucket's compiled
program (compiled once, ahead of time, from shapes only) and fetch the result. Nothing
is copied back before that fetch; the forward has no host callbacks.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.attention import Numerics
from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.model import abstract_model

PLAN_KEYS = ("pos_ids", "segment_ids", "kv_block_start", "kv_block_count", "window_tokens", "window_slot")


class VisionEncoder:
    """Encodes patchified images / videos into merged vision tokens.

    Args:
      cfg: the tower's config.
      params: flat parameters (qwen_vit_jax.convert layout: "blocks.attn.qkv.kernel" -> array).
      dtype: "float32" (exact vs HF float32) or "bfloat16" (bf16 matmul operands, float32
        accumulation, residual stream and softmax).
      policy: the bucket ladder (plan.BucketPolicy).
      device: where to run (default: jax.devices()[0]).
    """

    def __init__(
        self,
        cfg: VisionConfig,
        params: dict[str, np.ndarray],
        *,
        dtype: str = "float32",
        policy: planlib.BucketPolicy | None = None,
        device: jax.Device | None = None,
        preprocess_config: dict | None = None,
    ):
        self.cfg = cfg
        self.num = Numerics(dtype)
        self.policy = policy or planlib.BucketPolicy()
        self.device = device or jax.devices()[0]
        self.preprocess_config = preprocess_config
        self._graphdef, abstract = nnx.split(abstract_model(cfg, self.num))
        self._state = _fill_state(abstract, params, self.num, self.device)
        self._compiled: dict[planlib.Bucket, jax.stages.Compiled] = {}
        self.compile_seconds: dict[planlib.Bucket, float] = {}

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: str = "float32", **kwargs) -> VisionEncoder:
        """Load a directory written by `convert_checkpoint`."""
        from qwen_vit_jax.convert import load_converted

        Numerics(dtype)  # validate before reading gigabytes
        cfg, params, meta = load_converted(path)
        return cls(cfg, params, dtype=dtype, preprocess_config=meta.get("preprocessor_config"), **kwargs)

    @property
    def dtype(self) -> str:
        return self.num.dtype

    @property
    def compile_count(self) -> int:
        """Programs compiled by this encoder so far (one per bucket)."""
        return len(self._compiled)

    # ---- the public entry points ---------------------------------------------------------
    def encode(self, pixel_values, grid_thw) -> np.ndarray:
        """Embed a batch of images / videos.

        Args:
          pixel_values: [N, patch_dim] float rows, N = sum(t * h * w), in HF's patch order.
          grid_thw: [k, 3] ints (t, h, w) per image or video.
        Returns:
          float32 [N // merge_unit, out_dim]: HF's `visual(...).pooler_output`, all inputs
          concatenated in order.
        """
        plan, pixels = self._prepare(pixel_values, grid_thw)
        out = self._run(plan, pixels)
        return np.asarray(out)[: plan.n_patches // self.cfg.merge_unit]

    def warmup(self, grids) -> list[planlib.Bucket]:
        """Compile the buckets that these grids land in (each a [k, 3] grid_thw)."""
        buckets = []
        for g in grids:
            bucket = planlib.make_plan(g, self.cfg, self.policy).bucket
            self._program(bucket)
            buckets.append(bucket)
        return buckets

    # ---- internals -----------------------------------------------------------------------
    def _prepare(self, pixel_values, grid_thw) -> tuple[planlib.Plan, np.ndarray]:
        cfg = self.cfg
        grid = planlib.validate_grid(grid_thw, cfg)
        px = np.asarray(pixel_values)
        if px.ndim != 2:
            raise ValueError(f"pixel_values must be 2-D [N, {cfg.patch_dim}], got shape {px.shape}")
        if px.shape[1] != cfg.patch_dim:
            raise ValueError(
                f"pixel_values rows have {px.shape[1]} values, expected {cfg.patch_dim} "
                f"(= in_channels {cfg.in_channels} * temporal_patch_size {cfg.temporal_patch_size} "
                f"* patch_size {cfg.patch_size}^2)"
            )
        if not (np.issubdtype(px.dtype, np.floating) or np.issubdtype(px.dtype, np.integer)):
            raise ValueError(f"pixel_values must be numeric, got dtype {px.dtype}")
        expected = int(np.prod(grid, axis=1).sum())
        if px.shape[0] != expected:
            raise ValueError(f"pixel_values has {px.shape[0]} rows but grid_thw implies sum(t*h*w) = {expected}")
        plan = planlib.make_plan(grid, cfg, self.policy)
        host_dtype = np.float32 if self.dtype == "float32" else ml_dtypes.bfloat16
        pixels = np.zeros((plan.bucket.patches, cfg.patch_dim), host_dtype)  # [N_pad, P]
        pixels[: plan.n_patches] = px
        return plan, pixels

    def _run(self, plan: planlib.Plan, pixels: np.ndarray) -> jax.Array:
        program = self._program(plan.bucket)
        # One transfer for everything this call needs.
        pixels_d, *tables = jax.device_put((pixels, *plan.device_arrays()), self.device)
        return program(self._state, pixels_d, dict(zip(PLAN_KEYS, tables)))

    def _program(self, bucket: planlib.Bucket) -> jax.stages.Compiled:
        program = self._compiled.get(bucket)
        if program is None:
            t0 = time.perf_counter()
            pixels, tables = _input_specs(self.cfg, bucket, self.dtype)
            program = (
                jax.jit(self._forward, static_argnames="key_blocks")
                .lower(self._state, pixels, tables, key_blocks=bucket.key_blocks)
                .compile()
            )
            self._compiled[bucket] = program
            self.compile_seconds[bucket] = time.perf_counter() - t0
        return program

    def _forward(self, state, pixels, tables, *, key_blocks: int):
        model = nnx.merge(self._graphdef, state)
        return model(pixels, tables, key_blocks=key_blocks)


def _input_specs(cfg: VisionConfig, bucket: planlib.Bucket, dtype: str):
    """Shapes of one bucket's inputs (what a Plan's device_arrays() holds)."""
    n, nb = bucket.patches, bucket.patches // bucket.block
    i32 = jnp.int32
    tables = {
        "pos_ids": jax.ShapeDtypeStruct((n, 2), i32),
        "segment_ids": jax.ShapeDtypeStruct((n,), i32),
        "kv_block_start": jax.ShapeDtypeStruct((nb,), i32),
        "kv_block_count": jax.ShapeDtypeStruct((nb,), i32),
        "window_tokens": jax.ShapeDtypeStruct((bucket.windows, cfg.window_patches), i32),
        "window_slot": jax.ShapeDtypeStruct((n,), i32),
    }
    pixels = jax.ShapeDtypeStruct((n, cfg.patch_dim), jnp.float32 if dtype == "float32" else jnp.bfloat16)
    return pixels, tables


def _fill_state(abstract: nnx.State, params: dict[str, np.ndarray], num: Numerics, device) -> nnx.State:
    """Put `params` into the model's state: every parameter filled exactly once, shapes checked.
    Matrices take the operand dtype; norm scales and biases stay float32."""
    flat = nnx.to_flat_state(abstract)
    expected = {".".join(map(str, path)): var for path, var in flat}
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise ValueError(f"parameters do not match the model: missing {missing}, unexpected {extra}")
    values = []
    for key, var in expected.items():
        value = np.asarray(params[key])
        if value.shape != var.shape:
            raise ValueError(f"parameter {key}: shape {value.shape}, model expects {var.shape}")
        is_matrix = key.endswith("kernel")
        dtype = num.operand_dtype if is_matrix else jnp.float32
        values.append(jax.device_put(value.astype(dtype), device))
    filled = [(path, var.replace(v)) for (path, var), v in zip(flat, values)]
    return nnx.from_flat_state(filled)
