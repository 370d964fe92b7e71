"""VisionEncoder: host plan + one transfer + one compiled program per bucket + unpadding.

    enc = VisionEncoder.from_pretrained(out_dir, dtype="float32")
    emb = enc.encode(pixel_values, grid_thw)      # np.ndarray [N // 4, out_dim]

Per call: validate on the host, plan (numba, cached by grid; a large request is split at
frame boundaries into chunks that fill buckets well), pad pixels to each bucket, put
pixels and plans on the device in one `jax.device_put`, run each bucket's compiled
program (compiled once, ahead of time, from shapes only) and fetch the results. Nothing
is copied back before that fetch; the forward has no host callbacks.

With `devices=[...]` (several local devices) the frames of a call are balanced across a
`jax.sharding.Mesh` instead (devices.py): every device runs the same bucket, the parameters are
replicated, one `shard_map` program per bucket serves the mesh, and the results come back in
request order.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import threading
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from PIL import Image

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.config import VisionConfig, dtype_named
from qwen_vit_jax.model.numerics import Numerics, numerics_for
from qwen_vit_jax.model.vit import abstract_model, as_bits, fill_state
from qwen_vit_jax.preprocess.config import PreprocessConfig, image_config_for, video_config_for
from qwen_vit_jax.preprocess.images import image_preprocessor
from qwen_vit_jax.runtime import cost
from qwen_vit_jax.runtime import devices as devlib
from qwen_vit_jax.runtime.batching import pack
from qwen_vit_jax.runtime.program import forward, input_specs, mesh_program, mesh_specs


def enable_compilation_cache(path: str | os.PathLike, min_compile_seconds: float = 0.0) -> pathlib.Path:
    """Opt in to JAX's persistent compilation cache in directory `path` (created if missing).

    Process-wide (JAX's own setting, `jax_compilation_cache_dir`): every later compile of this
    process, ours or not, is looked up there first and stored there after. Programs that
    compiled faster than `min_compile_seconds` are not stored (JAX's default is 1 s; 0 stores
    every bucket). A cache written by another jax / jaxlib version or for another device is
    not used (JAX keys entries on both). Trusted data: do not point it at a directory others
    can write. Returns the resolved path.
    """
    from jax.experimental.compilation_cache import compilation_cache

    path = pathlib.Path(path).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"compilation cache path {path} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is on
    return path


class VisionEncoder:
    """Encodes patchified images / videos into merged vision tokens.

    Args:
      cfg: the tower's config.
      params: flat parameters (qwen_vit_jax.convert layout: "blocks.attn.qkv.kernel" -> array).
      dtype: "float32" (exact vs HF float32) or "bfloat16" (bf16 matmul operands, float32
        accumulation, residual stream and softmax).
      policy: the bucket ladder (plan.BucketPolicy).
      device: where to run (default: this process's first device, jax.local_devices()[0]).
      devices: several local devices to share the work (frames balanced across them, largest
        first; parameters replicated on each). Exclusive with `device`; one device is `device`.
      preprocess: image preprocessing for encode_images (default: HF's).
      video_preprocess: video sampling and preprocessing for encode_video (default: the checkpoint's
        video config, else HF's video-processor defaults for this tower's variant).
      max_batch_patches: encode_images packs images into calls of at most this many patches
        (default policy.max_patches, 16384, per device: a full bucket's worth for each device).
      tight_after: None (default): a request's buckets depend on the request and on the sizes
        declared with `warmup(grids, tight=True)` only, so every call of a request gives the same
        bits (see `encode`). An int n opts out of that guarantee for convenience: a grid encoded n
        times switches by itself to its tight buckets (BucketPolicy.tight), whose results differ
        from its earlier calls' in the last bits (float32: ~1e-6 relative, padding invariance).
        One device only: on several devices pass policy=BucketPolicy(tight=True) instead.
      max_tight_buckets: with tight_after, at most this many tight buckets are switched to; later
        recurring grids stay on the ladder (a stream of distinct sizes never recurs: its compile
        bound is the ladder's). Declared sizes and a request's own recurring chunks do not count.
      compilation_cache_dir: opt in to JAX's persistent compilation cache in this directory
        (`enable_compilation_cache`; process-wide): a later process loads the buckets' programs
        instead of compiling them.
      attention: "xla" (the default: the pure-XLA schedules, the reference) or "kernel" (the
        device's Pallas kernel: Triton on an NVIDIA GPU, splash on a TPU; the same results at the
        bars). "triton" / "splash" name one; on a CPU they run in Pallas' interpreter (tests only).
    """

    def __init__(
        self,
        cfg: VisionConfig,
        params: dict[str, np.ndarray],
        *,
        dtype: str = "float32",
        policy: planlib.BucketPolicy | None = None,
        device: jax.Device | None = None,
        devices: list[jax.Device] | None = None,
        preprocess: PreprocessConfig | None = None,
        video_preprocess: PreprocessConfig | None = None,
        max_batch_patches: int | None = None,
        tight_after: int | None = None,
        max_tight_buckets: int = 16,
        compilation_cache_dir: str | os.PathLike | None = None,
        attention: str = "xla",
    ):
        if compilation_cache_dir is not None:
            enable_compilation_cache(compilation_cache_dir)
        self.cfg = cfg
        if devices is not None and device is not None:
            raise ValueError("pass either device= or devices=, not both")
        self.devices = _check_devices(devices) if devices is not None else [device or jax.local_devices()[0]]
        self.device = self.devices[0]
        # The data axis of several devices; None for one (the single-device path, unchanged).
        self.mesh = Mesh(np.array(self.devices), ("data",)) if len(self.devices) > 1 else None
        self.num = numerics_for(dtype, self.device, attention)
        self.policy = policy or planlib.BucketPolicy()
        self.preprocess = preprocess or image_config_for(cfg.variant)
        self.video_preprocess = video_preprocess or video_config_for(None, cfg.variant)
        self.max_batch_patches = max_batch_patches or self.policy.max_patches * len(self.devices)
        if tight_after is not None and (not isinstance(tight_after, int) or tight_after < 1):
            raise ValueError(f"tight_after must be an int >= 1 or None, got {tight_after!r}")
        self.tight_after, self.max_tight_buckets = tight_after, max_tight_buckets
        self._seen: collections.OrderedDict[tuple, int] = collections.OrderedDict()  # grid -> encodes, LRU
        self._tight_buckets: set[planlib.Bucket] = set()  # switched to by tight_after
        self._declared: set[tuple] = set()  # grids declared by warmup(tight=True)
        self._seen_lock = threading.Lock()
        self._graphdef, abstract = nnx.split(abstract_model(cfg, self.num))
        # Several devices: replicated (every device holds all parameters), placed in one go.
        where = self.device if self.mesh is None else NamedSharding(self.mesh, P())
        self._state = as_bits(fill_state(abstract, params, self.num, where))
        self._compiled: dict[tuple[planlib.Bucket, int | None], jax.stages.Compiled] = {}  # (bucket, frames)
        # Held while compiling: two threads asking for the same new bucket compile it once.
        self._compile_lock = threading.Lock()
        self.compile_seconds: dict[planlib.Bucket, float] = {}
        self._flops: dict[planlib.Bucket, float] = {}

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: str = "float32", **kwargs) -> VisionEncoder:
        """Load `path`: a directory written by `convert_checkpoint`, an HF checkpoint directory
        (its vision tensors converted in memory, nothing written) or a hub id ("Org/Name") in the
        local HF cache, never the network (sources.py). The checkpoint's preprocessor_config.json
        sets the preprocessing unless `preprocess` is given."""
        from qwen_vit_jax.weights.sources import load_source, preprocessing

        Numerics(dtype)  # validate before reading gigabytes
        if kwargs.get("compilation_cache_dir") is not None:
            enable_compilation_cache(kwargs.pop("compilation_cache_dir"))
        cfg, params, src = load_source(path)
        _, image, video = preprocessing(src)
        kwargs.setdefault("preprocess", image)
        kwargs.setdefault("video_preprocess", video)
        return cls(cfg, params, dtype=dtype, **kwargs)

    @property
    def dtype(self) -> str:
        return self.num.dtype

    @property
    def compile_count(self) -> int:
        """Programs compiled by this encoder so far (one per bucket and pixel form: float rows, or
        `Patches` of 1 or T frames per row; a program loaded from the persistent compilation cache
        counts too, with its load time in compile_seconds, which sums a bucket's programs)."""
        return len(self._compiled)

    # ---- the public entry points ---------------------------------------------------------
    def encode(self, pixel_values, grid_thw, *, check_finite: bool = True, return_deepstack: bool = False):
        """Embed a batch of images / videos.

        Every call of a request gives the same bits, whatever this encoder encoded before and in
        whichever thread: the request's buckets are a function of its grid_thw, the policy and the
        grids declared with `warmup(grids, tight=True)` before (declare sizes before encoding them;
        only `tight_after=n` gives up this guarantee). Across buckets (a declared size's tight
        bucket vs the ladder's rung) results agree to padding invariance (float32: ~1e-6 relative).

        Args:
          pixel_values: [N, patch_dim] float rows, N = sum(t * h * w), in HF's patch order.
          grid_thw: [k, 3] ints (t, h, w) per image or video.
          check_finite: reject NaN / Inf in pixel_values with a ValueError naming the image and
            its first bad row (one pass over the pixels). Without the check a non-finite image
            still never affects the other images' rows: the tower isolates segments.
          return_deepstack: also return Qwen3-VL's deepstack features.

        Returns:
          float32 [N // merge_unit, out_dim]: HF's `visual(...).pooler_output` (the merged
          tokens, every variant), all inputs concatenated in order. With return_deepstack,
          (tokens, features): features is one float32 [N // merge_unit, out_dim] array per entry
          of cfg.deepstack_layers (HF's `deepstack_features`), an empty list for towers without
          deepstack mergers. A Qwen3-VL program always computes them (its language model takes
          them with every image); they are copied to the host only when asked for.
        """
        grid = planlib.as_grid(grid_thw, self.cfg)  # validated once: every step below takes the Grid
        if self.mesh is not None:
            return self._encode_mesh(pixel_values, grid, check_finite, return_deepstack)
        plans, pixels = self._prepare(pixel_values, grid, check_finite)
        # One transfer for everything this call needs, then every chunk's program is
        # dispatched before anything is fetched.
        inputs = jax.device_put(list(zip(pixels, plans)), self.device)
        frames = _frames_of(pixels[0])
        outs = [self._program(p.bucket, frames)(self._state, px, p) for px, p in inputs]  # (tokens, features) each
        tokens = np.concatenate([p.unpad(np.asarray(o[0])) for p, o in zip(plans, outs)])
        self._count(grid)
        if not return_deepstack:
            return tokens
        features = [
            np.concatenate([p.unpad(np.asarray(o[1][k])) for p, o in zip(plans, outs)])
            for k in range(self.cfg.num_deepstack)
        ]
        return tokens, features

    def _encode_mesh(self, pixel_values, grid: planlib.Grid, check_finite: bool, return_deepstack: bool):
        """encode on several devices: frames balanced over the mesh, one program call per step
        (devices.py), all steps' inputs in one transfer, results put back in request order."""
        steps = devlib.plan_steps(grid, self.cfg, self.policy, len(self.devices))
        px = self._pixels(pixel_values, grid, check_finite)
        shards = NamedSharding(self.mesh, P("data"))  # leading [D] axis of every input, one slice per device
        inputs = jax.device_put([(s.take(px, dtype_named(self.dtype)), s.plan) for s in steps], shards)
        frames = _frames_of(px)
        outs = [self._program(p.bucket, frames)(self._state, x, p) for x, p in inputs]  # (tokens, features) each

        def gather(arrays):  # one [D, N_pad / mu, out] per step -> the request's rows in order
            return np.concatenate([np.asarray(a).reshape(-1, a.shape[-1])[s.gather] for s, a in zip(steps, arrays)])

        tokens = gather([o[0] for o in outs])
        if not return_deepstack:
            return tokens
        return tokens, [gather([o[1][k] for o in outs]) for k in range(self.cfg.num_deepstack)]

    def encode_images(self, images) -> list[np.ndarray]:
        """Preprocess (the checkpoint's preprocessor_config.json, else HF defaults) and embed. The
        pixels travel as uint8 `Patches` (each image's frame once) and are normalised on the device.

        Args:
          images: a list of PIL images or HxWx3 uint8 arrays (any sizes).
        Returns:
          one float32 [h * w / merge_unit, out_dim] array per image.
        """
        if isinstance(images, (Image.Image, np.ndarray)):
            images = [images]
        prep = image_preprocessor(self.cfg.variant)
        return self.encode_patches([prep([im], config=self.preprocess, uint8=True) for im in images])

    def encode_video(self, video, **sampling) -> np.ndarray:
        """One video, decoded and sampled by `preprocess_video` with `video_preprocess` (the checkpoint's
        video config, else HF's video-processor defaults for this tower).

        Args:
          video: a file path or decoded frames (see `qwen_vit_jax.preprocess_video`).
          sampling: fps / num_frames / max_frames / source_fps / min_pixels / max_pixels, passed on.
        Returns:
          float32 [t * h * w / merge_unit, out_dim]; the timestamps: `preprocess_video`'s third value.
        """
        from qwen_vit_jax.preprocess.video import preprocess_video

        pv, grid, _ = preprocess_video(video, config=self.video_preprocess, uint8=True, **sampling)
        return self.encode_patches([(pv, grid)])[0]

    def encode_patches(self, items: list[tuple[planlib.Patches, np.ndarray]]) -> list[np.ndarray]:
        """Encode prepared inputs: (patches, grid_thw [1, 3]) items, as the preprocessors return
        them with uint8=True (or float pixel_values rows), consecutive ones packed into calls of at
        most max_batch_patches patches (a larger item runs alone).

        Returns:
          one float32 [tokens, out_dim] array per item.
        """
        out = []
        for batch in pack(items, self.max_batch_patches, lambda item: len(item[0])):
            emb = self.encode(planlib.Patches.concatenate([b[0] for b in batch]), np.concatenate([b[1] for b in batch]))
            out.extend(np.split(emb, np.cumsum([len(b[0]) // self.cfg.merge_unit for b in batch])[:-1]))
        return out

    def warmup(self, grids, *, tight: bool = False, uint8: bool = False) -> list[planlib.Bucket]:
        """Compile the buckets that these grids land in.

        Args:
          grids: [k, 3] grid_thw requests.
          uint8: compile the programs that take `Patches` (what encode_images, encode_video and the
            CLI send: one frame per row for grids of images, t = 1 everywhere, else T) instead of
            float pixel_values rows.
          tight: declare these grids as sizes that recur (a dataset resized to one resolution, a
            video stream's chunks): from now on every encode of exactly such a grid runs in its
            tight buckets (BucketPolicy.tight: rows rounded only as far as attention blocks need, not
            up to the ladder's next rung, tiles sized to its frames), one more program per size.
            One device only (on several devices pass policy=BucketPolicy(tight=True)).
        Returns:
          the bucket of each program call the grids' encodes make, in order.
        """
        if tight and self.mesh is not None:
            raise ValueError("warmup(tight=True) is for one device; on several pass policy=BucketPolicy(tight=True)")
        buckets = []
        for g in grids:
            g = planlib.as_grid(g, self.cfg)
            if tight:
                with self._seen_lock:
                    self._declared.add(g.key)
            frames = _frames_for(g, self.cfg) if uint8 else None
            for bucket in self._buckets(g):
                self._program(bucket, frames)
                buckets.append(bucket)
        return buckets

    # ---- internals -----------------------------------------------------------------------
    def _prepare(self, pixel_values, grid: planlib.Grid, check_finite: bool = True):
        """Plan (one plan per chunk of frames), check the pixels and pad them to each plan's bucket:
        (plans, [padded pixels per plan])."""
        plans = self._plans(grid)
        px = self._pixels(pixel_values, grid, check_finite)
        return plans, [p.pad_rows(px, dtype_named(self.dtype)) for p in plans]

    def _pixels(self, pixel_values, grid: planlib.Grid, check_finite: bool):
        """pixel_values as a checked [N, patch_dim] array, or checked `Patches`, for a validated grid
        (the one check of a request's pixels)."""
        cfg = self.cfg
        if isinstance(pixel_values, planlib.Patches):
            return self._patches(pixel_values, grid)
        px = np.asarray(pixel_values)
        if px.ndim != 2:
            raise ValueError(f"pixel_values must be 2-D [N, {cfg.patch_dim}], got shape {px.shape}")
        if px.shape[1] != cfg.patch_dim:
            raise ValueError(
                f"pixel_values rows have {px.shape[1]} values, expected {cfg.patch_dim} "
                f"(= in_channels {cfg.in_channels} * temporal_patch_size {cfg.temporal_patch_size} "
                f"* patch_size {cfg.patch_size}^2): preprocess with this checkpoint's settings, "
                "qvj.preprocess_images(images, config=enc.preprocess) or "
                "qvj.preprocess_video(video, config=enc.video_preprocess) (or enc.encode_images / enc.encode_video)"
            )
        if not (np.issubdtype(px.dtype, np.floating) or np.issubdtype(px.dtype, np.integer)):
            raise ValueError(f"pixel_values must be numeric, got dtype {px.dtype}")
        rows = grid.patches
        if px.shape[0] != rows:
            raise ValueError(f"pixel_values has {px.shape[0]} rows but grid_thw implies sum(t*h*w) = {rows}")
        if check_finite:
            check_finite_rows(px, grid.array)
        if cfg.raster_rows:  # PaddleOCR-VL: raster rows per frame -> merge units, on the host (exact)
            px = px[planlib.raster_to_merge_order(grid.array, cfg.spatial_merge_size)]
        return px

    def _patches(self, patches: planlib.Patches, grid: planlib.Grid) -> planlib.Patches:
        """`Patches` checked against this tower and the grid (rows, frames per row, patch, channels,
        dtype, a finite table), their rows in merge-unit order."""
        cfg, data, table = self.cfg, np.asarray(patches.data), np.asarray(patches.table)
        want = (grid.patches, "S", cfg.patch_size, cfg.patch_size, cfg.in_channels)
        if data.ndim != 5 or data.shape[2:] != want[2:] or data.shape[1] not in (1, cfg.temporal_patch_size):
            raise ValueError(
                f"Patches.data must be uint8 [N, S, p, p, C] = [{grid.patches}, 1 or {cfg.temporal_patch_size}, "
                f"{cfg.patch_size}, {cfg.patch_size}, {cfg.in_channels}] for this tower, got shape {data.shape}: "
                "preprocess with this checkpoint's settings, config=enc.preprocess / enc.video_preprocess"
            )
        if data.shape[0] != grid.patches:
            raise ValueError(f"Patches hold {data.shape[0]} rows but grid_thw implies sum(t*h*w) = {grid.patches}")
        if data.dtype != np.uint8:
            raise ValueError(f"Patches.data must be uint8, got dtype {data.dtype}")
        if patches.temporal_patch_size != cfg.temporal_patch_size:
            raise ValueError(
                f"Patches for temporal_patch_size {patches.temporal_patch_size}; "
                f"the tower's is {cfg.temporal_patch_size}"
            )
        if table.shape != (cfg.in_channels, 256) or table.dtype != np.float32 or not np.isfinite(table).all():
            raise ValueError(
                f"Patches.table must be finite float32 [{cfg.in_channels}, 256], got {table.dtype} {table.shape}"
            )
        if cfg.raster_rows:  # PaddleOCR-VL: raster rows per frame -> merge units, on the host (exact)
            data = data[planlib.raster_to_merge_order(grid.array, cfg.spatial_merge_size)]
        return planlib.Patches(data, table, patches.temporal_patch_size)

    def _plans(self, grid: planlib.Grid) -> list[planlib.Plan]:
        """The plans the next encode of this grid uses: tight buckets for every chunk of a declared
        grid (warmup(tight=True)) and, with tight_after, of a grid encoded tight_after - 1 times
        before (while fewer than max_tight_buckets such buckets exist); otherwise the ladder's, with
        tight buckets for the chunks whose frames recur within the request itself (the equal chunks
        of a long video): a function of the request alone."""
        tight = dataclasses.replace(self.policy, tight=True)
        with self._seen_lock:
            declared, seen = grid.key in self._declared, self._seen.get(grid.key, 0)
        if declared:
            return planlib.make_plans(grid, self.cfg, tight)
        if self.tight_after is not None and seen + 1 >= self.tight_after:
            plans = planlib.make_plans(grid, self.cfg, tight)
            with self._seen_lock:
                new = {p.bucket for p in plans} - self._tight_buckets
                if len(self._tight_buckets) + len(new) <= self.max_tight_buckets:
                    self._tight_buckets |= new
                    return plans
        plans = planlib.make_plans(grid, self.cfg, self.policy)
        keys = [_frames_key(p.grid_thw) for p in plans]
        repeats = collections.Counter(keys)
        if max(repeats.values()) < 2:
            return plans
        return [
            dataclasses.replace(planlib.make_plan(k, self.cfg, tight), span=p.span, grid_thw=p.grid_thw)
            if repeats[k] >= 2
            else p
            for p, k in zip(plans, keys)
        ]

    def _count(self, grid: planlib.Grid, capacity: int = 4096) -> None:
        """One more encode of this grid (an LRU of the last `capacity` grids), for tight_after."""
        if self.tight_after is None:
            return
        with self._seen_lock:
            self._seen[grid.key] = self._seen.pop(grid.key, 0) + 1
            if len(self._seen) > capacity:
                self._seen.popitem(last=False)

    def cost_report(self, grid_thw) -> dict:
        """What the next encode of this grid costs: buckets, matmul FLOPs vs the ideal, temp memory,
        bytes sent to the device.

        Returns a dict with `buckets` (one per program call: a chunk, tight ones for a declared
        grid, see `warmup`, and a request's recurring chunks; on several devices one per mesh step,
        run by every device),
        `compiled_flops` (the matmuls of those programs as they run: cost.dot_flops, summed over
        devices), `ideal_flops` (analytic: the same matmuls on the real rows only, attention over
        the real frames / windows), `flops_ratio`, `temp_bytes` (the compiled programs' largest temp
        allocation, per device, of the programs for float rows; a `Patches` program's adds their
        expanded float32 rows), `patches` and `padded_patches` (summed over devices),
        `host_to_device_bytes` (pixels and plans of every program call, all devices, as encode_images,
        encode_video and the CLI send them: uint8 `Patches`), `host_to_device_bytes_float` (the same
        with float rows in the compute dtype, as `encode(pixel_values)` sends them) and
        `hf_pixel_bytes` (what HF's float32 pixel_values of the request weigh, for comparison).
        """
        g = planlib.as_grid(grid_thw, self.cfg)
        buckets = self._buckets(g)  # the next encode's: tight buckets for a grid that recurs
        copies = len(self.devices)  # 1 without a mesh: every device runs every step's bucket
        compiled = copies * sum(self._compiled_flops(b) for b in buckets)
        frames, windows = planlib.segment_lengths(g, self.cfg)
        ideal = cost.ideal_flops(self.cfg, frames, windows)
        temp = max(self._program(b).memory_analysis().temp_size_in_bytes for b in buckets)

        def sent(frames):  # bytes of every program call's inputs, all devices
            return copies * sum(_nbytes(input_specs(self.cfg, b, self.dtype, frames)) for b in buckets)

        return {
            "buckets": [dataclasses.asdict(b) for b in buckets],
            "patches": g.patches,
            "padded_patches": copies * sum(b.patches for b in buckets),
            "compiled_flops": compiled,
            "ideal_flops": ideal,
            "flops_ratio": compiled / ideal,
            "temp_bytes": int(temp),
            "host_to_device_bytes": sent(_frames_for(g, self.cfg)),
            "host_to_device_bytes_float": sent(None),
            "hf_pixel_bytes": g.patches * self.cfg.patch_dim * 4,
        }

    def _buckets(self, grid: planlib.Grid) -> list[planlib.Bucket]:
        """The bucket of each program call the next encode of a request makes (a chunk, or a mesh
        step)."""
        if self.mesh is None:
            return [p.bucket for p in self._plans(grid)]
        return [s.plan.bucket for s in devlib.plan_steps(grid, self.cfg, self.policy, len(self.devices))]

    def _compiled_flops(self, bucket: planlib.Bucket) -> float:
        if bucket not in self._flops:
            traced = jax.jit(self._forward).trace(self._state, *input_specs(self.cfg, bucket, self.dtype))
            self._flops[bucket] = cost.dot_flops(traced.jaxpr)
        return self._flops[bucket]

    def _program(self, bucket: planlib.Bucket, frames: int | None = None) -> jax.stages.Compiled:
        """The compiled program of `bucket` for float pixel rows (frames None) or for `Patches` of
        `frames` frames per row."""
        key = (bucket, frames)
        program = self._compiled.get(key)
        if program is not None:  # the hot path takes no lock
            return program
        with self._compile_lock:  # one compile at a time; a waiter finds the program done
            program = self._compiled.get(key)
            if program is not None:
                return program
            t0 = time.perf_counter()
            specs = input_specs(self.cfg, bucket, self.dtype, frames)
            if self.mesh is None:
                program = jax.jit(self._forward).lower(self._state, *specs).compile()
            else:
                program = self._mesh_forward(specs)
            self.compile_seconds[bucket] = self.compile_seconds.get(bucket, 0.0) + time.perf_counter() - t0
            self._compiled[key] = program  # last: a lock-free reader sees a finished entry
        return program

    def _forward(self, state, pixels, plan):
        """(tokens, deepstack features: [] without deepstack mergers)."""
        return forward(self._graphdef, state, pixels, plan)

    def _mesh_forward(self, specs: tuple[jax.ShapeDtypeStruct, planlib.Plan]) -> jax.stages.Compiled:
        """The program of one bucket on the mesh (`mesh_program`)."""
        program = jax.jit(mesh_program(self._forward, self.mesh))
        return program.lower(self._state, *mesh_specs(specs, self.mesh)).compile()


def _check_devices(devices) -> list[jax.Device]:
    """`devices` as a list of distinct devices of this process (a mesh spans local devices only:
    several hosts each run their own encoder on their own inputs)."""
    devices = list(devices)
    if not devices:
        raise ValueError("devices= is empty: give at least one device (e.g. jax.local_devices())")
    if not all(isinstance(d, jax.Device) for d in devices):
        raise ValueError(f"devices= must hold jax.Device objects, got {devices!r}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices= holds a device twice: {devices}")
    me = jax.process_index()
    if foreign := [d for d in devices if d.process_index != me]:
        raise ValueError(
            f"devices= holds devices of other processes {foreign}; an encoder runs on this "
            f"process's devices (jax.local_devices()); split the inputs across processes"
        )
    if len({d.platform for d in devices}) > 1:
        raise ValueError(f"devices= mixes platforms: {devices}")
    return devices


def _frames_key(grid_thw) -> tuple:
    """A chunk's frame sequence: its grid with adjacent rows of equal (h, w) merged (what a plan
    depends on), as a tuple of (t, h, w)."""
    rows: list[list[int]] = []
    for t, h, w in np.asarray(grid_thw).tolist():
        if rows and rows[-1][1:] == [h, w]:
            rows[-1][0] += t
        else:
            rows.append([t, h, w])
    return tuple(map(tuple, rows))


def check_finite_rows(pixel_values: np.ndarray, grid_thw) -> None:
    """Raise ValueError if pixel_values [N, P] holds a NaN or Inf, naming the image (its row in
    grid_thw, validated) and its first bad row. One pass over the pixels when all is finite (a
    sum: NaN / Inf propagate; a finite overflow only sends us to the exact search)."""
    if not np.issubdtype(pixel_values.dtype, np.floating) or np.isfinite(pixel_values.sum(dtype=np.float64)):
        return
    bad = ~np.isfinite(pixel_values).all(axis=1)  # [N]
    if not bad.any():
        return
    row = int(np.argmax(bad))
    g = np.asarray(grid_thw, np.int64)
    ends = np.cumsum(g[:, 0] * g[:, 1] * g[:, 2])  # [k] one past each image's last row
    image = int(np.searchsorted(ends, row, side="right"))
    first = row - (int(ends[image - 1]) if image else 0)
    value = pixel_values[row][~np.isfinite(pixel_values[row])][0]
    raise ValueError(
        f"pixel_values holds non-finite values: image {image} (grid_thw row {image} = "
        f"{g[image].tolist()}), its row {first} (pixel_values row {row}) has {value}; "
        f"{int(bad.sum())} bad row(s) in all"
    )


def _frames_of(pixels) -> int | None:
    """The program's pixel form for these (padded) pixels: None for float rows, else the `Patches`'
    frames per row."""
    return pixels.frames_per_patch if isinstance(pixels, planlib.Patches) else None


def _frames_for(grid: planlib.Grid, cfg: VisionConfig) -> int:
    """The frames per row of the `Patches` the preprocessors make for a grid: 1 for images (every
    t = 1), T when it holds a video."""
    return 1 if all(t == 1 for t, _, _ in grid.key) else cfg.temporal_patch_size


def _nbytes(tree) -> int:
    """Bytes of every array (or shape struct) in a pytree."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))
