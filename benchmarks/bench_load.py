"""Load time and peak RSS of the real Qwen2.5-VL-3B tower: straight from the HF checkpoint
directory (converted in memory, weights/sources.py) vs from our converted directory.

    python benchmarks/bench_load.py [--repeats 3] [--dtypes float32,bfloat16]

The checkpoint is common.checkpoint's: HF's own model of the preset (real vision tower, random
weights, a tiny text model), written by `save_pretrained` in float32, and our conversion of it
(built once, cached under QVJ_BENCH_CACHE). Each measurement is a fresh `load` worker process:
import jax and qwen_vit_jax, read VmRSS (the baseline), then `qvj.load_model(source, dtype)` until
every parameter is on the device, and report the seconds and the process's peak RSS (VmHWM) minus
the baseline. Sources alternate (converted, HF, converted, ...) so a noisy neighbour hits both.
Also timed once: `convert_checkpoint` itself (what direct loading saves, plus its disk copy).
Files are in the page cache after the first run: this measures parsing, conversion and copies,
not the disk.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import build_checkpoint, checkpoint, log, machine_line, markdown_table, run_worker, worker_main  # noqa: E402

PRESET = "qwen2.5-vl-3b"
MiB = 1 << 20


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    script = str(pathlib.Path(__file__).resolve())
    dirs = checkpoint(script, PRESET, quick=False)
    results = {}
    for dtype in args.dtypes.split(","):
        for i in range(args.repeats):
            for kind in ("ours", "hf"):
                r = run_worker(script, "load", {"source": dirs[kind], "dtype": dtype})
                results.setdefault((dtype, kind), []).append(r)
                log(f"{dtype} {kind} #{i}: {r['seconds']:.2f} s, peak +{r['peak_above_base'] / MiB:,.0f} MiB")
    convert_s = run_worker(script, "convert", {"hf": dirs["hf"]})["seconds"]
    rows = []
    for (dtype, kind), rs in results.items():
        secs = sorted(r["seconds"] for r in rs)
        peaks = sorted(r["peak_above_base"] / MiB for r in rs)
        rows.append(
            [
                dtype,
                "HF dir (in memory)" if kind == "hf" else "converted dir",
                f"{secs[len(secs) // 2]:.2f} ({secs[0]:.2f}-{secs[-1]:.2f})",
                f"{peaks[len(peaks) // 2]:,.0f}",
                f"{rs[0]['param_bytes'] / MiB:,.0f}",
            ]
        )
    print(machine_line())
    print(f"{PRESET} tower, {args.repeats} fresh processes per row; convert_checkpoint: {convert_s:.1f} s")
    print(
        markdown_table(["dtype", "source", "load s, median (min-max)", "peak RSS above base, MiB", "params, MiB"], rows)
    )


if __name__ == "__main__":
    if not worker_main({"build": build_checkpoint, "load": load_worker, "convert": convert_worker}):
        main()
