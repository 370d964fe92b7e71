"""Shared benchmark helpers: worker subprocesses, timing, tables, JSON, FLOPs, matmul peak.

Every bench_*.py is a parent that imports neither torch nor jax: each side runs in a worker
subprocess (`python bench_x.py --worker KIND JSON`) that prints one `RESULT {json}` line.
This module imports only the standard library and numpy at the top, so the EasyDeL venv
(its own jax, no qwen_vit_jax) can run workers of bench_peer.py too.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CACHE = pathlib.Path(os.environ.get("QVJ_BENCH_CACHE", pathlib.Path.home() / ".cache" / "qwen_vit_jax_bench"))
RESULT_TAG = "RESULT "


# ---- worker processes ---------------------------------------------------------------------
def torch_env(threads: int | None = None) -> dict[str, str]:
    """Environment for a torch process: OpenMP threads spin instead of sleeping (this VM
    stalls sleeping OpenMP workers for ~8 ms at times); `threads` pins the thread count."""
    env = dict(os.environ, OMP_WAIT_POLICY="ACTIVE")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_worker(script: str, kind: str, payload: dict, *, env: dict | None = None, python: str = sys.executable) -> dict:
    """Run `python script --worker kind payload` and return the dict its worker printed.
    The worker's stderr (progress, warnings) passes through."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [python, script, "--worker", kind, json.dumps(payload)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-4000:])
        raise RuntimeError(f"worker {kind} of {script} failed (exit {proc.returncode})")
    result = json.loads(lines[-1][len(RESULT_TAG) :])
    log(f"worker {kind}: done in {time.perf_counter() - t0:.1f} s")
    return result


def worker_main(handlers: dict) -> bool:
    """In a worker process (argv: --worker KIND JSON) run handlers[KIND](payload), print its
    result and return True; in the parent return False."""
    if len(sys.argv) != 4 or sys.argv[1] != "--worker":
        return False
    result = handlers[sys.argv[2]](json.loads(sys.argv[3]))
    print(RESULT_TAG + json.dumps(result), flush=True)
    return True


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- timing -------------------------------------------------------------------------------
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


# ---- reporting ----------------------------------------------------------------------------
def fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_info() -> dict:
    cpu, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cpu_flags": sorted(flags & DOT_FLAGS),
        "cpu_flags_all": sorted(flags),
        "lscpu_model": lscpu().get("Model name", "?"),
        "python": platform.python_version(),
    }


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


def lscpu() -> dict[str, str]:
    """`lscpu`'s "key: value" lines ({} where lscpu is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in text.splitlines()) if v}


def machine_line() -> str:
    """One line for a table's caption: lscpu model, cores, the dot-relevant flags, uptime load."""
    info = machine_info()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"CPU: {info['lscpu_model']} ({info['cpu']}), {info['cores']} cores, flags "
        f"{' '.join(info['cpu_flags']) or '-'}; load average {load}"
    )


def default_out(name: str, quick: bool, ext: str = "json") -> pathlib.Path:
    """benchmarks/results/NAME.EXT, or NAME-quick.EXT: quick runs never overwrite real ones."""
    return RESULTS / f"{name}{'-quick' if quick else ''}.{ext}"


def write_json(path: str | os.PathLike, data: dict) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine_info(), **data}, indent=1) + "\n")
    log(f"wrote {path}")
    return path


def versions(*modules: str) -> dict:
    """Installed versions of the given modules (imports them)."""
    import importlib

    return {m: getattr(importlib.import_module(m), "__version__", "?") for m in modules}


# ---- models and checkpoints ----------------------------------------------------------------
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
    if cfg.variant in QWEN3_FAMILY:
        return dataclasses.replace(
            cfg,
            depth=2,
            width=128,
            num_heads=4,
            intermediate_size=256,
            out_dim=64,
            deepstack_layers=(0,) if cfg.deepstack_layers else (),
        )
    if cfg.variant == QWEN2_5_VL:
        return dataclasses.replace(
            cfg, depth=2, width=128, num_heads=4, intermediate_size=256, out_dim=64, fullatt_block_indexes=(1,)
        )
    return dataclasses.replace(cfg, depth=2, width=128, num_heads=16, intermediate_size=512, out_dim=64)


def checkpoint(script: str, variant: str, quick: bool, seed: int = 0) -> dict[str, str]:
    """HF checkpoint (random weights, qwen_vit_jax.hf_reference.build_hf_model, save_pretrained) and our
    conversion of it, built once by a `build` worker of `script` and reused across runs:
    {"hf": dir, "ours": dir}. Delete CACHE (or set QVJ_BENCH_CACHE) to rebuild."""
    root = CACHE / f"{variant}{'-quick' if quick else ''}-seed{seed}"
    dirs = {"hf": str(root / "hf"), "ours": str(root / "ours")}
    if not root.is_dir():
        log(f"building {root} (HF model, save_pretrained, convert)")
        run_worker(
            script, "build", {"variant": variant, "quick": quick, "seed": seed, "root": str(root)}, env=torch_env()
        )
    return dirs


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


def random_pixels(grid_thw, patch_dim: int, seed: int = 0) -> np.ndarray:
    """float32 [sum(t*h*w), patch_dim] standard normal rows (as tests/hf_utils.random_pixels)."""
    n = int(np.prod(np.asarray(grid_thw), axis=1).sum())
    return np.random.default_rng(seed).standard_normal((n, patch_dim), dtype=np.float32)


# ---- FLOPs --------------------------------------------------------------------------------
def forward_flops(cfg, grid_thw) -> float:
    """Analytic FLOPs of one forward on the real rows (2 FLOPs per multiply-add): the package's
    `cost.ideal_flops` over the request's real frames and windows (see its docstring for the
    formula). Qwen2.5-VL-3B on [[1, 36, 36]]: 1705.6 GFLOP."""
    from qwen_vit_jax.plan import segment_lengths
    from qwen_vit_jax.runtime.cost import ideal_flops

    return ideal_flops(cfg, *segment_lengths(grid_thw, cfg))


# ---- dot peaks (run inside a JAX or torch worker) --------------------------------------------
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


# ---- other revisions of the package ----------------------------------------------------------
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
    """A detached git worktree of `rev` under CACHE, made once and reused (`git worktree add
    --detach -f`, as bench_host.py's): put it first on PYTHONPATH (`rev_env`) and a worker's
    `import qwen_vit_jax` is that revision's package, with its own __pycache__ (numba's too).
    Named by the full hash, so a moving name (HEAD~1, a branch) never finds a stale tree."""
    full = rev_info(rev)["hash"]
    path = CACHE / f"worktree-{full[:12]}"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
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
