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
subject. Its result: results/forward-against-HASH.json (--label); no plot.

--quick: the first variant's 2-block tower, one 8x8 image, float32, 2 calls. The plot (--plot, matplotlib) is
forward time vs patches, one panel per tower: `plot(result, path)` redraws it from any stored result.
"""

from __future__ import annotations

import functools
import pathlib
import shutil
import statistics
import time

import numpy as np

from benchmarks import common

VARIANTS = ("qwen2.5-vl-3b", "qwen2-vl-2b", "qwen3-vl-8b")  # the default; also "paddleocr-vl", "glm-4.1v-9b"
PLOT = common.ROOT / "benchmarks" / "forward.png"  # the page shows it
SEED = 0
OWN_PEAK = {"float32": "float32", "bfloat16": "bf16_f32acc"}  # the XLA peak each mode is held to
DEFAULTS = {"repeats": (3, 2), "rounds": (1, 1)}
AGAINST = "ours at the working tree vs ours at this revision (no HF unless --with-hf)"


def add_args(p) -> None:
    p.add_argument("--variants", help=f"towers (default {','.join(VARIANTS)}; --quick: the first)")
    p.add_argument("--sizes", help="image sides in patches: grid [[1, s, s]] (default 16,36; --quick 8)")
    p.add_argument("--dtypes", help="default float32,bfloat16 (--quick float32)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="torch device for HF")
    p.add_argument("--peak-n", type=int, default=2048, help="side of the square matmul for the peak")
    p.add_argument("--with-hf", action="store_true", help="with --against: HF's processes too")
    p.add_argument("--plot", type=pathlib.Path, help=f"draw the figure here (default {PLOT.name} unless --quick)")


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
        "torch_peak": common.torch_matmul_peak(p["peak_shapes"]) if device == "cpu" else None,
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
    }
    for dtype in p["dtypes"]:
        enc = qvj.VisionEncoder.from_pretrained(p["ours"], dtype=dtype)
        out["numerics"][dtype] = "native bf16 dots" if enc.num.native_bf16 else "f32 dots of bf16-rounded operands"
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
    return common.rel_diff(np.load(a), np.load(b)) if a.exists() and b.exists() else None


def sides(args) -> tuple[list[str], list[int], list[str]]:
    variants = (args.variants or (VARIANTS[0] if args.quick else ",".join(VARIANTS))).split(",")
    sizes = [int(s) for s in (args.sizes or ("8" if args.quick else "16,36")).split(",")]
    return variants, sizes, (args.dtypes or ("float32" if args.quick else "float32,bfloat16")).split(",")


def rounds_of(args, variants, sizes, dtypes, impls: dict, extra) -> tuple[dict, dict]:
    """Every variant's checkpoint, then `args.rounds` rounds of one process per impl (name -> (worker
    kind, env)), the order reversed every other round; extra(impl, payload) adds to a payload.
    -> ({(variant, impl): merged result}, {variant: its outputs folder})."""
    results, outputs = {}, {}
    for rnd in range(args.rounds):
        for variant in variants:
            dirs = common.checkpoint(variant, args.quick)
            outputs[variant] = pathlib.Path(dirs["hf"]).parent / "outputs"
            outputs[variant].mkdir(exist_ok=True)
            payload = {
                **dirs,
                "dtypes": dtypes,
                "sizes": sizes,
                "repeats": args.repeats,
                "patch_dim": common.model_config(variant, args.quick).patch_dim,
                "device": args.device,
                "outputs": str(outputs[variant]),
                "peak_shapes": [[256, 128, 512]] if args.quick else [list(x) for x in common.PEAK_SHAPES],
            }
            for impl in list(impls) if rnd % 2 == 0 else list(impls)[::-1]:
                kind, env = impls[impl]
                res = common.run_worker(__name__, kind, extra(impl, dict(payload)), env=env)
                results[variant, impl] = merge_round(results.get((variant, impl)), res)
    return results, outputs


def run(args) -> dict:
    if args.against:
        return against(args)
    if args.with_hf:
        raise SystemExit("--with-hf goes with --against (the default mode always runs HF)")
    variants, sizes, dtypes = sides(args)
    peak_payload = {
        "n": 512 if args.quick else args.peak_n,
        "repeats": 2 if args.quick else 5,
        "shapes": [[256, 128, 512]] if args.quick else [list(s) for s in common.PEAK_SHAPES],
    }
    peaks = [common.run_worker("common", "peak", peak_payload) for _ in range(args.rounds)]
    impls = {"HF": ("hf", common.torch_env()), "ours": ("ours", None)}
    results, outputs = rounds_of(args, variants, sizes, dtypes, impls, lambda _, p: p)
    peak = merge_peaks(peaks)
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
                        "patches": side * side,
                        "dtype": dtype,
                        "impl": impl,
                        "seconds": r["median"],
                        "round_medians": r.get("round_medians", [r["median"]]),
                        "first_s": r["first"],
                        "compile_s": r.get("compile_s"),
                        "flops": flops,
                        "pct_own_peak": 100 * flops / r["median"] / 1e9 / peak[OWN_PEAK[dtype]],
                        "rel_err_vs_hf_fp32": rel_err(
                            outputs[variant], f"{impl.lower()}-{dtype}-{side}", f"hf-float32-{side}"
                        ),
                    }
                )
    records.sort(key=lambda r: (variants.index(r["variant"]), r["patches"], dtypes.index(r["dtype"]), r["impl"]))
    hf = {(r["variant"], r["patches"], r["dtype"]): r for r in records if r["impl"] == "HF"}
    for r in records:  # HF / ours per round (the rounds alternate which side goes first)
        h = hf[r["variant"], r["patches"], r["dtype"]]
        r["vs_hf"], r["vs_hf_rounds"] = (
            h["seconds"] / r["seconds"],
            [a / b for a, b in zip(h["round_medians"], r["round_medians"])],
        )
    hf_run = next(res for (_, impl), res in results.items() if impl == "HF")
    ours_run = next(res for (_, impl), res in results.items() if impl == "ours")
    data = {
        "mode": "vs HF",
        "repeats": args.repeats,
        "rounds": args.rounds,
        "peak": peak,
        "torch_peak": hf_run.get("torch_peak"),
        "numerics": ours_run["numerics"].get("bfloat16"),
        "hf_device": hf_run["device"],
        "jax_device": ours_run["device"],
        "records": records,
    }
    png = args.plot or (None if args.quick else PLOT)
    if png is not None:
        try:  # the figure of this run; plot() redraws it from the stored result
            common.log(f"wrote {plot({'data': data, 'machine': common.machine(), 'date': common.now()}, png)}")
        except ImportError:
            common.log("matplotlib is not installed: no plot")
    return data


def against(args) -> dict:
    """--against REV: the working tree's encoder vs REV's, alternating processes (see the module
    docstring)."""
    variants, sizes, dtypes = sides(args)
    rev = common.rev_info(args.against)
    short = rev["hash"][:12]
    args.label = args.label or f"against-{short[:7]}"
    rev_tree = common.worktree(rev["hash"])
    impls = {"tree": ("encode", None), "REV": ("encode", common.rev_env(rev_tree))}
    packages = {"tree": common.ROOT / "qwen_vit_jax", "REV": rev_tree / "qwen_vit_jax"}
    if args.with_hf:
        impls["HF"] = ("hf", common.torch_env())
    common.log(f"against {rev['hash']} {rev['subject']!r} (worktree {rev_tree})")

    def extra(impl: str, p: dict) -> dict:
        p.update(package=str(packages.get(impl)), name={"tree": "tree", "REV": f"rev-{short}", "HF": "hf"}[impl])
        if impl == "REV":  # where REV converts for itself if it cannot read the shared directory
            p["own"] = str(pathlib.Path(p["ours"]).parent / f"ours-rev-{short}")
        return p

    results, outputs = rounds_of(args, variants, sizes, dtypes, impls, extra)
    records = []
    for variant in variants:
        for dtype in dtypes:
            for side in sizes:
                t, r = (results[variant, i]["dtypes"][dtype][str(side)] for i in ("tree", "REV"))
                rec = {
                    "variant": variant,
                    "patches": side * side,
                    "dtype": dtype,
                    "tree_seconds": t["median"],
                    "rev_seconds": r["median"],
                    "round_ratios": [
                        b / a
                        for a, b in zip(t.get("round_medians", [t["median"]]), r.get("round_medians", [r["median"]]))
                    ],
                    "tree_first_s": t["first"],
                    "rev_first_s": r["first"],
                    "rel_diff_rev_vs_tree": rel_err(
                        outputs[variant], f"rev-{short}-{dtype}-{side}", f"tree-{dtype}-{side}"
                    ),
                }
                if args.with_hf:
                    rec["hf_seconds"] = results[variant, "HF"]["dtypes"][dtype][str(side)]["median"]
                records.append(rec)
    fallback = {v: results[v, "REV"]["checkpoint_fallback"] for v in variants}
    return {
        "mode": "against",
        "repeats": args.repeats,
        "rounds": args.rounds,
        "against": rev,
        "jax_device": results[variants[0], "tree"]["device"],
        "checkpoint_fallback": {v: f for v, f in fallback.items() if f},
        "records": records,
    }


def report(result: dict) -> str:
    d = result["data"]
    if d["mode"] == "against":
        return report_against(d)
    fmt, peak, torch_peak = common.fmt_seconds, d["peak"], d.get("torch_peak") or {}
    rows = []
    for shape, v in peak["shapes"].items():
        t = torch_peak.get(shape, {})
        rows.append([shape, *(f"{v[m]:.0f}" if v.get(m) else "-" for m in common.PEAK_MODES)])
        rows[-1] += [f"{t[m]:.0f}" if m in t else "-" for m in ("float32", "bf16_bf16")]
    heads = [
        "[M,K]x[K,N]",
        "XLA float32",
        "XLA bf16 in, f32 out (our bf16)",
        "XLA bf16 -> bf16",
        "torch fp32",
        "torch bf16",
    ]
    text = (
        f"HF `model.visual` (sdpa) on {d['hf_device']} and ours on {d['jax_device']}"
        + (f" (bf16: {d['numerics']})" if d.get("numerics") else "")
        + ", random weights, one [1, s, s] image, ours on its tight bucket; sides in processes of their own, "
        f"alternating; medians of {d['repeats']} calls x {d['rounds']} round(s); vs HF > 1: ours faster; % own peak: "
        "ours' analytic GFLOP/s over XLA's dot peak in the same mode; rel err: ours vs HF float32. Dot peaks of the "
        "same run, GFLOP/s:"
        f"\n\n{common.markdown_table(heads, rows)}\n\n"
    )
    by = {(r["variant"], r["patches"], r["dtype"], r["impl"]): r for r in d["records"]}
    dtypes = list(dict.fromkeys(r["dtype"] for r in d["records"]))
    heads, rows = ["tower", "patches"], []
    for dt in dtypes:
        heads += [f"HF {dt}", f"ours {dt}", "vs HF (per round)", "% own peak", "rel err"]
    for variant, patches in dict.fromkeys((r["variant"], r["patches"]) for r in d["records"]):
        row = [variant, patches]
        for dt in dtypes:
            hf, ours = by[variant, patches, dt, "HF"], by[variant, patches, dt, "ours"]
            rounds = ours.get("vs_hf_rounds") or []
            per = f" ({', '.join(f'{x:.2f}' for x in rounds)})" if len(rounds) > 1 else ""
            err, pct = ours.get("rel_err_vs_hf_fp32"), ours.get("pct_own_peak")
            vs = ours.get("vs_hf") or hf["seconds"] / ours["seconds"]  # a transcribed run: its ratio of unrounded times
            row += [fmt(hf["seconds"]), fmt(ours["seconds"]), f"**{vs:.2f}x**{per}"]
            row += ["-" if pct is None else f"{pct:.0f}%", "-" if err is None else f"{err:.1e}"]
        rows.append(row)
    text += common.markdown_table(heads, rows)
    if d.get("plot"):
        text += f"\n\n![forward time vs patches]({d['plot']})"
    return text


def report_against(d: dict) -> str:
    rev, fmt = d["against"], common.fmt_seconds
    heads = [
        "tower",
        "patches",
        "dtype",
        "tree",
        f"{rev['hash'][:7]}",
        "REV / tree",
        "per round",
        "first call tree / REV",
    ]
    heads += ["rel diff REV vs tree"] + (["HF"] if any("hf_seconds" in r for r in d["records"]) else [])
    rows = []
    for r in d["records"]:
        rel = r["rel_diff_rev_vs_tree"]
        row = [r["variant"], r["patches"], r["dtype"], fmt(r["tree_seconds"]), fmt(r["rev_seconds"])]
        row += [f"**{r['rev_seconds'] / r['tree_seconds']:.2f}**", " ".join(f"{x:.2f}" for x in r["round_ratios"])]
        row += [f"{fmt(r['tree_first_s'])} / {fmt(r['rev_first_s'])}", "-" if rel is None else f"{rel:.1e}"]
        rows.append(row + ([fmt(r["hf_seconds"])] if "hf_seconds" in r else []))
    fell = "".join(
        f" {v}: REV could not read the shared checkpoint ({f}); it converted its own."
        for v, f in d["checkpoint_fallback"].items()
    )
    return (
        f"Ours at the working tree vs ours at {rev['hash'][:7]} ({rev['subject']}), through the public names, "
        f"tight_after=1; medians of {d['repeats']} calls x {d['rounds']} round(s) on {d['jax_device']}; "
        f"REV / tree > 1: the working tree is faster.{fell}\n\n" + common.markdown_table(heads, rows)
    )


def plot(result: dict, path: pathlib.Path) -> pathlib.Path:
    """Draw a stored result's records into `path` (PNG): forward seconds vs patches, one panel per tower,
    ours and HF in each dtype; the title names the CPU, the date and the medians."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d, m = result["data"], result["machine"]
    records = d["records"]
    variants = list(dict.fromkeys(r["variant"] for r in records))
    width = max(5.5 * len(variants), 9.0)  # room for the title's flag line with one panel
    fig, axes = plt.subplots(1, len(variants), figsize=(width, 4.6), squeeze=False)
    for ax, variant in zip(axes[0], variants):
        for impl, color in (("ours", "tab:blue"), ("HF", "tab:orange")):
            for dtype, style in (("float32", "-o"), ("bfloat16", "--s")):
                pts = sorted(
                    (r["patches"], r["seconds"])
                    for r in records
                    if (r["variant"], r["impl"], r["dtype"]) == (variant, impl, dtype)
                )
                if pts:
                    ax.plot(*zip(*pts), style, color=color, label=f"{impl} {dtype}")
        ax.set(title=variant, xlabel="patches per image", ylabel="forward seconds (median)", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    title = (
        f"{common.describe_machine(m)}; {result['date'][:10]}; medians of {d['repeats']} calls x {d['rounds']} round(s)"
    )
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    d["plot"] = path.name if path.parent == PLOT.parent else None
    return path


WORKERS = {"hf": hf_worker, "ours": ours_worker, "encode": encode_worker}
