"""How the tower's matmuls run on a device: `Numerics` (operand dtype, native bf16 dots or not,
the CPU's tile loops, the attention kernel, the TPU's MLP padding) and the choice of it per device
(`numerics_for`) or per platform without one (`platform_numerics`, for ahead-of-time compiles)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from qwen_vit_jax.config import dtype_named

# Who runs the attention core (Numerics.attention): XLA, or a platform's Pallas kernel.
ATTENTION_KERNELS = ("xla", "triton", "splash")


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How matmuls run. float32: operands float32 at HIGHEST precision (exact on GPU/TPU too).
    bfloat16: operands rounded to bfloat16, float32 accumulation; everything else float32.

    `native_bf16=False` computes the bfloat16 mode's products as float32 dots of the
    bf16-rounded operands: the same numbers (a bf16 x bf16 product is exact in float32), for
    CPUs without bf16 dot instructions, where XLA's bf16 dot is slower than its float32 one.

    `tile_loops=True` runs full attention's (head, tile) problems one after another as 2-D dots
    (XLA's CPU backend runs those 3-4x faster than batched dots: benchmarks/history.md, "One-frame
    full attention" and "Experiments (bench_profile.py ...)");
    False batches them (GPUs and TPUs want few large kernels). The same arithmetic either way.

    `attention` picks who runs the attention core: "xla" (the schedules in this module: the
    default, and the reference), "triton" (a Pallas Triton kernel for NVIDIA GPUs,
    attention_gpu.py) or "splash" (Pallas splash attention for TPUs, attention_tpu.py). The
    kernels take the same inputs and give the same outputs; `interpret=True` runs them in
    Pallas' interpreter (any backend, slow: for tests on a CPU).

    `mlp_multiple` rounds the MLP's hidden width up to a multiple of it, with zero weights in the
    added columns / rows: exactly the same outputs (act(0) = 0 for every activation here). TPUs
    take 128: an MLP stack whose width is not a multiple of the 128-lane tile (the 3B tower's 3420)
    is stored in another layout than the layer loop reads, and XLA copies the whole stacks at every
    call (the temp memory it cost: benchmarks/RESULTS.md, "Deviceless accelerators"; how: history.md,
    "Accelerators, ahead of time").
    """

    dtype: str = "float32"
    native_bf16: bool = True
    tile_loops: bool = False
    attention: str = "xla"
    interpret: bool = False
    mlp_multiple: int = 1

    def __post_init__(self):
        dtype_named(self.dtype)  # a ValueError for any other name
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {self.attention!r}")

    @property
    def operand_dtype(self):
        """Storage dtype of the weight matrices."""
        return dtype_named(self.dtype)

    def mlp_width(self, intermediate_size: int) -> int:
        """The MLP hidden width the model stores: intermediate_size rounded up to mlp_multiple."""
        return -(-intermediate_size // self.mlp_multiple) * self.mlp_multiple

    def einsum(self, spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
        """einsum with operands rounded to the operand dtype and a float32 result."""
        if self.dtype == "float32" or not self.native_bf16:
            a, b = (x.astype(self.operand_dtype).astype(jnp.float32) for x in (a, b))
            return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def has_native_bf16(device: jax.Device) -> bool:
    """Whether `device` has fast bfloat16 dots: GPUs and TPUs do; a CPU needs avx512_bf16 or
    AMX (read from /proc/cpuinfo; without it XLA's bf16 dot is slower than float32)."""
    if device.platform != "cpu":
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def numerics_for(dtype: str = "float32", device: jax.Device | None = None, attention: str = "xla") -> Numerics:
    """The Numerics for `dtype` on `device` (default jax.devices()[0]): native bf16 dots where the
    device has them, full attention as 2-D dot loops on CPU. attention: "xla", or "kernel" for
    the device's Pallas kernel (Triton on a GPU, splash on a TPU; `platform_numerics`)."""
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        return platform_numerics(dtype, device.platform, attention)
    kernel = _kernel("cpu", attention)  # a kernel on a CPU runs in Pallas' interpreter (tests)
    native = has_native_bf16(device)
    return Numerics(dtype, native_bf16=native, tile_loops=True, attention=kernel, interpret=kernel != "xla")


def platform_numerics(dtype: str, platform: str, attention: str = "xla") -> Numerics:
    """The Numerics a `platform` ("cpu" | "gpu" | "tpu"; "cuda" / "rocm" mean "gpu") runs: what
    `numerics_for` gives on its device, without needing one (ahead-of-time compiles). A CPU's bf16
    dots are taken as native (as on every CPU with avx512_bf16 or AMX)."""
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"platform must be 'cpu', 'gpu' or 'tpu', got {platform!r}")
    kernel = _kernel(platform, attention)
    cpu = platform == "cpu"
    return Numerics(
        dtype,
        native_bf16=True,
        tile_loops=cpu,
        attention=kernel,
        interpret=cpu and kernel != "xla",
        mlp_multiple=128 if platform == "tpu" else 1,
    )


def _kernel(platform: str, attention: str) -> str:
    """attention ("xla" | "kernel" | a kernel's name) resolved for a platform."""
    kernel = {"gpu": "triton", "tpu": "splash"}.get(platform)
    if attention == "kernel":
        if kernel is None:
            raise ValueError(f"no attention kernel for platform {platform!r}: use attention='xla'")
        return kernel
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be 'xla', 'kernel' or one of {ATTENTION_KERNELS}, got {attention!r}")
    return attention
