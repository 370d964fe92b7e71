"""The accelerators `qwen-vit-jax aot` compiles for, from their published data sheets: an NVIDIA
GPU as the GpuTargetConfig XLA's GPU compiler needs (compute capability, SMs, memory, bandwidth,
caches, clock), a TPU by libtpu's topology name ("v5e:2x4"), and each one's peak FLOP/s and
bandwidth for the roofline estimates. jax is imported only to describe a topology.
"""

from __future__ import annotations

import dataclasses
import os

GIB = 1 << 30


class CompilerMissing(RuntimeError):
    """The target's compiler (libtpu, the CUDA plugin) is not installed."""


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What XLA's GPU compiler needs to know of an NVIDIA GPU (a GpuTargetConfig), from the data
    sheets and the CUDA programming guide's per-architecture limits."""

    major: int  # compute capability
    minor: int
    sms: int
    fp32_lanes_per_sm: int
    shared_per_sm: int  # bytes
    shared_per_block_optin: int  # bytes
    threads_per_sm: int
    l2_bytes: int
    clock_ghz: float

    def target_config(self, name: str, memory_bytes: int, bandwidth: float) -> str:
        """The GpuTargetConfig text proto of this GPU."""
        return f"""gpu_device_info {{
  cuda_compute_capability {{ major: {self.major} minor: {self.minor} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: {self.shared_per_block_optin}
  shared_memory_per_core: {self.shared_per_sm}
  threads_per_core_limit: {self.threads_per_sm}
  core_count: {self.sms}
  fpus_per_core: {self.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {memory_bytes}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{name}"
"""


# Hopper (sm_90, SXM): 132 SMs of 128 FP32 lanes, 228 KiB shared memory per SM (227 KiB per block
# opt-in), 50 MiB L2, 1.98 GHz boost. Ampere A100 (sm_80, SXM): 108 SMs of 64 FP32 lanes, 164 KiB
# shared memory per SM (163 KiB per block), 40 MiB L2, 1.41 GHz boost.
HOPPER = GpuSpec(9, 0, 132, 128, 233472, 232448, 2048, 50 << 20, 1.98)
AMPERE_A100 = GpuSpec(8, 0, 108, 64, 167936, 166912, 2048, 40 << 20, 1.41)


@dataclasses.dataclass(frozen=True)
class Target:
    """An accelerator described by its published figures (per device).

    peak_flops: dense matmul FLOP/s by operand dtype. float32 is what the tower's float32 mode
    asks for (HIGHEST precision): true fp32 FMAs on a GPU (no TF32), six bf16 passes on a TPU's MXU
    (so a sixth of its bf16 peak: derived, not published).
    """

    name: str
    platform: str  # "gpu" | "tpu"
    description: str
    memory_bytes: int
    bandwidth: float  # HBM bytes / s
    peak_flops: dict[str, float]
    tpu_name: str = ""  # libtpu's topology prefix ("v5e")
    gpu: GpuSpec | None = None

    def devices(self, count: int = 1) -> list:
        """`count` devices of this target, as a deviceless topology (no device needed). A
        RuntimeError naming the fix when the target's compiler is not installed."""
        try:
            return self._devices(count)
        except (NotImplementedError, RuntimeError) as e:
            if "not implemented for cuda" in str(e) or "TPU support not installed" in str(e):
                raise CompilerMissing(
                    f"cannot compile for {self.description}: its compiler is not installed "
                    f"(pip install 'qwen_vit_jax[accel]': libtpu, the CUDA plugin and compiler wheels)"
                ) from None
            raise

    def _devices(self, count: int) -> list:
        from jax.experimental import topologies

        if self.platform == "gpu":
            config = self.gpu.target_config(self.description, self.memory_bytes, self.bandwidth)
            topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology=f"1x1x{count}")
            return list(topology.devices)
        if count not in TPU_SHAPES:
            raise ValueError(f"--devices for a TPU must be one of {sorted(TPU_SHAPES)} (one host), got {count}")
        x, y = TPU_SHAPES[count]
        # libtpu looks for a TPU VM's metadata at start-up (on any other machine it only warns) and
        # takes a machine-wide lock unless told that several processes may load it (no TPU is used).
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        topology = topologies.get_topology_desc(f"{self.tpu_name}:{x}x{y}", "tpu", chips_per_host_bounds=(x, y, 1))
        return list(topology.devices)


TPU_SHAPES = {1: (1, 1), 4: (2, 2), 8: (2, 4)}  # chips -> one host's (x, y) slice shape
HOPPER_PEAKS = {"bfloat16": 989e12, "float32": 67e12}
TARGETS = {
    "h100": Target("h100", "gpu", "NVIDIA H100 80GB HBM3", 80 * GIB, 3.35e12, HOPPER_PEAKS, gpu=HOPPER),
    "h200": Target("h200", "gpu", "NVIDIA H200", 141 * 10**9, 4.8e12, HOPPER_PEAKS, gpu=HOPPER),
    "a100": Target(
        "a100",
        "gpu",
        "NVIDIA A100-SXM4-80GB",
        80 * GIB,
        2.039e12,
        {"bfloat16": 312e12, "float32": 19.5e12},
        gpu=AMPERE_A100,
    ),
    "tpu-v5e": Target(
        "tpu-v5e", "tpu", "TPU v5e", 16 * GIB, 819e9, {"bfloat16": 197e12, "float32": 197e12 / 6}, tpu_name="v5e"
    ),
    "tpu-v6e": Target(
        "tpu-v6e", "tpu", "TPU v6e", 32 * GIB, 1640e9, {"bfloat16": 918e12, "float32": 918e12 / 6}, tpu_name="v6e"
    ),
}


def target_named(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[name]
