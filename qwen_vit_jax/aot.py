"""Ahead of time, without the device: compile the encoder's programs for an H100 / H200 or a TPU
v5e / v6e on this machine, and read what the compiled program needs.

    model = qvj.abstract_model(cfg, dtype="bfloat16", platform="gpu")   # shape-only parameters
    qwen-vit-jax aot --target h100 --variant qwen2.5-vl-3b --dtype bfloat16 --sizes 36x36,10x36x36

JAX compiles for a device that is not present when it is given a description of it (a
`TopologyDescription`): libtpu describes TPU slices by name ("v5e:2x4"), the CUDA plugin an NVIDIA
GPU from a GpuTargetConfig (compute capability, SMs, memory, bandwidth, caches, clock: `TARGETS`
below, written from the published data sheets). JAX's own backend stays the CPU. Every argument is
a `jax.ShapeDtypeStruct` placed on the topology's devices, so `jax.jit(f).lower(...).compile()`
returns the target's real executable: its memory analysis and its HLO are evidence about the
target. Speeds are not: a roofline here is an estimate until a device measures it.

Install the compilers with the `accel` extra (`pip install -e ".[accel]"`: libtpu, the CUDA plugin
and pjrt at jax's version, the CUDA compiler wheels). No driver, cuDNN or cuBLAS is needed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen_vit_jax import cost
from qwen_vit_jax import devices as devlib
from qwen_vit_jax import plan as planlib
from qwen_vit_jax.attention import platform_numerics
from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.encoder import _input_specs, forward, mesh_program, mesh_specs
from qwen_vit_jax.model import VisionTransformer, as_bits
from qwen_vit_jax.model import abstract_model as _abstract_model

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


def abstract_model(
    cfg: VisionConfig, dtype: str = "float32", platform: str = "cpu", attention: str = "xla"
) -> VisionTransformer:
    """The tower as an `nnx.Module` with shape-only parameters (`jax.ShapeDtypeStruct`s, no memory)
    and the attention schedule of `platform` ("cpu" | "gpu" | "tpu"): what `load_model` gives a user
    on that platform, for ahead-of-time compiles (`jax.jit(f).lower(...)` over it and
    `Plan.abstract(bucket)` or `make_plans`).

    attention: "xla" (the default) or "kernel" (the platform's Pallas kernel: Triton on "gpu",
    splash on "tpu").
    """
    num = platform_numerics(dtype, platform, attention)
    graphdef, state = nnx.split(_abstract_model(cfg, num))

    # As model.fill_state stores them: matrices in the operand dtype, norms and biases float32.
    flat = [
        (path, var.replace(jax.ShapeDtypeStruct(var.shape, num.operand_dtype))) if path[-1] == "kernel" else (path, var)
        for path, var in nnx.to_flat_state(state)
    ]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---- compiling one bucket ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BucketReport:
    """What one bucket's program needs on a target, per device.

    flops / bytes_moved: the project's own count over the traced program (`cost.dot_flops`,
    `cost.dot_bytes`): every matmul at its padded shape, loop bodies times their trip counts; XLA's
    cost analysis counts a loop body once, so it is not used. roofline_s = max(flops / peak,
    bytes_moved / bandwidth) at the target's published peaks: an estimate, not a measurement.
    """

    target: str
    dtype: str
    devices: int
    bucket: planlib.Bucket
    patches: int  # real rows in this bucket (all devices)
    compile_s: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_moved: float
    host_ops: tuple[str, ...]  # HLO ops that touch the host (callbacks, transfers): none expected

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes + self.code_bytes

    def fits(self) -> bool:
        return self.peak_bytes <= target_named(self.target).memory_bytes

    @property
    def roofline_s(self) -> float:
        t = target_named(self.target)
        return max(self.flops / t.peak_flops[self.dtype], self.bytes_moved / t.bandwidth)


# Ops by which a program would talk to the host: callbacks to Python, infeed / outfeed, send /
# recv (host transfers), and host-offloaded computations.
_HOST_OP = re.compile(
    r"\b(infeed|outfeed|send|send-done|recv|recv-done)\(|custom_call_target=\"[^\"]*(callback|host)[^\"]*\"|"
    r"_xla_host_transfer|_xla_stream_annotation=\"host\"|MoveToHost|MoveToDevice",
    re.IGNORECASE,
)


def host_ops(hlo_text: str) -> tuple[str, ...]:
    """The host-touching ops in a compiled program's HLO text (`_HOST_OP`), one entry per line."""
    return tuple(m.group(0) for m in map(_HOST_OP.search, hlo_text.splitlines()) if m)


def compile_bucket(
    target: Target,
    cfg: VisionConfig,
    bucket: planlib.Bucket,
    dtype: str = "bfloat16",
    devices: int = 1,
    attention: str = "xla",
    patches: int = 0,
) -> tuple[jax.stages.Compiled, BucketReport]:
    """Compile the encoder's program for one bucket on `devices` devices of `target`, deviceless.

    One device: the encoder's single-device program; several: its mesh program (one `shard_map`
    over the frames, parameters replicated; memory is per device). Returns (the compiled
    executable, its BucketReport).
    """
    model = abstract_model(cfg, dtype, target.platform, attention)
    graphdef, state = nnx.split(model)
    state = jax.eval_shape(as_bits, state)  # the encoder holds bf16 block stacks as bits: the same program
    mesh = Mesh(np.array(target.devices(devices)), ("data",))
    replicated = NamedSharding(mesh, P())
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), state)
    specs = _input_specs(cfg, bucket, dtype)

    def one(state, pixels, plan):
        return forward(graphdef, state, pixels, plan)

    if devices == 1:
        fn, args = one, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), specs)
    else:
        fn, args = mesh_program(one, mesh), mesh_specs(specs, mesh)
    traced = jax.jit(one).trace(state, *_input_specs(cfg, bucket, dtype))  # one device's work, for the counts
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(state, *args).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    report = BucketReport(
        target=target.name,
        dtype=dtype,
        devices=devices,
        bucket=bucket,
        patches=patches,
        compile_s=compile_s,
        argument_bytes=int(mem.argument_size_in_bytes),  # per device (a partitioned program's is one device's)
        output_bytes=int(mem.output_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        code_bytes=int(mem.generated_code_size_in_bytes),
        flops=cost.dot_flops(traced.jaxpr),
        bytes_moved=cost.dot_bytes(traced.jaxpr),
        host_ops=host_ops(compiled.as_text()),
    )
    return compiled, report


def buckets_for(
    cfg: VisionConfig, grids: list, devices: int = 1, policy: planlib.BucketPolicy | None = None
) -> list[tuple[planlib.Bucket, int]]:
    """(bucket, real rows) of every program call the encoder makes for each grid (a [k, 3]
    grid_thw): its chunks on one device, its mesh steps on several. Buckets repeat across calls."""
    policy = policy or planlib.BucketPolicy()
    out = []
    for g in grids:
        if devices == 1:
            out += [(p.bucket, p.n_patches) for p in planlib.make_plans(g, cfg, policy)]
        else:
            out += [(s.plan.bucket, sum(s.rows)) for s in devlib.plan_steps(g, cfg, policy, devices)]
    return out


# ---- the report --------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.0f}"


def format_reports(reports: list[BucketReport]) -> str:
    """The per-bucket table `qwen-vit-jax aot` prints."""
    head = (
        f"{'rows':>6} {'real':>6} {'compile s':>9} {'args MiB':>9} {'out MiB':>8} {'temp MiB':>9} "
        f"{'peak MiB':>9} {'fits':>4} {'GFLOP':>9} {'GB moved':>9} {'roofline ms':>11} {'host ops':>8}"
    )
    lines = [head]
    for r in reports:
        lines.append(
            f"{r.bucket.patches:>6} {r.patches:>6} {r.compile_s:>9.2f} {_mib(r.argument_bytes):>9} "
            f"{_mib(r.output_bytes):>8} {_mib(r.temp_bytes):>9} {_mib(r.peak_bytes):>9} "
            f"{'yes' if r.fits() else 'NO':>4} {r.flops / 1e9:>9,.1f} {r.bytes_moved / 1e9:>9.2f} "
            f"{r.roofline_s * 1e3:>11.2f} {len(r.host_ops):>8}"
        )
    return "\n".join(lines)


def run(
    target_name: str,
    cfg: VisionConfig,
    grids: list,
    dtype: str = "bfloat16",
    devices: int = 1,
    attention: str = "xla",
    progress=print,
) -> list[BucketReport]:
    """Compile every distinct bucket the encoder uses for `grids` on `target_name`; one report each."""
    target = target_named(target_name)
    seen, reports = set(), []
    for bucket, rows in buckets_for(cfg, grids, devices):
        if bucket in seen:
            continue
        seen.add(bucket)
        _, report = compile_bucket(target, cfg, bucket, dtype, devices, attention, patches=rows)
        reports.append(report)
        if progress:
            progress(f"  compiled {bucket.patches} rows in {report.compile_s:.1f} s")
    return reports


# ---- the command line ----------------------------------------------------------------------------

DEFAULT_SIZES = "36x36,10x36x36,16x32x32"  # an image, a video, the largest bucket (16384 rows)


def config_of(path) -> VisionConfig:
    """The tower's config from a checkpoint directory: ours (written by convert_checkpoint) or an
    HF one (config.json); no weights are read."""
    import json
    import pathlib

    from qwen_vit_jax.convert import CONFIG_FILE, FORMAT

    config_path = pathlib.Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {path}")
    meta = json.loads(config_path.read_text())
    if isinstance(meta, dict) and meta.get("format") == FORMAT:
        return VisionConfig.from_dict(meta["vision_config"])
    return VisionConfig.from_hf(meta)


def main(argv: list[str] | None = None, *, prog: str = "qwen-vit-jax aot") -> int:
    """`qwen-vit-jax aot`: compile the encoder's programs for an accelerator this machine does not
    have, and print per bucket what they need there."""
    import argparse
    import json

    from qwen_vit_jax.config import PRESETS

    ap = argparse.ArgumentParser(
        prog=prog,
        description="Compile the encoder's programs for an accelerator this machine does not have (deviceless, "
        "ahead of time) and print per bucket: compile seconds; argument, output and temp memory per device and "
        "whether the peak fits; matmul FLOPs and bytes moved (our own count over the traced program, loop "
        "bodies times their trip counts); a roofline time at the target's published peaks (an estimate); and "
        "host ops in the program (0 expected). Needs the accel extra: pip install 'qwen_vit_jax[accel]'.",
    )
    ap.add_argument("checkpoint", nargs="?", help="a converted or HF checkpoint directory (only its config is read)")
    ap.add_argument("--target", required=True, choices=tuple(TARGETS), help="the accelerator to compile for")
    ap.add_argument("--variant", choices=tuple(PRESETS), help="a released tower's preset instead of a checkpoint")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="default bfloat16")
    ap.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"comma-separated requests in patches, HxW or TxHxW (default {DEFAULT_SIZES}: a 36x36 image, a "
        "10-frame video, a request that fills the largest bucket)",
    )
    ap.add_argument("--devices", type=int, default=1, help="devices: N > 1 compiles the mesh program (default 1)")
    ap.add_argument(
        "--attention", choices=("xla", "kernel"), default="xla", help="the XLA schedule or the platform's kernel"
    )
    ap.add_argument("--json", metavar="PATH", help="also write the reports as JSON")
    args = ap.parse_args(argv)
    if (args.checkpoint is None) == (args.variant is None):
        ap.error("give a checkpoint directory or --variant PRESET (one of them)")
    if args.devices < 1:
        ap.error(f"--devices must be >= 1, got {args.devices}")
    jax.config.update("jax_platforms", "cpu")  # JAX's own backend: the compile targets are deviceless
    jax.config.update("jax_enable_compilation_cache", False)  # a deviceless program cannot be loaded back
    from qwen_vit_jax.cli import parse_sizes

    cfg = PRESETS[args.variant] if args.variant else config_of(args.checkpoint)
    grids = [np.array([s]) for s in parse_sizes(args.sizes)]
    target = target_named(args.target)
    name = args.variant or args.checkpoint
    print(
        f"{name}: {cfg.variant}, depth {cfg.depth}, width {cfg.width}; {args.dtype}, attention {args.attention}; "
        f"target {target.description} x {args.devices} (deviceless compile; peaks: "
        f"{target.peak_flops[args.dtype] / 1e12:,.0f} TFLOP/s, {target.bandwidth / 1e12:.2f} TB/s, "
        f"{target.memory_bytes / GIB:.0f} GiB per device)"
    )
    try:
        reports = run(args.target, cfg, grids, args.dtype, args.devices, args.attention, progress=None)
    except CompilerMissing as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    print(format_reports(reports))
    print(
        "memory: per device, from the compiled program; GFLOP / GB moved: one device's matmuls (operands read "
        "and results written once); roofline: an estimate at published peaks, not a measurement"
    )
    if args.json:
        rows = [
            {**dataclasses.asdict(r), "bucket": dataclasses.asdict(r.bucket), "peak_bytes": r.peak_bytes}
            | {"fits": r.fits(), "roofline_s": r.roofline_s}
            for r in reports
        ]
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "checkpoint": name, "reports": rows}, f, indent=1)
    return 1 if any(r.host_ops for r in reports) else 0
