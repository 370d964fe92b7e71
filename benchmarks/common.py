"""What the suites share: worker processes, timing, tables, the machine and versions of a result,
checkpoints, FLOPs, the matmul peak, other revisions of the package.

A suite is a parent that imports neither torch nor jax: each side runs in a worker process
(`run_worker`: benchmarks/worker.py runs one of the suite's WORKERS) that hands back one dict, or,
with the runner's --in-process (the quick runs of tests/test_benchmarks.py), in this process. This
module imports only the standard library and numpy at the top, so the EasyDeL venv (its own jax, no
qwen_vit_jax) can run the peer suite's workers too.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RESULT_TAG = "RESULT "
# The runner's --in-process: workers run in this process when no other interpreter or PYTHONPATH is asked
# for (quick runs that check a suite still works; its timings then share one process).
IN_PROCESS = False


def cache() -> pathlib.Path:
    """Where checkpoints, inputs and worktrees are built once and reused: $QVJ_BENCH_CACHE, else
    ~/.cache/qwen_vit_jax_bench (delete it after a change of the converted format)."""
    return pathlib.Path(os.environ.get("QVJ_BENCH_CACHE") or pathlib.Path.home() / ".cache" / "qwen_vit_jax_bench")


def ref_python() -> str | None:
    """The python of the video-reference venv (HF's torchvision backend; benchmarks/video_reference.sh
    builds it): $VIDEO_REF_PYTHON, else the one in the cache where it exists, else None."""
    found = cache() / "venv-video-ref" / "bin" / "python"
    return os.environ.get("VIDEO_REF_PYTHON") or (str(found) if found.exists() else None)


# ---- worker processes ---------------------------------------------------------------------------
def torch_env(threads: int | None = None) -> dict[str, str]:
    """Environment for a torch process: OpenMP threads spin instead of sleeping (this VM
    stalls sleeping OpenMP workers for ~8 ms at times); `threads` pins the thread count."""
    env = dict(os.environ, OMP_WAIT_POLICY="ACTIVE")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_worker(module: str, kind: str, payload: dict, *, env: dict | None = None, python: str | None = None) -> dict:
    """benchmarks.MODULE's WORKERS[kind](payload) in a fresh process (`python benchmarks/worker.py
    MODULE KIND`, the payload on stdin), its stderr passed through, or in this one with IN_PROCESS when
    the worker asks for no other interpreter and no other PYTHONPATH or XLA_FLAGS. `module` is the
    suite's __name__ (or its last part)."""
    module = module.rpartition(".")[2]
    t0 = time.perf_counter()
    env_differs = any((env or os.environ).get(k) != os.environ.get(k) for k in ("PYTHONPATH", "XLA_FLAGS"))
    if IN_PROCESS and python in (None, sys.executable) and not env_differs:
        import importlib

        handler = importlib.import_module(f"benchmarks.{module}").WORKERS[kind]
        return json.loads(json.dumps(handler(json.loads(json.dumps(payload)))))  # as through a pipe
    proc = subprocess.run(
        [python or sys.executable, str(ROOT / "benchmarks" / "worker.py"), module, kind],
        input=json.dumps(payload),
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-4000:])
        raise RuntimeError(f"worker {kind} of the {module} suite failed (exit {proc.returncode})")
    log(f"worker {module}.{kind}: done in {time.perf_counter() - t0:.1f} s")
    return json.loads(lines[-1][len(RESULT_TAG) :])


def alternate(rounds: int, sides: dict, run) -> dict[str, list]:
    """`run(side, spec)` for every side of `sides` (name -> spec) in each of `rounds` rounds, the
    order reversed every other round (a shared VM's speed drifts over minutes: alternating spreads the
    drift over both sides) -> name -> the results of its rounds."""
    out: dict[str, list] = {name: [] for name in sides}
    for rnd in range(rounds):
        for name in list(sides) if rnd % 2 == 0 else list(sides)[::-1]:
            out[name].append(run(name, sides[name]))
    return out


def one_core() -> None:
    """Pin this worker to one core (not in-process: the caller's process keeps its cores)."""
    if hasattr(os, "sched_setaffinity") and not IN_PROCESS:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- timing -------------------------------------------------------------------------------------
def time_calls(fn, repeats: int, *args, setup=None) -> list[float]:
    """Seconds of `repeats` calls of fn(*args), each timed alone; setup() runs untimed before each."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return times


def summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "n": len(times), "times": times}


def pooled(runs: list[dict], *path: str) -> dict:
    """summary() of the per-call times found at runs[i][path...]["times"], pooled over the runs (rounds)."""
    times = []
    for r in runs:
        for key in path:
            r = r[key]
        times += r["times"]
    return summary(times)


def count_compiles() -> dict:
    """Count every XLA program this (JAX) process builds from now on: the returned dict's
    "count" and "seconds" grow with each /jax/core/compile/backend_compile_duration event, which
    fires once per program (jit, AOT .compile(), eager-op helpers; checked here on one AOT
    compile), also when it is loaded from a persistent compilation cache: such loads are
    counted apart in "cache_hits"."""
    import jax
    import jax.numpy as jnp

    event, stats = "/jax/core/compile/backend_compile_duration", {"count": 0, "seconds": 0.0, "cache_hits": 0}

    def on_duration(name, seconds, **_):
        if name == event:
            stats["count"] += 1
            stats["seconds"] += seconds

    def on_event(name, **_):
        if name == "/jax/compilation_cache/cache_hits":
            stats["cache_hits"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((3,), jnp.float32)).compile()
    if stats["count"] != 1:
        raise RuntimeError(f"{event} fired {stats['count']} times for one compile: cannot count compiles")
    stats.update(count=0, seconds=0.0, cache_hits=0)
    return stats


# ---- tables -------------------------------------------------------------------------------------
def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.3g} µs"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.2f} s"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- what a result records: the machine, the versions, the revision -----------------------------
DOT_FLAGS = {
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
    "amx_int8",
}  # what decides which dot kernels XLA and oneDNN can use
DISTRIBUTIONS = (
    "jax",
    "jaxlib",
    "flax",
    "numba",
    "numpy",
    "torch",
    "transformers",
    "pillow",
    "simplejpeg",
    "av",
    "grain",
    "ray",
    "pyarrow",
    "uvicorn",
    "httpx",
    "libtpu",
    "jax-cuda13-plugin",
)


def lscpu() -> dict[str, str]:
    """`lscpu`'s "key: value" lines ({} where lscpu is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in text.splitlines()) if v}


def machine() -> dict:
    """This machine as a result records it: lscpu's model, family and model numbers, cores, the
    dot-relevant flags, the hypervisor, the load average when the run ended."""
    info = lscpu()
    return {
        "lscpu_model": info.get("Model name", "?"),
        "family": info.get("CPU family"),
        "model": info.get("Model"),
        "cores": os.cpu_count(),
        "flags": sorted(set(info.get("Flags", "").split()) & DOT_FLAGS),
        "hypervisor": info.get("Hypervisor vendor"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def describe_machine(m: dict) -> str:
    """One line for a table's caption: a transcribed result's own words, else the lscpu fields."""
    if m.get("description"):
        return m["description"]
    parts = [f'`lscpu` "{m["lscpu_model"]}"']
    if m.get("family"):
        parts[0] += f", family {m['family']} model {m['model']}"
    parts.append(f"{m['cores']} cores" + (f", {m['hypervisor']}" if m.get("hypervisor") else ""))
    parts.append(" ".join(m.get("flags") or []) or "no AVX-512")
    if m.get("load_average"):
        parts.append("load average " + " / ".join(f"{x:.1f}" for x in m["load_average"]))
    return "; ".join(parts)


def machine_line() -> str:
    return "CPU: " + describe_machine(machine())


def installed_versions() -> dict[str, str]:
    """The versions of the packages a figure depends on that are installed (metadata only: no import)."""
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def versions(*modules: str) -> dict:
    """Versions of the given modules as imported in a worker (another venv's, say)."""
    import importlib

    return {m: getattr(importlib.import_module(m), "__version__", "?") for m in modules}


def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


# ---- models and checkpoints ---------------------------------------------------------------------
def model_config(variant: str, quick: bool = False):
    """The preset's VisionConfig, or (quick) a 2-block version of it: one window and one full
    layer for Qwen2.5-VL; 16 heads for Qwen2-VL (EasyDeL 0.3.0 ignores num_heads, assumes 16);
    Qwen3: the real position table, a deepstack tap after block 0 (Qwen3-VL)."""
    import dataclasses

    from qwen_vit_jax.families import QWEN2_5_VL, QWEN3_FAMILY
    from qwen_vit_jax.presets import PRESETS

    cfg = PRESETS[variant]
    if not quick:
        return cfg
    small = {"depth": 2, "width": 128, "num_heads": 4, "intermediate_size": 256, "out_dim": 64}
    if cfg.variant in QWEN3_FAMILY:
        return dataclasses.replace(cfg, **small, deepstack_layers=(0,) if cfg.deepstack_layers else ())
    if cfg.variant == QWEN2_5_VL:
        return dataclasses.replace(cfg, **small, fullatt_block_indexes=(1,))
    return dataclasses.replace(cfg, **{**small, "num_heads": 16, "intermediate_size": 512})


def checkpoint(variant: str, quick: bool, seed: int = 0) -> dict[str, str]:
    """HF checkpoint (random weights, qwen_vit_jax.tools.hf_reference.build_hf_model, save_pretrained)
    and our conversion of it, built once by a worker and reused across runs: {"hf": dir, "ours": dir}."""
    root = cache() / f"{variant}{'-quick' if quick else ''}-seed{seed}"
    if not root.is_dir():
        log(f"building {root} (HF model, save_pretrained, convert)")
        payload = {"variant": variant, "quick": quick, "seed": seed, "root": str(root)}
        run_worker("common", "build", payload, env=torch_env())
    return {"hf": str(root / "hf"), "ours": str(root / "ours")}


def build_checkpoint(p: dict) -> dict:
    """Worker: write root/hf and root/ours, atomically (a half-built cache never counts)."""
    import shutil

    import qwen_vit_jax as qvj
    from qwen_vit_jax.tools.hf_reference import build_hf_model

    root = pathlib.Path(p["root"])
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_hf_model(model_config(p["variant"], p["quick"]), seed=p["seed"]).save_pretrained(tmp / "hf")
    qvj.convert_checkpoint(tmp / "hf", tmp / "ours")
    tmp.rename(root)
    return {"root": str(root)}


def demo_checkpoint(p: dict) -> dict:
    """Worker: the demo's random checkpoint of p["model"] ("tiny" or "3b"), built once under the cache."""
    from qwen_vit_jax.tools.demo import prepare_checkpoint

    return {"path": str(prepare_checkpoint(p["model"], cache(), log=log))}


def host_bound_checkpoint() -> str:
    """A Qwen2.5-VL tower small enough that the host is the bottleneck on a CPU "device": one block,
    width 32, window attention only (the demo's tiny tower has full-attention blocks: on 4,888 rows
    they cost this CPU ~250 ms per 1080p image, far more than its preprocessing). Random weights,
    written in HF's layout and converted (no torch)."""
    import dataclasses
    import shutil

    import qwen_vit_jax as qvj
    from qwen_vit_jax.tools.demo import TINY, write_random_hf_checkpoint

    root = cache() / "host-bound-tower-1m"
    if not (root / "ours").is_dir():
        cfg = dataclasses.replace(
            TINY, depth=1, width=32, num_heads=2, intermediate_size=64, out_dim=32, fullatt_block_indexes=()
        )
        shutil.rmtree(root, ignore_errors=True)
        write_random_hf_checkpoint(cfg, root / "hf")
        pre = root / "hf" / "preprocessor_config.json"  # HF's class default sizing, as the stage table
        pre.write_text(json.dumps(json.loads(pre.read_text()) | {"max_pixels": 1003520}))
        qvj.convert_checkpoint(root / "hf", root / "ours")
    return str(root / "ours")


def random_pixels(grid_thw, patch_dim: int, seed: int = 0) -> np.ndarray:
    """float32 [sum(t*h*w), patch_dim] standard normal rows (as tests/hf_utils.random_pixels)."""
    n = int(np.prod(np.asarray(grid_thw), axis=1).sum())
    return np.random.default_rng(seed).standard_normal((n, patch_dim), dtype=np.float32)


def rel_diff(a, b) -> float:
    """|a - b| / |b| (Frobenius)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---- FLOPs and dot peaks (run inside a JAX or torch worker) ---------------------------------------
def forward_flops(cfg, grid_thw) -> float:
    """Analytic FLOPs of one forward on the real rows (2 FLOPs per multiply-add): the package's
    `cost.ideal_flops` over the request's real frames and windows (see its docstring for the
    formula). Qwen2.5-VL-3B on [[1, 36, 36]]: 1705.6 GFLOP."""
    from qwen_vit_jax.plan import segment_lengths
    from qwen_vit_jax.runtime.cost import ideal_flops

    return ideal_flops(cfg, *segment_lengths(grid_thw, cfg))


PEAK_SHAPES = ((1536, 1280, 5120),)  # [M, K] x [K, N]: the 3B tower's MLP up dot on the 1536-row bucket
PEAK_MODES = ("float32", "bf16_f32acc", "bf16_bf16")  # operands / result: f32/f32, bf16/f32, bf16/bf16


def matmul_peak(payload: dict) -> dict:
    """XLA's dot GFLOP/s under jit on JAX's default device, median of `repeats`, for each
    [M, K] x [K, N] in payload["shapes"] (default PEAK_SHAPES) and each mode: float32 at
    HIGHEST precision ("float32"), bf16 operands with a float32 result via
    preferred_element_type ("bf16_f32acc": what our bf16 mode asks for), bf16 operands and
    result ("bf16_bf16"). Also the square [n, n] matmul of earlier runs (payload["n"]).
    Top-level keys float32 / bf16_f32acc / bf16_bf16: the first shape's numbers."""
    import jax
    import jax.numpy as jnp

    repeats = payload["repeats"]
    shapes = [tuple(s) for s in payload.get("shapes", PEAK_SHAPES)]
    if payload.get("n"):
        shapes.append((payload["n"],) * 3)
    out = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "shapes": {}}
    hi, lo = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT
    modes = {
        "float32": (jnp.float32, hi, jnp.float32),
        "bf16_f32acc": (jnp.bfloat16, lo, jnp.float32),
        "bf16_bf16": (jnp.bfloat16, lo, jnp.bfloat16),
    }
    for m, k, n in shapes:
        res = out["shapes"][f"{m}x{k}x{n}"] = {}
        for name, (dtype, precision, result) in modes.items():
            a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dtype)
            b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
            f = jax.jit(lambda x, y, p=precision, r=result: jnp.dot(x, y, precision=p, preferred_element_type=r))
            f(a, b).block_until_ready()
            times = time_calls(lambda *xs: jax.block_until_ready(xs[0](*xs[1:])), repeats, f, a, b)
            res[name] = 2 * m * k * n / statistics.median(times) / 1e9
    out.update(out["shapes"][f"{shapes[0][0]}x{shapes[0][1]}x{shapes[0][2]}"])
    return out


def torch_matmul_peak(shapes=PEAK_SHAPES, repeats: int = 5) -> dict:
    """torch's (oneDNN / MKL) GFLOP/s on the same shapes, float32 and bfloat16 (torch.mm,
    bf16 result), median of `repeats`; call inside a torch worker."""
    import torch

    out = {}
    for m, k, n in shapes:
        res = out[f"{m}x{k}x{n}"] = {}
        for name, dtype in (("float32", torch.float32), ("bf16_bf16", torch.bfloat16)):
            g = torch.Generator().manual_seed(0)
            a, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
            with torch.no_grad():
                torch.mm(a, b)
                times = time_calls(torch.mm, repeats, a, b)
            res[name] = 2 * m * k * n / statistics.median(times) / 1e9
    return out


# ---- other revisions of the package ---------------------------------------------------------------
def git(*args: str) -> str:
    """`git ARGS` in this repository: its stdout, stripped (CalledProcessError on failure)."""
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def rev_info(rev: str) -> dict:
    """{"rev": rev as given, "hash": its full commit hash, "subject": its subject line}."""
    full, _, subject = git("log", "-1", "--format=%H%n%s", f"{rev}^{{commit}}", "--").partition("\n")
    return {"rev": rev, "hash": full, "subject": subject}


def tree_info() -> dict:
    """The working tree: HEAD's rev_info and whether the package differs from HEAD (uncommitted
    or untracked files under qwen_vit_jax/)."""
    dirty = git("status", "--porcelain", "--", "qwen_vit_jax")
    return {**rev_info("HEAD"), "dirty": bool(dirty)}


def worktree(rev: str) -> pathlib.Path:
    """A detached git worktree of `rev` in the cache, made once and reused (`git worktree add
    --detach -f`): put it first on PYTHONPATH (`rev_env`) and a worker's `import qwen_vit_jax` is
    that revision's package, with its own __pycache__ (numba's too). Named by the full hash, so a
    moving name (HEAD~1, a branch) never finds a stale tree."""
    full = rev_info(rev)["hash"]
    path = cache() / f"worktree-{full[:12]}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        log(f"git worktree {path} at {full}")
        git("worktree", "add", "--detach", "-f", str(path), full)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, check=False)
    if head.stdout.strip() != full or not (path / "qwen_vit_jax" / "__init__.py").is_file():
        raise RuntimeError(f"{path} is not a worktree of {full}: delete it (and `git worktree prune`)")
    return path


def rev_env(tree: str | os.PathLike, env: dict | None = None) -> dict[str, str]:
    """`env` (default os.environ) with `tree` first on PYTHONPATH: a worker started with it imports
    that tree's qwen_vit_jax (the editable install's finder comes after PYTHONPATH)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    return env


WORKERS = {"build": build_checkpoint, "demo": demo_checkpoint, "peak": matmul_peak}  # every suite's
