"""Load time and peak RSS of the real Qwen2.5-VL-3B tower: straight from the HF checkpoint
directory (converted in memory, weights/sources.py) vs from our converted directory.

The checkpoint is common.checkpoint's: HF's own model of the preset (real vision tower, random
weights, a tiny text model), written by `save_pretrained` in float32, and our conversion of it
(built once, cached under QVJ_BENCH_CACHE). Each measurement is a fresh `load` worker process:
import jax and qwen_vit_jax, read VmRSS (the baseline), then `qvj.load_model(source, dtype)` until
every parameter is on the device, and report the seconds and the process's peak RSS (VmHWM) minus
the baseline. Sources alternate (converted, HF, converted, ...) so a noisy neighbour hits both.
Also timed once: `convert_checkpoint` itself (what direct loading saves, plus its disk copy).
Files are in the page cache after the first run: this measures parsing, conversion and copies,
not the disk. --quick: the 2-block tower, one process per row (RSS figures then mean nothing).
"""

from __future__ import annotations

import pathlib
import shutil
import statistics
import tempfile
import time

from benchmarks import common

PRESET = "qwen2.5-vl-3b"
MiB = 1 << 20
DEFAULTS = {"repeats": (3, 1)}


def add_args(p) -> None:
    p.add_argument("--dtypes", default="float32,bfloat16")


def _status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def load_worker(p: dict) -> dict:
    """Worker: seconds and peak RSS above the baseline of one load_model."""
    import jax
    from flax import nnx

    import qwen_vit_jax as qvj
    from qwen_vit_jax.model import vit as _  # noqa: F401 (import cost outside the timing)
    from qwen_vit_jax.weights import sources as _s  # noqa: F401

    jax.devices()
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    model = qvj.load_model(p["source"], dtype=p["dtype"])
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "peak_above_base": (_status_kib("VmHWM") - base) * 1024,
        "steady_above_base": (_status_kib("VmRSS") - base) * 1024,
        "param_bytes": sum(v.nbytes for v in jax.tree.leaves(nnx.state(model))),
    }


def convert_worker(p: dict) -> dict:
    import qwen_vit_jax as qvj

    out = pathlib.Path(tempfile.mkdtemp(prefix="qvj_bench_load_")) / "ours"
    try:
        t0 = time.perf_counter()
        qvj.convert_checkpoint(p["hf"], out)
        return {"seconds": time.perf_counter() - t0}
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def run(args) -> dict:
    dirs = common.checkpoint(PRESET, args.quick)
    rows = []
    for dtype in args.dtypes.split(","):
        runs = {"ours": [], "hf": []}
        for i in range(args.repeats):
            for kind in runs:
                r = common.run_worker(__name__, "load", {"source": dirs[kind], "dtype": dtype})
                runs[kind].append(r)
                common.log(f"{dtype} {kind} #{i}: {r['seconds']:.2f} s, peak +{r['peak_above_base'] / MiB:,.0f} MiB")
        for kind, rs in runs.items():
            rows.append(
                {"dtype": dtype, "source": kind, "seconds": [r["seconds"] for r in rs]}
                | {"peak_above_base": statistics.median(r["peak_above_base"] for r in rs)}
                | {"param_bytes": rs[0]["param_bytes"]}
            )
    convert_s = common.run_worker(__name__, "convert", {"hf": dirs["hf"]})["seconds"]
    return {"tower": PRESET, "repeats": args.repeats, "convert_s": convert_s, "rows": rows}


def report(result: dict) -> str:
    d = result["data"]
    rows = [
        [r["dtype"], "HF dir (converted in memory)" if r["source"] == "hf" else "converted dir"]
        + [", ".join(f"{x:.2f}" for x in r["seconds"]), f"{r['peak_above_base'] / MiB:,.0f}"]
        + [f"{r['param_bytes'] / MiB:,.0f}"]
        for r in d["rows"]
    ]
    heads = ["dtype", "source", "load s (each process)", "peak RSS above base, MiB", "params on device, MiB"]
    return (
        f"The {d['tower']} tower loaded by `qvj.load_model` in fresh processes, sources alternating; peak RSS "
        f"above the RSS after importing jax; `convert_checkpoint` itself: {d['convert_s']:.1f} s.\n\n"
        + common.markdown_table(heads, rows)
    )


WORKERS = {"load": load_worker, "convert": convert_worker}
