"""The device check: HF (sdpa, and flash-attention-2 where it imports) vs ours (the XLA schedule
and the platform's Pallas kernel) on the accelerator at hand, bf16 and fp32, one table.

Cases (Qwen2.5-VL-3B, random weights): one 36x36-patch image (1296 patches), a 10-frame 36x36
video ([[10, 36, 36]], 12960 patches), and a request that fills the largest bucket
([[16, 32, 32]], 16384 patches). Per case and side: the first call (ours: the bucket's compile),
the median of --repeats timed calls, and peak device memory. Sides run in separate processes
(torch and JAX never share the device). On a TPU there is no HF side (torch does not run there).

    python -m benchmarks device [--quick] [--repeats N] [--dtypes bfloat16,float32]
        [--sides hf-sdpa,hf-fa2,ours-xla,ours-kernel]

--quick: the 2-block tower and small cases, for a dry run on a CPU (the kernel side then runs in
Pallas' interpreter; --quick on a CPU leaves it out: the interpreter takes minutes).
benchmarks/gpu_check.sh and tpu_check.sh call this.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks import common

VARIANT = "qwen2.5-vl-3b"
CASES = {"image 36x36": [[1, 36, 36]], "video 10x36x36": [[10, 36, 36]], "largest 16x32x32": [[16, 32, 32]]}
QUICK_CASES = {"image 8x8": [[1, 8, 8]], "video 3x8x8": [[3, 8, 8]]}
SIDES = ("hf-sdpa", "hf-fa2", "ours-xla", "ours-kernel")
DEFAULTS = {"repeats": (5, 1)}


def add_args(p) -> None:
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--sides", help=f"default {','.join(SIDES)} (--quick: hf-sdpa,ours-xla)")


def _time(call, repeats: int, sync) -> tuple[float, float]:
    """(first call s, median of `repeats` further calls s), each call synchronised by sync()."""
    t0 = time.perf_counter()
    sync(call())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(call())
        times.append(time.perf_counter() - t0)
    return first, float(np.median(times))


def run_hf(p: dict) -> dict:
    """Worker: HF's tower on the torch device (cuda if present), one attention implementation."""
    import torch

    from qwen_vit_jax.tools.hf_reference import load_hf_vision_tower

    if p["side"] == "hf-fa2":
        try:
            import flash_attn  # noqa: F401
        except ImportError as e:
            return {"skipped": f"flash-attn not installed ({e})"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tower = load_hf_vision_tower(p["hf"]).to(device=device, dtype=getattr(torch, p["dtype"]))
    tower.config._attn_implementation = "flash_attention_2" if p["side"] == "hf-fa2" else "sdpa"
    out = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}

    def sync(_):
        if device == "cuda":
            torch.cuda.synchronize()

    for name, grid in p["cases"].items():
        px = torch.from_numpy(common.random_pixels(grid, p["patch_dim"])).to(device=device, dtype=tower.dtype)
        thw = torch.tensor(grid, device=device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            first, median = _time(lambda px=px, thw=thw: tower(px, grid_thw=thw), p["repeats"], sync)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        out[name] = {"first_s": first, "median_s": median, "peak_bytes": peak}
    return out


def run_ours(p: dict) -> dict:
    """Worker: our encoder on JAX's default device, the XLA schedule or the platform's kernel."""
    import jax

    import qwen_vit_jax as qvj

    device = jax.devices()[0]
    attention = "xla" if p["side"] == "ours-xla" else ("kernel" if device.platform != "cpu" else "triton")
    enc = qvj.VisionEncoder.from_pretrained(p["ours"], dtype=p["dtype"], attention=attention, tight_after=None)
    out = {"device": device.device_kind}
    for name, grid in p["cases"].items():
        px = common.random_pixels(grid, enc.cfg.patch_dim)
        t0 = time.perf_counter()
        enc.warmup([np.array(grid)])
        compile_s = time.perf_counter() - t0
        first, median = _time(lambda px=px, grid=grid: enc.encode(px, np.array(grid)), p["repeats"], lambda _: None)
        stats = device.memory_stats() or {}
        out[name] = {
            "compile_s": compile_s,
            "first_s": first,
            "median_s": median,
            "peak_bytes": stats.get("peak_bytes_in_use", 0),
        }
    return out


def run(args) -> dict:
    ckpt = common.checkpoint(VARIANT, args.quick)
    cases = QUICK_CASES if args.quick else CASES
    dtypes = "float32" if args.quick else args.dtypes
    sides = args.sides or ("hf-sdpa,ours-xla" if args.quick else ",".join(SIDES))
    patch_dim = common.model_config(VARIANT, args.quick).patch_dim
    runs = {}
    for dtype in dtypes.split(","):
        for side in sides.split(","):
            payload = {**ckpt, "side": side, "dtype": dtype, "cases": cases, "repeats": args.repeats}
            kind = "hf" if side.startswith("hf") else "ours"
            try:
                p = payload | {"patch_dim": patch_dim}
                runs[f"{side} {dtype}"] = common.run_worker(
                    __name__, kind, p, env=common.torch_env() if kind == "hf" else None
                )
            except RuntimeError as e:
                runs[f"{side} {dtype}"] = {"skipped": str(e)}
    return {"cases": cases, "runs": runs}


def report(result: dict) -> str:
    d, rows = result["data"], []
    for name, r in d["runs"].items():
        side, dtype = name.rsplit(" ", 1)
        for case in d["cases"]:
            if "skipped" in r:
                rows.append([dtype, side, case, "-", "-", "-", r["skipped"][:60]])
                continue
            c = r[case]
            rows.append(
                [dtype, side, case, f"{c['compile_s']:.2f}" if "compile_s" in c else "-", f"{c['first_s']:.3f}"]
                + [f"{c['median_s'] * 1e3:.1f}", f"{c['peak_bytes'] / 2**20:,.0f}" if c["peak_bytes"] else "-"]
            )
    devices = {r.get("device") for r in d["runs"].values() if "device" in r}
    return f"On {', '.join(sorted(devices))}:\n\n" + common.markdown_table(
        ["dtype", "side", "case", "compile s", "first s", "median ms", "peak MiB"], rows
    )


WORKERS = {"hf": run_hf, "ours": run_ours}
