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
import re
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen_vit_jax import plan as planlib
from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.model.vit import abstract_model, as_bits
from qwen_vit_jax.runtime import cost
from qwen_vit_jax.runtime import devices as devlib
from qwen_vit_jax.runtime.program import forward, input_specs, mesh_program, mesh_specs
from qwen_vit_jax.tools.targets import GIB, TARGETS, CompilerMissing, Target, target_named  # noqa: F401 (the command's names)

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
    frames: int | None = 1,
) -> tuple[jax.stages.Compiled, BucketReport]:
    """Compile the encoder's program for one bucket on `devices` devices of `target`, deviceless.

    The encoder's mesh program (one `shard_map` over the frames, parameters replicated; memory is
    per device), on a mesh of one for one device. frames: the pixels it takes,
    uint8 `Patches` of 1 frame per row (images, what encode_images and the CLI send; the default),
    of T frames (videos), or None for HF's float rows. Returns (the compiled executable, its
    BucketReport).
    """
    model = abstract_model(cfg, dtype, target.platform, attention)
    graphdef, state = nnx.split(model)
    state = jax.eval_shape(as_bits, state)  # the encoder holds bf16 block stacks as bits: the same program
    mesh = Mesh(np.array(target.devices(devices)), ("data",))
    replicated = NamedSharding(mesh, P())
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), state)
    specs = input_specs(cfg, bucket, dtype, frames)

    def one(state, pixels, plan):
        return forward(graphdef, state, pixels, plan)

    fn, args = mesh_program(one, mesh), mesh_specs(specs, mesh)  # one device: a mesh of one, as the encoder
    traced = jax.jit(one).trace(state, *input_specs(cfg, bucket, dtype, frames))  # one device's work, for the counts
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
    """Compile every distinct program the encoder runs for `grids` on `target_name` (its buckets, each
    taking the uint8 `Patches` the CLI sends: 1 frame per row for a grid of images, T for a video);
    one report each."""
    target = target_named(target_name)
    seen, reports = set(), []
    for g in grids:
        frames = 1 if all(t == 1 for t, _, _ in np.asarray(g).tolist()) else cfg.temporal_patch_size
        for bucket, rows in buckets_for(cfg, [g], devices):
            if (bucket, frames) in seen:
                continue
            seen.add((bucket, frames))
            _, report = compile_bucket(target, cfg, bucket, dtype, devices, attention, patches=rows, frames=frames)
            reports.append(report)
            if progress:
                progress(f"  compiled {bucket.patches} rows in {report.compile_s:.1f} s")
    return reports


# ---- a checkpoint's config ------------------------------------------------------------------------
def config_of(path) -> VisionConfig:
    """The tower's config from a checkpoint directory: ours (written by convert_checkpoint) or an
    HF one (config.json); no weights are read."""
    import json
    import pathlib

    from qwen_vit_jax.weights.convert import FORMAT
    from qwen_vit_jax.weights.hf_read import CONFIG_FILE

    config_path = pathlib.Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {path}")
    meta = json.loads(config_path.read_text())
    if isinstance(meta, dict) and meta.get("format") == FORMAT:
        return VisionConfig.from_dict(meta["vision_config"])
    return VisionConfig.from_hf(meta)


# ---- the command ----------------------------------------------------------------------------------
def command(args) -> int:
    """`qwen-vit-jax aot` (tools/cli.py parses its arguments): compile, then print per bucket."""
    import json

    from qwen_vit_jax.config import parse_sizes
    from qwen_vit_jax.presets import PRESETS
    from qwen_vit_jax.tools.args import CommandError

    if (args.checkpoint is None) == (args.variant is None):
        raise CommandError("give a checkpoint directory or --variant PRESET (one of them)")
    if args.devices < 1:
        raise CommandError(f"--devices must be >= 1, got {args.devices}")
    grids = [np.array([s]) for s in parse_sizes(args.sizes, "--sizes")]
    jax.config.update("jax_platforms", "cpu")  # JAX's own backend: the compile targets are deviceless
    jax.config.update("jax_enable_compilation_cache", False)  # a deviceless program cannot be loaded back
    cfg = PRESETS[args.variant] if args.variant else config_of(args.checkpoint)
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
        raise CommandError(str(e)) from None
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
