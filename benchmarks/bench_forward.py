"""Forward time: our VisionEncoder vs HF transformers `model.model.visual`, same random
weights (one HF checkpoint, converted for us), same inputs, one image per call.

  HF    float32 (TF32 off on CUDA), and bfloat16 (= model.to(torch.bfloat16)), attention
        "sdpa"; on CUDA when torch sees a GPU (--device), else CPU with OMP_WAIT_POLICY=ACTIVE.
        Timed: pixels to the device, visual(...), pooler_output to host float32 numpy.
  ours  VisionEncoder.from_pretrained(dtype="float32" | "bfloat16") on JAX's default backend.
        Timed: encode(pixels, grid) (plan, one transfer, the bucket's program, fetch).
        The first call compiles: reported apart, never in the median.

Each (variant, side) runs in its own process, both dtypes in it: torch and JAX never share
one. XLA's dot peaks are measured in another JAX process of the same run, on the 3B tower's
[1536, 1280] x [1280, 5120] MLP dot (and a square --peak-n one): float32, bf16 operands with
float32 accumulation (what our bf16 mode asks for), bf16 -> bf16; torch's float32 and bf16 on
the same shape in the HF process. With --rounds R the processes run R times, alternating
which side goes first (a shared VM's speed drifts); medians are over all rounds' calls.
Reported: median seconds, speed-up vs HF in the same dtype and vs HF's fastest mode, GFLOP/s
of the analytic FLOPs (common.forward_flops), % of the mode's own XLA peak (float32 for
float32, bf16_f32acc for bfloat16), the error vs HF float32, and lscpu's model and flags.

With --against REV: ours at the working tree vs ours at REV (any revision since 958bdcf, the
flat layout before 269ba0d too), no HF unless --with-hf. REV runs from a git worktree under the
bench cache (common.worktree) put first on PYTHONPATH, so its process imports REV's package while
this file's helpers stay the working tree's. Both sides run the same worker through the public
names only: VisionEncoder.from_pretrained(dir, dtype=..., tight_after=1), encode(pixels, grid):
tight_after=1 puts every grid on its tight bucket from the first call (the bucket the default
mode's warmup(tight=True) compiles; older revisions lack that argument). The converted checkpoint
is the working tree's (common.checkpoint); a REV that cannot read it converts the HF directory
with its own convert_checkpoint into a cache directory of its own. Per variant, the two (three)
processes alternate over --rounds; reported: median seconds of each, REV / working tree (> 1:
the working tree is faster) over all rounds and per round, the first call (compile included),
the relative difference of REV's output from the working tree's, the CPU and REV's hash and
subject. JSON: benchmarks/results/forward-against-HASH[-quick].json; no plot. --quick's
2-block towers take milliseconds a call: their ratios show the path works, not a speed.

    python benchmarks/bench_forward.py [--quick] [--variants ...] [--sizes 16,36]
        [--dtypes float32,bfloat16] [--repeats N] [--rounds R] [--device auto|cpu|cuda]
        [--out PATH] [--plot PATH]
    python benchmarks/bench_forward.py --against REV [--with-hf] [--quick] [--variants ...]
        [--sizes 16,36] [--dtypes float32,bfloat16] [--repeats N] [--rounds R] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import shutil
import time

import common
import numpy as np
import plot_forward

VARIANTS = ("qwen2.5-vl-3b", "qwen2-vl-2b", "qwen3-vl-8b")  # the default; also "paddleocr-vl", "glm-4.1v-9b"
PLOT = plot_forward.DEFAULT_PNG
SEED = 0


OWN_PEAK = {"float32": "float32", "bfloat16": "bf16_f32acc"}  # the XLA peak each mode is held to


def merge_round(old: dict | None, new: dict) -> dict:
    """One side's results over rounds: every size's call times pooled, median recomputed;
    the first call and compile seconds of the first round kept."""
    if old is None:
        return new
    for dtype, by_side in new["dtypes"].items():
        for side, r in by_side.items():
            o = old["dtypes"][dtype][side]
            o.setdefault("round_medians", [o["median"]]).append(r["median"])
            o.update(common.summary(o["times"] + r["times"]))
    return old


def merge_peaks(peaks: list[dict]) -> dict:
    """Median over rounds of each shape's and mode's GFLOP/s."""
    import statistics

    shapes = {
        s: {m: statistics.median(p["shapes"][s][m] for p in peaks) for m in common.PEAK_MODES}
        for s in peaks[0]["shapes"]
    }
    return {**peaks[0], "shapes": shapes, **shapes[next(iter(shapes))], "rounds": len(peaks)}


def grid_of(side: int) -> list[list[int]]:
    return [[1, side, side]]


def hf_worker(p: dict) -> dict:
    """HF side, one process: float32 first, then the same model cast to bfloat16."""
    import torch
    from transformers import AutoModelForImageTextToText

    device = p["device"] if p["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    model = AutoModelForImageTextToText.from_pretrained(p["hf"], dtype=torch.float32, attn_implementation="sdpa")
    out = {
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "dtypes": {},
        "versions": common.versions("torch", "transformers"),
        "torch_peak": common.torch_matmul_peak() if device == "cpu" else None,
    }
    for dtype in sorted(p["dtypes"], key=lambda d: d != "float32"):
        visual = model.model.visual.to(device, getattr(torch, dtype)).eval()
        if model.config.model_type == "paddleocr_vl":  # what encode returns: the tower and its projector
            model.model.projector.to(device, getattr(torch, dtype)).eval()
            call = functools.partial(hf_call_projector, model.model, device)
        else:
            call = functools.partial(hf_call, visual, device)
        out["dtypes"][dtype] = time_sizes(call, p, f"hf-{dtype}")
    return out


def hf_call(visual, device: str, px: np.ndarray, g: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        y = visual(torch.from_numpy(px).to(device), grid_thw=torch.from_numpy(g).to(device))
        return y.pooler_output.float().cpu().numpy()


def hf_call_projector(model, device: str, px: np.ndarray, g: np.ndarray) -> np.ndarray:
    """PaddleOCR-VL: get_image_features (tower, then the projector that is our merger) on HF's
    [N, C, p, p] pixels, the pieces concatenated."""
    import torch

    v = model.config.vision_config
    with torch.no_grad():
        x = torch.from_numpy(px).to(device).reshape(len(px), v.num_channels, v.patch_size, v.patch_size)
        y = model.get_image_features(x, torch.from_numpy(g).to(device))
        return torch.cat(list(y.pooler_output)).float().cpu().numpy()


def ours_worker(p: dict) -> dict:
    """Our side, one process: one encoder per dtype."""
    import jax

    import qwen_vit_jax as qvj

    out = {
        "device": str(jax.devices()[0]),
        "dtypes": {},
        "numerics": {},
        "versions": common.versions("jax", "jaxlib", "flax"),
    }
    for dtype in p["dtypes"]:
        enc = qvj.VisionEncoder.from_pretrained(p["ours"], dtype=dtype)
        out["numerics"][dtype] = str(enc.num)  # native_bf16: which bf16 dot path runs here
        out["dtypes"][dtype] = time_sizes(enc.encode, p, f"ours-{dtype}", enc.compile_seconds, enc.warmup)
        del enc
    return out


def encode_worker(p: dict) -> dict:
    """One side of --against, one process, through the public names alone (there since 958bdcf):
    whichever package `import qwen_vit_jax` finds, checked to be p["package"] (the working tree's,
    or REV's worktree first on PYTHONPATH). Reads p["ours"]; when that fails and p["own"] is
    set, converts p["hf"] into p["own"] with this package's convert_checkpoint and reads that."""
    import jax

    import qwen_vit_jax as qvj

    found = pathlib.Path(qvj.__file__).resolve().parent
    if found != pathlib.Path(p["package"]).resolve():
        raise RuntimeError(f"imported qwen_vit_jax from {found}, expected {p['package']}")
    ckpt, fallback = p["ours"], None

    def load(dtype: str):
        return qvj.VisionEncoder.from_pretrained(ckpt, dtype=dtype, tight_after=1)

    try:
        enc = load(p["dtypes"][0])
    except Exception as e:  # any failure to read the shared directory
        if not p.get("own"):
            raise
        enc, fallback = None, f"{type(e).__name__}: {e}"
    if enc is None:  # outside the except: JAX's first use here would chain its logs to the error
        common.log(f"{found} cannot read {ckpt} ({fallback}); its own convert_checkpoint into {p['own']}")
        ckpt = own_checkpoint(qvj.convert_checkpoint, p["hf"], p["own"])
        enc = load(p["dtypes"][0])
    out = {
        "device": str(jax.devices()[0]),
        "package": str(found),
        "checkpoint": ckpt,
        "checkpoint_fallback": fallback,
        "dtypes": {},
        "versions": common.versions("jax", "jaxlib", "flax"),
    }
    for dtype in p["dtypes"]:
        enc = load(dtype) if enc is None else enc
        out["dtypes"][dtype] = time_sizes(enc.encode, p, f"{p['name']}-{dtype}")
        enc = None
    return out


def own_checkpoint(convert, hf: str, own: str) -> str:
    """`own`, written once by convert(hf, ...) (through a temporary directory: atomic)."""
    own_dir = pathlib.Path(own)
    if not own_dir.is_dir():
        tmp = own_dir.with_name(own_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        convert(hf, tmp)
        tmp.rename(own_dir)
    return str(own_dir)


def time_sizes(call, p: dict, name: str, compile_seconds: dict | None = None, warmup=None) -> dict:
    """call(pixels, grid) on each size: a first call (saved to outputs/NAME-SIDE.npy; with
    `compile_seconds`, the encoder's, the compile seconds it added; with `warmup`, the encoder's,
    the grid is then declared a recurring size, warmup([grid], tight=True), which compiles its tight
    bucket untimed), then the timed repeats."""
    res = {}
    for side in p["sizes"]:
        g = np.array(grid_of(side))
        px = common.random_pixels(g, p["patch_dim"], SEED)
        known = dict(compile_seconds or {})
        t0 = time.perf_counter()
        np.save(f"{p['outputs']}/{name}-{side}.npy", call(px, g))
        first = time.perf_counter() - t0
        if warmup is not None:  # ours: the grid recurs; its tight bucket compiles here (untimed)
            warmup([g], tight=True)
        res[side] = {"first": first, **common.summary(common.time_calls(call, p["repeats"], px, g))}
        if compile_seconds is not None:
            res[side]["compile_s"] = sum(s for b, s in compile_seconds.items() if b not in known)
    return res


def rel_err(out_dir: pathlib.Path, name: str, ref: str) -> float | None:
    a, b = out_dir / f"{name}.npy", out_dir / f"{ref}.npy"
    if not (a.exists() and b.exists()):
        return None
    a, b = np.load(a), np.load(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sizes", default="16,36", help="image sides in patches: grid [[1, s, s]]")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of peak / HF / ours processes")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="torch device for HF")
    ap.add_argument("--peak-n", type=int, default=2048, help="side of the square matmul for the peak")
    ap.add_argument("--quick", action="store_true", help="2-block configs, sides 8 and 16, 2 repeats")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/forward[-quick].json)")
    ap.add_argument("--plot", help="PNG path (default: benchmarks/forward.png; quick: in results/)")
    ap.add_argument("--against", metavar="REV", help="ours at the working tree vs ours at git revision REV")
    ap.add_argument("--with-hf", action="store_true", help="with --against: HF's processes too")
    args = ap.parse_args()
    if args.with_hf and not args.against:
        ap.error("--with-hf goes with --against (the default mode always runs HF)")
    variants, dtypes = args.variants.split(","), args.dtypes.split(",")
    sizes = [8, 16] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeats = 2 if args.quick else args.repeats
    if args.against:
        return against(args, variants, dtypes, sizes, repeats)
    out = args.out or common.default_out("forward", args.quick)
    png = args.plot or (common.default_out("forward", True, "png") if args.quick else PLOT)

    peak_payload = {
        "n": 512 if args.quick else args.peak_n,
        "repeats": 5,
        "shapes": [[256, 128, 512]] if args.quick else [list(s) for s in common.PEAK_SHAPES],
    }
    peaks, results, outputs = [], {}, {}
    for rnd in range(args.rounds):
        peaks.append(common.run_worker(__file__, "peak", peak_payload))
        for variant in variants:
            cfg = common.model_config(variant, args.quick)
            dirs = common.checkpoint(__file__, variant, args.quick)
            outputs[variant] = pathlib.Path(dirs["hf"]).parent / "outputs"
            outputs[variant].mkdir(exist_ok=True)
            payload = {
                **dirs,
                "dtypes": dtypes,
                "sizes": sizes,
                "repeats": repeats,
                "patch_dim": cfg.patch_dim,
                "device": args.device,
                "outputs": str(outputs[variant]),
            }
            for impl in ("HF", "ours") if rnd % 2 == 0 else ("ours", "HF"):
                res = (
                    common.run_worker(__file__, "hf", payload, env=common.torch_env())
                    if impl == "HF"
                    else common.run_worker(__file__, "ours", payload)
                )
                results[variant, impl] = merge_round(results.get((variant, impl)), res)
    peak = merge_peaks(peaks)
    torch_peak = next((r.get("torch_peak") for (_, i), r in results.items() if i == "HF"), None)

    records = []
    for (variant, impl), res in results.items():
        cfg = common.model_config(variant, args.quick)
        for dtype, by_side in res["dtypes"].items():
            for side in sizes:
                r = by_side[str(side)]
                flops = common.forward_flops(cfg, grid_of(side))
                records.append(
                    {
                        "variant": variant,
                        "grid_thw": grid_of(side),
                        "patches": side * side,
                        "dtype": dtype,
                        "impl": impl,
                        "seconds": r["median"],
                        "timing": r,
                        "flops": flops,
                        "gflops_per_s": flops / r["median"] / 1e9,
                        "pct_fp32_peak": 100 * flops / r["median"] / 1e9 / peak["float32"],
                        "pct_own_peak": 100 * flops / r["median"] / 1e9 / peak[OWN_PEAK[dtype]],
                        "rel_err_vs_hf_fp32": rel_err(
                            outputs[variant], f"{impl.lower()}-{dtype}-{side}", f"hf-float32-{side}"
                        ),
                    }
                )
    for r in records:
        hf = {
            x["dtype"]: x["seconds"]
            for x in records
            if x["impl"] == "HF" and (x["variant"], x["patches"]) == (r["variant"], r["patches"])
        }
        r["speedup_vs_hf_same_dtype"] = hf[r["dtype"]] / r["seconds"]
        r["speedup_vs_hf_fastest"] = min(hf.values()) / r["seconds"]
    records.sort(key=lambda r: (variants.index(r["variant"]), r["patches"], dtypes.index(r["dtype"]), r["impl"]))

    hf_dev = next(res["device"] for (_, impl), res in results.items() if impl == "HF")
    jax_dev = next(res["device"] for (_, impl), res in results.items() if impl == "ours")
    numerics = next((r["numerics"] for (_, i), r in results.items() if i == "ours"), {})
    print(f"{common.machine_line()}\n")
    print(
        f"Forward, median of {repeats} calls x {args.rounds} round(s). HF on {hf_dev}, ours on {jax_dev} "
        f"({'; '.join(numerics.values())}).\n"
    )
    print("Dot peaks, GFLOP/s (median over rounds; XLA: jit jnp.dot, torch: torch.mm):\n")
    print(
        common.markdown_table(
            ["[M,K]x[K,N]", "XLA float32", "XLA bf16 in / f32 acc", "XLA bf16 -> bf16", "torch float32", "torch bf16"],
            [
                [
                    shape,
                    *(f"{v[m]:.0f}" for m in common.PEAK_MODES),
                    *(
                        f"{torch_peak[shape][m]:.0f}" if torch_peak and shape in torch_peak else "-"
                        for m in ("float32", "bf16_bf16")
                    ),
                ]
                for shape, v in peak["shapes"].items()
            ],
        )
        + "\n"
    )
    headers = [
        "variant",
        "patches",
        "dtype",
        "impl",
        "seconds",
        "vs HF same dtype",
        "vs HF fastest",
        "GFLOP/s",
        "% own XLA peak",
        "% fp32 peak",
        "rel err vs HF fp32",
        "compile s",
    ]
    print(
        common.markdown_table(
            headers,
            [
                [
                    r["variant"],
                    r["patches"],
                    r["dtype"],
                    r["impl"],
                    common.fmt_seconds(r["seconds"]),
                    f"{r['speedup_vs_hf_same_dtype']:.2f}x",
                    f"{r['speedup_vs_hf_fastest']:.2f}x",
                    f"{r['gflops_per_s']:.3g}",
                    f"{r['pct_own_peak']:.0f}%",
                    f"{r['pct_fp32_peak']:.0f}%",
                    "-" if r["rel_err_vs_hf_fp32"] is None else f"{r['rel_err_vs_hf_fp32']:.1e}",
                    f"{r['timing']['compile_s']:.1f}" if "compile_s" in r["timing"] else "-",
                ]
                for r in records
            ],
        )
    )
    versions = {k: v for res in results.values() for k, v in res["versions"].items()}
    written = common.write_json(
        out,
        {
            "bench": "forward",
            "quick": args.quick,
            "repeats": repeats,
            "rounds": args.rounds,
            "peak": peak,
            "peaks": peaks,
            "torch_peak": torch_peak,
            "numerics": numerics,
            "hf_device": hf_dev,
            "jax_device": jax_dev,
            "versions": versions,
            "records": records,
        },
    )
    try:  # the same picture as `python benchmarks/plot_forward.py JSON -o PNG` draws from the file
        common.log(f"wrote {plot_forward.plot(json.loads(written.read_text()), pathlib.Path(png))}")
    except ImportError:
        common.log("matplotlib is not installed: no plot (benchmarks/plot_forward.py draws it later)")


def against(args, variants: list[str], dtypes: list[str], sizes: list[int], repeats: int) -> None:
    """--against REV: the working tree's encoder vs REV's, alternating processes (see the module
    docstring); prints the table, writes the JSON."""
    rev, tree = common.rev_info(args.against), common.tree_info()
    short = rev["hash"][:12]
    rev_tree = common.worktree(rev["hash"])
    impls = {  # name -> (worker kind, env, package dir, outputs prefix)
        "tree": ("encode", None, common.ROOT / "qwen_vit_jax", "tree"),
        "REV": ("encode", common.rev_env(rev_tree), rev_tree / "qwen_vit_jax", f"rev-{short}"),
    }
    if args.with_hf:
        impls["HF"] = ("hf", common.torch_env(), None, "hf")
    common.log(f"against {rev['hash']} {rev['subject']!r} (worktree {rev_tree})")
    results, outputs = {}, {}
    for rnd in range(args.rounds):
        for variant in variants:
            cfg = common.model_config(variant, args.quick)
            dirs = common.checkpoint(__file__, variant, args.quick)
            outputs[variant] = pathlib.Path(dirs["hf"]).parent / "outputs"
            outputs[variant].mkdir(exist_ok=True)
            payload = {
                **dirs,
                "dtypes": dtypes,
                "sizes": sizes,
                "repeats": repeats,
                "patch_dim": cfg.patch_dim,
                "device": args.device,
                "outputs": str(outputs[variant]),
            }
            order = list(impls) if rnd % 2 == 0 else list(impls)[::-1]
            for impl in order:
                kind, env, package, name = impls[impl]
                p = dict(payload, package=str(package), name=name)
                if impl == "REV":  # where REV converts for itself if it cannot read the shared directory
                    p["own"] = str(pathlib.Path(dirs["ours"]).parent / f"ours-rev-{short}")
                res = common.run_worker(__file__, kind, p, env=env)
                results[variant, impl] = merge_round(results.get((variant, impl)), res)

    records = []
    for variant in variants:
        for dtype in dtypes:
            for side in sizes:
                t, r = (results[variant, i]["dtypes"][dtype][str(side)] for i in ("tree", "REV"))
                rec = {
                    "variant": variant,
                    "grid_thw": grid_of(side),
                    "patches": side * side,
                    "dtype": dtype,
                    "tree_seconds": t["median"],
                    "rev_seconds": r["median"],
                    "ratio_rev_over_tree": r["median"] / t["median"],
                    "round_ratios": [
                        b / a
                        for a, b in zip(t.get("round_medians", [t["median"]]), r.get("round_medians", [r["median"]]))
                    ],
                    "tree_first_s": t["first"],
                    "rev_first_s": r["first"],
                    "rel_diff_rev_vs_tree": rel_err(
                        outputs[variant], f"rev-{short}-{dtype}-{side}", f"tree-{dtype}-{side}"
                    ),
                    "tree_timing": t,
                    "rev_timing": r,
                }
                if args.with_hf:
                    h = results[variant, "HF"]["dtypes"][dtype][str(side)]
                    rec.update(
                        hf_seconds=h["median"],
                        tree_speedup_vs_hf=h["median"] / t["median"],
                        rev_speedup_vs_hf=h["median"] / r["median"],
                        hf_timing=h,
                    )
                records.append(rec)

    jax_dev = results[variants[0], "tree"]["device"]
    checkpoints = {
        v: {"checkpoint": results[v, "REV"]["checkpoint"], "fallback": results[v, "REV"]["checkpoint_fallback"]}
        for v in variants
    }
    print(f"{common.machine_line()}\n")
    print(
        f"Forward, ours at the working tree (HEAD {tree['hash'][:12]}"
        f"{' + uncommitted changes' if tree['dirty'] else ''}) vs ours at REV = {rev['hash']} {rev['subject']!r}.\n"
        f"Median of {repeats} calls x {args.rounds} round(s) on {jax_dev}, encode through the public names, "
        "tight_after=1; REV / tree > 1: the working tree is faster."
    )
    for v, c in checkpoints.items():
        if c["fallback"]:
            print(f"{v}: REV could not read the shared checkpoint ({c['fallback']}); it converted its own.")
    print()
    headers = ["variant", "patches", "dtype", "tree", f"REV {short[:7]}", "REV / tree", "per round"]
    headers += ["first call tree / REV", "rel diff REV vs tree"]
    if args.with_hf:
        headers += ["HF", "tree vs HF", "REV vs HF"]
    rows = []
    for r in records:
        rel = r["rel_diff_rev_vs_tree"]
        row = [
            r["variant"],
            r["patches"],
            r["dtype"],
            common.fmt_seconds(r["tree_seconds"]),
            common.fmt_seconds(r["rev_seconds"]),
            f"{r['ratio_rev_over_tree']:.2f}",
            " ".join(f"{x:.2f}" for x in r["round_ratios"]),
            f"{common.fmt_seconds(r['tree_first_s'])} / {common.fmt_seconds(r['rev_first_s'])}",
            "-" if rel is None else f"{rel:.1e}",
        ]
        if args.with_hf:
            row += [
                common.fmt_seconds(r["hf_seconds"]),
                f"{r['tree_speedup_vs_hf']:.2f}x",
                f"{r['rev_speedup_vs_hf']:.2f}x",
            ]
        rows.append(row)
    print(common.markdown_table(headers, rows))
    common.write_json(
        args.out or common.default_out(f"forward-against-{short[:7]}", args.quick),
        {
            "bench": "forward-against",
            "quick": args.quick,
            "repeats": repeats,
            "rounds": args.rounds,
            "against": rev,
            "working_tree": tree,
            "worktree": str(rev_tree),
            "jax_device": jax_dev,
            "checkpoints": checkpoints,
            "versions": {k: v for res in results.values() for k, v in res["versions"].items()},
            "records": records,
        },
    )


if __name__ == "__main__" and not common.worker_main(
    {
        "hf": hf_worker,
        "ours": ours_worker,
        "encode": encode_worker,
        "peak": common.matmul_peak,
        "build": common.build_checkpoint,
    }
):
    main()
