"""VisionEncoder: a facade over named parts, each with a public API of its own.

    enc = VisionEncoder.from_pretrained(out_dir, dtype="float32")
    emb = enc.encode(pixel_values, grid_thw)      # np.ndarray [N // 4, out_dim]

  enc.programs        the weights on the devices and one compiled program per bucket (program.py)
  enc.bucket_choice   which buckets a request runs in: ladder, declared sizes, tight_after (plan/choice.py)
  enc.preprocessing   the image and video settings and the variant (preprocess/config.py)
  enc.prepare / run   a request's program calls: host work, then the device's (calls.py); the
                      pixel checks and PaddleOCR's row reorder happen once, in pixels.py
  enc.prepare_batch   items planned as one call (a batch); enc.ready / compile its programs

Per call: validate on the host, plan (numba, cached by grid; a large request is split at frame
boundaries into chunks that fill buckets well), pad pixels to each bucket, put pixels and plans on
the device in one `jax.device_put`, run each bucket's compiled program and fetch the results.
With `devices=[...]` the frames of a call are balanced across a mesh (devices.py; one device is a
mesh of one).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from PIL import Image

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.model.numerics import Numerics, numerics_for
from qwen_vit_jax.preprocess.config import PreprocessConfig, Preprocessing, preprocessing_from
from qwen_vit_jax.preprocess.images import image_preprocessor
from qwen_vit_jax.runtime import calls
from qwen_vit_jax.runtime.batching import Grouping, Packer
from qwen_vit_jax.runtime.devices import check_devices
from qwen_vit_jax.runtime.program import Programs, enable_compilation_cache
from qwen_vit_jax.runtime.video import video_chunks, video_tokens


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
      preprocessing: image and video settings for encode_images / encode_video (`Preprocessing`;
        default: HF's for this tower's variant; from_pretrained reads the checkpoint's).
        `preprocess=` / `video_preprocess=` (one PreprocessConfig each) still work, deprecated.
      max_batch_patches: patches per call of encode_images (default policy.max_patches per device).
      tight_after, max_tight_buckets: opt out of "every call of a request gives the same bits":
        a grid encoded tight_after times switches to its tight buckets (plan/choice.py says how).
        One device only: on several devices pass policy=BucketPolicy(tight=True) instead.
      compilation_cache_dir: opt in to JAX's persistent compilation cache in this directory
        (`enable_compilation_cache`; process-wide).
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
        preprocessing: Preprocessing | None = None,
        max_batch_patches: int | None = None,
        tight_after: int | None = None,
        max_tight_buckets: int = 16,
        compilation_cache_dir: str | os.PathLike | None = None,
        attention: str = "xla",
        preprocess: PreprocessConfig | None = None,
        video_preprocess: PreprocessConfig | None = None,
    ):
        if compilation_cache_dir is not None:
            enable_compilation_cache(compilation_cache_dir)
        if devices is not None and device is not None:
            raise ValueError("pass either device= or devices=, not both")
        self.cfg = cfg
        self.preprocessing = preprocessing_from(
            preprocessing,
            cfg.variant,
            {"preprocess": preprocess, "video_preprocess": video_preprocess},
            "VisionEncoder",
        )
        self.bucket_choice = planlib.BucketChoice(
            cfg, policy, tight_after=tight_after, max_tight_buckets=max_tight_buckets
        )
        devices = check_devices(devices) if devices is not None else [device or jax.local_devices()[0]]
        self.programs = Programs(cfg, params, numerics_for(dtype, devices[0], attention), devices)
        self.max_batch_patches = max_batch_patches or self.policy.max_patches * len(devices)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: str = "float32", **kwargs) -> VisionEncoder:
        """Load `path`: a directory written by `convert_checkpoint`, an HF checkpoint directory
        (its vision tensors converted in memory, nothing written) or a hub id ("Org/Name") in the
        local HF cache, never the network (sources.py). The checkpoint's preprocessor configs set
        the preprocessing unless `preprocessing` is given."""
        from qwen_vit_jax.weights.sources import load_source, preprocessing

        Numerics(dtype)  # validate before reading gigabytes
        if kwargs.get("compilation_cache_dir") is not None:
            enable_compilation_cache(kwargs.pop("compilation_cache_dir"))
        cfg, params, src = load_source(path)
        _, image, video = preprocessing(src)
        if kwargs.get("preprocess") is not None or kwargs.get("video_preprocess") is not None:
            kwargs.setdefault("preprocess", image)  # the deprecated keywords: the other one from the checkpoint
            kwargs.setdefault("video_preprocess", video)
        elif kwargs.get("preprocessing") is None:
            kwargs["preprocessing"] = Preprocessing(image=image, video=video, variant=cfg.variant)
        return cls(cfg, params, dtype=dtype, **kwargs)

    # ---- the parts' facts, under the names users read --------------------------------------
    devices = property(lambda self: self.programs.devices)
    device = property(lambda self: self.programs.devices[0])
    mesh = property(lambda self: self.programs.mesh)
    num = property(lambda self: self.programs.numerics)
    dtype = property(lambda self: self.programs.dtype)
    compile_seconds = property(lambda self: self.programs.compile_seconds)
    policy = property(lambda self: self.bucket_choice.policy)
    tight_after = property(lambda self: self.bucket_choice.tight_after)
    max_tight_buckets = property(lambda self: self.bucket_choice.max_tight_buckets)
    preprocess = property(lambda self: self.preprocessing.image, doc="The image PreprocessConfig.")
    video_preprocess = property(lambda self: self.preprocessing.video, doc="The video PreprocessConfig.")

    @property
    def compile_count(self) -> int:
        """Programs compiled so far (one per bucket and pixel form: float rows, `Patches` of 1 or T
        frames per row; one loaded from the compilation cache counts, its load time in compile_seconds)."""
        return self.programs.compile_count

    # ---- the public entry points ---------------------------------------------------------
    def encode(self, pixel_values, grid_thw, *, check_finite: bool = True, return_deepstack: bool = False):
        """Embed a batch of images / videos.

        Every call of a request gives the same bits, whatever this encoder encoded before and in
        whichever thread: the request's buckets are a function of its grid_thw, the policy and the
        grids declared with `warmup(grids, tight=True)` before (only `tight_after=n` gives up this
        guarantee). Across buckets results agree to padding invariance (float32: ~1e-6 relative).

        Args:
          pixel_values: [N, patch_dim] float rows, N = sum(t * h * w), in HF's patch order; or
            uint8 `Patches` (what the preprocessors return with uint8=True).
          grid_thw: [k, 3] ints (t, h, w) per image or video.
          check_finite: reject NaN / Inf in pixel_values with a ValueError naming the image and
            its first bad row. Without the check a non-finite image still never affects the other
            images' rows: the tower isolates segments.
          return_deepstack: also return Qwen3-VL's deepstack features.

        Returns:
          float32 [N // merge_unit, out_dim]: HF's `visual(...).pooler_output` (the merged tokens),
          all inputs concatenated in order. With return_deepstack, (tokens, features): one float32
          [N // merge_unit, out_dim] array per entry of cfg.deepstack_layers (HF's
          `deepstack_features`), an empty list for towers without deepstack mergers.
        """
        return self.run(self.prepare(pixel_values, grid_thw, check_finite=check_finite), return_deepstack)

    def prepare(self, pixel_values, grid_thw, *, check_finite: bool = True, batched: bool = False) -> calls.Prepared:
        """The host half of `encode`: plan, check the pixels once, pad them to each call's bucket.
        `batched`: the grid's rows are items packed by a caller, run in a batch plan (plan/choice.py)."""
        return calls.prepare(self.programs, self.bucket_choice, pixel_values, grid_thw, check_finite, batched)

    def run(self, prepared: calls.Prepared, return_deepstack: bool = False):
        """The device half of `encode`: one transfer, every program call, the rows in request order."""
        out = calls.run(self.programs, prepared, return_deepstack)
        self.bucket_choice.count(prepared.grid)  # one more encode of this grid (tight_after)
        return out

    def prepare_batch(self, items, *, compiled: bool = False) -> calls.Prepared:
        """Plan items [(pixels, grid_thw), ...] as one call in a batch plan (an item alone as `encode`
        plans it); `compiled`: its longest leading part with compiled programs (at least the first
        item). `run` it; `prepared.split` cuts the rows per item (calls.py)."""
        if compiled:
            return calls.ready_part(self.programs, self.bucket_choice, items)
        return calls.prepare_batch(self.programs, self.bucket_choice, items)

    def ready(self, prepared: calls.Prepared) -> bool:
        """Whether every program `prepared` runs is compiled (`run` would not compile)."""
        return all(self.programs.ready(*p) for p in prepared.program_keys)

    def compile(self, prepared: calls.Prepared) -> None:
        """Compile (or load from the persistent compilation cache) the programs `prepared` runs."""
        for p in prepared.program_keys:
            self.programs.get(*p)

    def encode_images(self, images) -> list[np.ndarray]:
        """Preprocess (enc.preprocessing: the checkpoint's preprocessor_config.json, else HF
        defaults) and embed. The pixels travel as uint8 `Patches` (each image's frame once) and are
        normalised on the device.

        images: a list of PIL images or HxWx3 uint8 arrays (any sizes) -> one float32
        [h * w / merge_unit, out_dim] array per image.
        """
        if isinstance(images, (Image.Image, np.ndarray)):
            images = [images]
        prep = image_preprocessor(self.cfg.variant)
        return self.encode_patches([prep([im], config=self.preprocess, uint8=True) for im in images])

    def encode_video(self, video, **sampling) -> np.ndarray:
        """One video (a file path, its bytes or decoded frames), sampled by `preprocess_video` with
        enc.preprocessing.video and `sampling` (fps / num_frames / max_frames / source_fps / min_pixels
        / max_pixels), encoded a group of frames at a time (`iter_video`): float32 [t * h * w /
        merge_unit, out_dim]; the timestamps: preprocess_video's. Memory follows a group."""
        return video_tokens(self, video, **sampling)

    def iter_video(self, video, *, fps=None, num_frames=None, max_frames=None):
        """`encode_video` as it goes: `VideoChunk`s (embeddings, grid_thw, timestamps, first frame) of
        groups of temporal patches that fit max_batch_patches; concatenated, encode_video's answer."""
        return video_chunks(self, video, fps=fps, num_frames=num_frames, max_frames=max_frames)

    def encode_patches(self, items: list[tuple[planlib.Patches, np.ndarray]]) -> list[np.ndarray]:
        """Encode prepared inputs: (patches, grid_thw [1, 3]) items, as the preprocessors return them
        with uint8=True (or float rows), consecutive ones packed into calls of at most
        max_batch_patches patches and one pixel form (batching.Packer; a larger item runs alone).
        Returns one float32 [tokens, out_dim] array per item."""
        packer, out = Packer(self.encode, Grouping(self.max_batch_patches), self.cfg.merge_unit), []  # ladder plans
        for i, (px, grid) in enumerate(items):
            out += packer.add(i, px, grid)
        return [tokens for _, tokens in out + packer.flush()]

    def warmup(self, grids, *, tight: bool = False, uint8: bool = False, batched: bool = False) -> list[planlib.Bucket]:
        """Compile the buckets that these grids land in.

        Args:
          grids: [k, 3] grid_thw requests.
          uint8: compile the programs that take `Patches` (what encode_images, encode_video and the
            CLI send: one frame per row for grids of images, t = 1 everywhere, else T) instead of
            float pixel_values rows.
          tight: declare these grids as sizes that recur (enc.bucket_choice.declare): every later
            encode of exactly such a grid runs in its tight buckets (several devices: tight shards).
          batched: each grid's rows are the items of one batch (`prepare_batch`): its batch plan.
        Returns:
          the bucket of each program call the grids' encodes make, in order.
        """
        return calls.warmup(self.programs, self.bucket_choice, grids, tight=tight, uint8=uint8, batched=batched)

    def cost_report(self, grid_thw) -> dict:
        """What the next encode of this grid costs: buckets, matmul FLOPs vs the ideal, temp memory,
        bytes sent to the device (a dict: runtime/calls.py's `cost_report` says every entry)."""
        return calls.cost_report(self.programs, self.bucket_choice, grid_thw)
