"""Host cost per input, stage by stage, on one core: ours (uint8 patches), the code before the feed
work ("before", any git revision), and HF transformers 5.24's image processor on both backends
(PIL, and torchvision in the video-reference venv); then the worker pipeline's images/s and the cores
each accelerator needs.

    python -m benchmarks host                      # everything (builds inputs, tiny + 3B towers)
    python -m benchmarks host --against f88d8b9    # the "before" column from that revision (the default)
    python -m benchmarks host --quick              # small inputs, one repeat, the 2-block towers

Inputs (written once under the bench cache): JPEG photos at 504x504, 1920x1080 and 4032x3024 (scikit-
image's astronaut resized, with sensor-like noise so the JPEG holds a photo's entropy; quality 90,
4:2:0), a 1920x1080 PNG screenshot (flat panels and text-like strokes) and a 720p H.264 clip (10 s,
30 fps) sampled at 2 fps. Preprocessing: HF's class defaults (max_pixels 1,003,520: a 1080p photo is
resized to 728x1316, 4,888 patches), the Qwen2.5-VL tower.

Stages (ms per input, median of --repeats, each worker pinned to one core, one thread):
  read     the file's bytes
  decode   ours: simplejpeg for RGB JPEGs, else Pillow (the same pixels), with the allocator settings
           its workers run with (data/pipeline.py tune_allocator: no page fault per buffer); before
           and HF: Pillow (libjpeg-turbo)
  resize   ours: preprocess/resize.py (Pillow's bits); before and HF's PIL backend: Pillow bicubic;
           HF torchvision: its own resize, inside "pixels"
  pixels   ours: the uint8 patch rows (the float work moved to the device); before and HF: rescale +
           normalise + patchify into float32 rows
  plan     the host plan of the grid (uncached)
  bytes    what goes to the device per input: ours uint8 patches + plan; before float32 rows + plan
A video's row is per sampled frame (decode, resize and patch bytes of the whole clip / its frames).

Pipeline: the loader alone (`qvj.data.load` of 300 1080p JPEGs, each item sent to the CPU device)
with 0, 1 and 2 workers: the first item's latency and the rate after it; `qwen-vit-jax encode` of 480
1080p JPEGs on a host-bound tiny tower (`host_bound_checkpoint`) with --workers 0, 1, 2 (whole runs:
images/s, the share of the run spent waiting for inputs, the outputs compared byte for byte); and the
device-idle share on the real Qwen2.5-VL-3B tower (random weights) with --workers 1. Rounds alternate.
Cores per device: the accelerator's images/s for one input (1 / the roofline of `qwen-vit-jax aot`,
bf16: an estimate, not a measurement) divided by ours host images/s per core.
"""

from __future__ import annotations

import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks import common
from benchmarks.common import log, markdown_table, run_worker, time_calls

PHOTOS = {"504x504": (504, 504), "1920x1080": (1920, 1080), "4032x3024": (4032, 3024)}
BEFORE = "f88d8b9"  # the last commit before the feed work
DEFAULTS = {"repeats": (15, 1)}
AGAINST = f"the revision of the 'before' column (default {BEFORE}; --quick: none)"


def inputs_dir() -> pathlib.Path:
    return common.cache() / "host_inputs"


def add_args(p) -> None:
    p.add_argument(
        "--ref-python",
        default=common.ref_python(),
        help="the video-reference venv's python (benchmarks/video_reference.sh; $VIDEO_REF_PYTHON): HF's "
        "torchvision backend column",
    )


# ---- inputs --------------------------------------------------------------------------------------
def make_inputs(quick: bool = False) -> dict[str, str]:
    """name -> path of every input (written once); quick: the small photo, a small screenshot, a 1 s clip."""
    from PIL import Image, ImageDraw
    from skimage import data as photos

    folder = inputs_dir() / ("quick" if quick else "")
    folder.mkdir(parents=True, exist_ok=True)
    out, rng = {}, np.random.default_rng(0)
    base = Image.fromarray(photos.astronaut())
    for name, (w, h) in list(PHOTOS.items())[:1] if quick else PHOTOS.items():
        path = folder / f"photo_{name}.jpg"
        if not path.exists():
            a = np.asarray(base.resize((w, h), Image.BICUBIC)).astype(np.int16)
            a = np.clip(a + rng.integers(-10, 11, a.shape), 0, 255).astype(np.uint8)  # sensor-like noise
            Image.fromarray(a).save(path, "JPEG", quality=90, subsampling=2)
        out[f"JPEG {name}"] = str(path)
    sw, sh = (640, 360) if quick else (1920, 1080)
    path = folder / f"screenshot_{sw}x{sh}.png"
    if not path.exists():
        im = Image.new("RGB", (sw, sh), (245, 246, 248))
        d = ImageDraw.Draw(im)
        d.rectangle((0, 0, sw, 56), fill=(36, 41, 47))
        d.rectangle((0, 56, 300, sh), fill=(230, 232, 236))
        for y in range(90, sh - 40, 28):  # lines of "text"
            x = 340
            while x < sw - 120:
                n = int(rng.integers(20, 120))
                d.rectangle((x, y, x + n, y + 12), fill=tuple(int(v) for v in rng.integers(20, 90, 3)))
                x += n + int(rng.integers(8, 16))
        im.save(path, "PNG")
    out[f"PNG {sw}x{sh}"] = str(path)
    path = folder / "clip_720p.mp4"
    if not path.exists():
        _write_clip(path, 30 if quick else 300)
    out["720p clip, 2 fps"] = str(path)
    return out


def _write_clip(path: pathlib.Path, frames: int) -> None:
    import av
    from PIL import Image
    from skimage import data as photos

    base = np.asarray(Image.fromarray(photos.coffee()).resize((1400, 860)))
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt, s.options = 1280, 720, "yuv420p", {"crf": "20", "preset": "veryfast"}
        for i in range(frames):  # a slow pan over a photo
            frame = np.ascontiguousarray(base[i // 3 : i // 3 + 720, i // 2 : i // 2 + 1280])
            for packet in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)


# ---- workers: per-stage host costs on one core ---------------------------------------------------
def _median_ms(fn, repeats: int) -> float:
    fn()  # warm (imports, numba, caches)
    return 1e3 * statistics.median(time_calls(fn, repeats))


def stages_ours(p: dict) -> dict:
    """Worker: ours, stage by stage (the working tree's package)."""
    common.one_core()
    from qwen_vit_jax import plan as planlib
    from qwen_vit_jax.data.inputs import load_image
    from qwen_vit_jax.data.pipeline import tune_allocator

    if not common.IN_PROCESS:  # process-wide: as every worker process of the pipeline, never the caller's
        tune_allocator()
    from qwen_vit_jax.preprocess import images as I
    from qwen_vit_jax.preprocess.config import PreprocessConfig, video_config_for
    from qwen_vit_jax.presets import QWEN2_5_VL_3B

    cfg, model = PreprocessConfig(), QWEN2_5_VL_3B

    def video(path: str, r: int) -> dict:
        from qwen_vit_jax.preprocess.video import preprocess_video

        vcfg = video_config_for(None, model.variant)
        patches, grid, _ = preprocess_video(path, config=vcfg, fps=2.0, uint8=True)
        frames = int(grid[0, 0]) * vcfg.temporal_patch_size
        whole = _median_ms(lambda: preprocess_video(path, config=vcfg, fps=2.0, uint8=True), max(2, r // 3))
        rows = len(patches) // int(grid[0, 0])
        out = {"frames": frames, "decode_resize_patch": whole / frames, "loop": whole / frames, "grid": grid.tolist()}
        return out | _plan_and_bytes(planlib, grid, model, patches.nbytes / frames, rows, per=frames)

    def image(name: str, path: str, r: int) -> dict:
        read = _median_ms(lambda: open(path, "rb").read(), r)
        decode = _median_ms(lambda: load_image(path), r)
        a = I.to_hwc3(load_image(path), cfg, name)
        resize = _median_ms(lambda: I.resize(a, cfg), r)
        small = I.resize(a, cfg)
        pixels = _median_ms(lambda: I.patch_bytes(small[None, None], cfg), r)
        rows = I.patch_bytes(small[None, None], cfg)
        floats = _median_ms(lambda: I.patches_of(rows, cfg).to_float(), r)  # HF's rows, if asked for
        grid = np.array([[1, small.shape[0] // 14, small.shape[1] // 14]])

        def whole():  # what a worker does per input, stage after stage
            rows, g = I.image_patches(load_image(path), cfg, model.variant)
            planlib.clear_caches()
            planlib.make_plans(np.array([g]), model)

        out = {"read": read, "decode": decode, "resize": resize, "pixels": pixels, "float_rows": floats}
        out["loop"] = _median_ms(whole, r)
        return out | _plan_and_bytes(planlib, grid, model, rows.nbytes, len(rows))

    r = p["repeats"]
    return {n: video(f, r) if f.endswith(".mp4") else image(n, f, r) for n, f in p["inputs"].items()}


def _plan_and_bytes(planlib, grid, model, pixel_bytes: float, rows: int, per: int = 1) -> dict:
    def plan():
        planlib.clear_caches()
        return planlib.make_plans(grid, model)

    t = _median_ms(plan, 9)
    plan_bytes = sum(
        sum(np.asarray(getattr(q, k)).nbytes for k in planlib.Plan.ARRAYS) for q in planlib.make_plans(grid, model)
    )
    return {
        "plan": t / per,
        "grid": grid.tolist(),
        "bytes_uint8": (pixel_bytes * per + plan_bytes) / per,
        "bytes_float32": (rows * model.patch_dim * 4 + plan_bytes) / per,
    }


def stages_before(p: dict) -> dict:
    """Worker: the package of an earlier revision (PYTHONPATH), the float path it had."""
    common.one_core()
    from qwen_vit_jax import plan as planlib

    try:  # the layout after the house moves
        from qwen_vit_jax.data.encode_files import load_image
        from qwen_vit_jax.preprocess.images import PreprocessConfig, preprocess_images, resize, to_hwc3
        from qwen_vit_jax.presets import QWEN2_5_VL_3B
    except ImportError:  # the flat layout
        from qwen_vit_jax.cli import load_image

        from qwen_vit_jax.config import QWEN2_5_VL_3B
        from qwen_vit_jax.preprocess import PreprocessConfig, preprocess_images
        from qwen_vit_jax.preprocess import _resize as resize
        from qwen_vit_jax.preprocess import _to_hwc3 as to_hwc3

    cfg = PreprocessConfig()

    def image(name: str, path: str, r: int) -> dict:
        read = _median_ms(lambda: open(path, "rb").read(), r)
        decode = _median_ms(lambda: load_image(path), r)
        img = load_image(path)
        both = _median_ms(lambda: preprocess_images([img], config=cfg), r)  # resize + floats
        a = to_hwc3(img, cfg, name)
        resize_ms = _median_ms(lambda: resize(a, cfg), r)
        pv, grid = preprocess_images([img], config=cfg)

        def whole():
            _, g = preprocess_images([load_image(path)], config=cfg)
            planlib.clear_caches()
            planlib.make_plans(g, QWEN2_5_VL_3B)

        out = {"read": read, "decode": decode, "resize": resize_ms, "pixels": max(both - resize_ms, 0.0)}
        out["loop"] = _median_ms(whole, r)
        out |= _plan_and_bytes(planlib, grid, QWEN2_5_VL_3B, pv.nbytes, len(pv))
        out["bytes_uint8"] = out["bytes_float32"]  # it sent float32 rows
        return out

    return {n: image(n, f, p["repeats"]) for n, f in p["inputs"].items() if not f.endswith(".mp4")}


def stages_hf(p: dict) -> dict:
    """Worker: HF transformers' Qwen2-VL image processor, PIL backend or torchvision ("fast")."""
    common.one_core()
    import torch
    from PIL import Image
    from transformers.image_utils import load_image

    if not common.IN_PROCESS:  # the caller's process keeps its threads
        torch.set_num_threads(1)
    import transformers

    if p["backend"] == "pil":
        from transformers import Qwen2VLImageProcessorPil as Processor
    else:
        from transformers import Qwen2VLImageProcessor as Processor  # torchvision when it imports
    proc = Processor()
    tensors = "np" if p["backend"] == "pil" else "pt"

    def image(path: str, r: int) -> dict:
        read = _median_ms(lambda: open(path, "rb").read(), r)
        decode = _median_ms(lambda: load_image(path), r)
        img = load_image(path)
        pre = _median_ms(lambda: proc(images=[img], return_tensors=tensors), r)
        resize = None
        if p["backend"] == "pil":  # its resize alone (the torchvision backend's is inside the call)
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

            h, w = smart_resize(img.height, img.width, 28, proc.size.shortest_edge, proc.size.longest_edge)
            resize = _median_ms(lambda: img.resize((w, h), Image.BICUBIC), r)
        loop = _median_ms(lambda: proc(images=[load_image(path)], return_tensors=tensors), r)
        return {"read": read, "decode": decode, "resize": resize, "pixels": pre - (resize or 0.0), "loop": loop}

    out = {n: image(f, p["repeats"]) for n, f in p["inputs"].items() if not f.endswith(".mp4")}
    return out | {"backend": type(proc).__name__, "transformers": transformers.__version__}


# ---- workers: the pipeline and the accelerators ----------------------------------------------------
def accel(p: dict) -> dict:
    """Worker: the 3B tower's (quick: its 2-block version's) roofline per input on each target
    (deviceless compile, bf16)."""
    from qwen_vit_jax.tools import aot

    cfg = common.model_config("qwen2.5-vl-3b", p["quick"])
    out = {}
    for target in p["targets"]:
        for name, grid in p["grids"].items():
            reports = aot.run(target, cfg, [np.array(grid)], "bfloat16", progress=None)
            out[f"{target}|{name}"] = sum(r.roofline_s for r in reports)
    return out


def loader(p: dict) -> dict:
    """Worker: `qvj.data.load` alone, each item sent to the (CPU) device as a loop would: the first
    item's latency (worker start-up: a spawned process imports Grain, which imports jax) and the
    steady rate after it, per worker count, rounds alternating; medians."""
    import jax

    import qwen_vit_jax as qvj
    from qwen_vit_jax.data.pipeline import tune_allocator

    if not common.IN_PROCESS:  # process-wide: as the CLI, never the caller's
        tune_allocator()
    paths = sorted(str(x) for x in pathlib.Path(p["folder"]).iterdir())
    rates: dict[str, list] = {str(w): [] for w in p["workers"]}
    for _ in range(p["rounds"]):
        for w in p["workers"]:
            t0 = time.perf_counter()
            first, n = None, 0
            with qvj.data.load(paths, preprocessing=qvj.Preprocessing.defaults("qwen2_5_vl"), workers=w) as items:
                for item in items:
                    jax.device_put(item.patches.data).block_until_ready()
                    if first is None:
                        first = time.perf_counter()
                    else:
                        n += 1
            rates[str(w)].append((first - t0, n / (time.perf_counter() - first)))
    return {
        w: {"first_s": statistics.median(a for a, _ in v), "per_s": statistics.median(b for _, b in v)}
        for w, v in rates.items()
    }


def fast_decode(p: dict) -> dict:
    """Worker: `fast_decode` (PIL's JPEG draft) vs the exact decode on scikit-image's photographs
    (saved as JPEG, quality 90), preprocessed to at most 224 x 224 pixels (so that the decoder's
    1/2 scale applies to the larger ones): pixel deviation of the patches and embedding deviation
    through a tower (p["ckpt"], float32, random weights: an indication, not a trained model's)."""
    from PIL import Image
    from skimage import data as photos

    import qwen_vit_jax as qvj
    from qwen_vit_jax.data.inputs import draft_size

    enc = qvj.VisionEncoder.from_pretrained(p["ckpt"])
    prep = enc.preprocessing.with_limits(max_pixels=224 * 224)
    out = {}
    for name in p["photos"]:
        path = inputs_dir() / f"skimage_{name}.jpg"
        if not path.exists():
            Image.fromarray(getattr(photos, name)()).convert("RGB").save(path, "JPEG", quality=90)
        exact, fast = (qvj.data.load([str(path)], preprocessing=prep, workers=0, fast_decode=f) for f in (False, True))
        with exact, fast:
            (a,), (b,) = list(exact), list(fast)
        d = a.patches.data.astype(np.float64) - b.patches.data
        ea, eb = enc.encode(a.patches, a.grid), enc.encode(b.patches, b.grid)
        cos = (ea * eb).sum(1) / np.linalg.norm(ea, axis=1) / np.linalg.norm(eb, axis=1)
        out[name] = {
            "size": list(getattr(photos, name)().shape[:2]),
            "grid": a.grid[0].tolist(),
            "draft": draft_size(str(path), prep.image, enc.cfg.variant) is not None,
            "pixel_mean_abs": float(np.abs(d).mean()),
            "pixel_max_abs": float(np.abs(d).max()),
            "psnr_db": float(10 * np.log10(255**2 / max((d**2).mean(), 1e-12))),
            "emb_rel": float(np.linalg.norm(ea - eb) / np.linalg.norm(ea)),
            "emb_min_cos": float(cos.min()),
        }
    return out


def encode_runs(ckpt: str, folder: pathlib.Path, workers: list[int], rounds: int) -> dict:
    """`qwen-vit-jax encode` of `folder` with each worker count, rounds alternating: inputs/s (its
    summary: the whole run, compiles and worker start-up included) and the share of the run spent
    waiting for inputs, medians; and whether every worker count wrote the same file."""
    res: dict[int, list] = {w: [] for w in workers}
    tmp = common.cache() / "host_pipeline_out"
    tmp.mkdir(parents=True, exist_ok=True)
    for _ in range(rounds):
        for w in workers:
            out = tmp / f"w{w}.safetensors"
            cmd = [sys.executable, "-c", "from qwen_vit_jax.tools.cli import run; run()", "encode", ckpt, str(folder)]
            cmd += ["-o", str(out), "--overwrite", "--workers", str(w)]
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=common.ROOT, check=False)
            m = re.search(r"\(([\d.e+-]+) inputs/s.* (\d+)% of it waiting", proc.stdout)
            if proc.returncode or m is None:
                raise RuntimeError(f"encode --workers {w} failed: {proc.stdout[-500:]} {proc.stderr[-2000:]}")
            res[w].append((float(m[1]), int(m[2]) / 100))
            log(f"  --workers {w}: {m[1]} inputs/s, {m[2]}% waiting")
    digests = {w: (tmp / f"w{w}.safetensors").read_bytes() for w in workers}
    return {
        "images_per_s": {w: statistics.median(x for x, _ in v) for w, v in res.items()},
        "waiting": {w: statistics.median(y for _, y in v) for w, v in res.items()},
        "identical_outputs": len(set(digests.values())) == 1,
    }


def _folder(name: str, source: str, n: int) -> pathlib.Path:
    """A folder of n links to one input (decode and resize cost the same for each)."""
    folder = inputs_dir() / name
    if not folder.exists():
        folder.mkdir()
        for i in range(n):
            (folder / f"p{i:03d}.jpg").symlink_to(source)
    return folder


# ---- the parent -----------------------------------------------------------------------------------
def _env_one_thread(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", JAX_PLATFORMS="cpu", **extra)


def run(args) -> dict:
    rev = args.against or (None if args.quick else BEFORE)
    inputs = make_inputs(args.quick)
    payload = {"inputs": inputs, "repeats": args.repeats}
    sides = {"ours": ("stages_ours", _env_one_thread(), None), "hf-pil": ("stages_hf", _env_one_thread(), None)}
    if rev:
        sides["before"] = ("stages_before", _env_one_thread(PYTHONPATH=str(common.worktree(rev))), None)
    if args.ref_python:
        sides["hf-torchvision"] = ("stages_hf", _env_one_thread(), args.ref_python)
    else:
        log("no reference venv (--ref-python; benchmarks/video_reference.sh builds one): no torchvision column")

    def stages(side: str, spec) -> dict:
        kind, env, python = spec
        return run_worker(__name__, kind, dict(payload, backend=side.removeprefix("hf-")), env=env, python=python)

    results: dict = {"inputs": inputs, "before": common.rev_info(rev) if rev else None}
    results["stages"] = common.alternate(1 if args.quick else 2, sides, stages)
    # the pipeline: 1080p JPEGs (quick: the small photo) through the loader alone and through `encode`
    photo = inputs["JPEG 504x504" if args.quick else "JPEG 1920x1080"]
    rounds, n, workers = (1, 12, [0]) if args.quick else (3, 300, [0, 1, 2])
    log(f"loader alone, workers {workers}")
    payload = {"folder": str(_folder(f"folder_{n}", photo, n)), "workers": workers, "rounds": rounds}
    results["loader"] = run_worker(__name__, "loader", payload, env=_env_one_thread())
    log("encode, a host-bound tiny tower")
    folder = _folder("folder_8" if args.quick else "folder_1080p_480", photo, 8 if args.quick else 480)
    results["pipeline_tiny"] = encode_runs(common.host_bound_checkpoint(), folder, workers, rounds)
    results["pipeline_inputs"] = {
        "photo": photo.rpartition("photo_")[2],
        "loader": n,
        "encode": 8 if args.quick else 480,
    }
    if not args.quick:
        big = common.checkpoint("qwen2.5-vl-3b", quick=False)["ours"]
        log("encode, the real 3B tower (the device-idle share)")
        results["pipeline_3b"] = encode_runs(big, _folder("folder_1080p_3", photo, 3), [1], rounds=1)
    photos = ["astronaut"] if args.quick else PHOTOGRAPHS
    results["fast_decode"] = run_worker(
        __name__, "fast_decode", {"ckpt": common.host_bound_checkpoint(), "photos": photos}, env=_env_one_thread()
    )
    grids = {k: v["grid"] for k, v in results["stages"]["ours"][0].items() if "grid" in v}
    grids = dict(list(grids.items())[:1]) if args.quick else grids
    targets = ["h100"] if args.quick else ["h100", "tpu-v5e"]
    results["accel"] = run_worker(
        __name__, "accel", {"targets": targets, "grids": grids, "quick": args.quick}, env=_env_one_thread()
    )
    return results


PHOTOGRAPHS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "retina")


def _merge(runs: list[dict]) -> dict:
    """The median over rounds of every stage of every input."""
    out = {}
    for name in runs[0]:
        if not isinstance(runs[0][name], dict):
            continue
        out[name] = {}
        for k, v in runs[0][name].items():
            vals = [r[name][k] for r in runs if isinstance(r[name].get(k), (int, float))]
            out[name][k] = statistics.median(vals) if vals else v
    return out


def report(result: dict) -> str:
    res = result["data"]
    before = res["before"]["hash"][:7] if res.get("before") else "before"
    lines = [
        f"ms per input, each side in its own process pinned to one core; 'before' is {before}; HF's processors "
        "at their class-default sizing (max_pixels 1,003,520), the Qwen2.5-VL tower.",
        "",
    ]
    sides = [s for s in ("ours", "before", "hf-pil", "hf-torchvision") if s in res["stages"]]
    merged = {s: _merge(res["stages"][s]) for s in sides}
    rows = []
    for name in merged["ours"]:
        for s in sides:
            st = merged[s].get(name)
            if st is None:
                continue
            if "decode_resize_patch" in st:
                total = st["loop"] + st["plan"]
                cells = [
                    "",
                    f"{st['decode_resize_patch']:.1f} (decode + resize + patches)",
                    "",
                    "",
                    f"{st['plan']:.2f}",
                ]
            else:
                resize = st.get("resize")
                cells = [f"{st['read']:.2f}", f"{st['decode']:.1f}", "-" if resize is None else f"{resize:.1f}"]
                cells += [f"{st['pixels']:.1f}", f"{st['plan']:.2f}" if "plan" in st else "-"]
                total = st["loop"]
            nbytes = st.get("bytes_uint8")
            side = before if s == "before" else s
            rows.append([name, side, *cells, f"{total:.1f}", "-" if nbytes is None else f"{nbytes / 1e6:.2f}"])
    lines.append(
        markdown_table(
            ["input", "side", "read", "decode", "resize", "pixels", "plan", "total ms", "MB to device"], rows
        )
    )
    if "loader" in res:
        lo = res["loader"]
        what = res.get("pipeline_inputs", {"photo": "1920x1080.jpg", "loader": 300, "encode": 480})
        lines += ["", f"The loader alone (`qvj.data.load`, each item device_put), {what['loader']} JPEGs:", ""]
        rows = [
            [w, f"{v['first_s']:.2f}", f"{v['per_s']:.1f}", f"{v['per_s'] / next(iter(lo.values()))['per_s']:.2f}x"]
            for w, v in lo.items()
        ]
        lines.append(markdown_table(["workers", "first item s", "items/s after it", f"vs {next(iter(lo))}"], rows))
    if "pipeline_tiny" in res:
        p = res["pipeline_tiny"]
        what = res.get("pipeline_inputs", {"photo": "1920x1080.jpg", "loader": 300, "encode": 480})
        lines += ["", f"`encode --workers N`, host-bound tiny tower, {what['encode']} JPEGs (whole runs):", ""]
        first = next(iter(p["images_per_s"]))
        base = p["images_per_s"][first]
        rows = [[w, f"{v:.1f}", f"{v / base:.2f}x", f"{p['waiting'][w]:.0%}"] for w, v in p["images_per_s"].items()]
        lines.append(markdown_table(["workers", "images/s", f"vs {first}", "waiting for inputs"], rows))
        lines += ["", f"Outputs bit-identical across worker counts: {p['identical_outputs']}."]
    if "pipeline_3b" in res:
        p = res["pipeline_3b"]
        w = next(iter(p["waiting"]))
        lines.append(
            f"real 3B tower, --workers 1: {p['images_per_s'][w]:.3g} images/s, {p['waiting'][w]:.0%} waiting for inputs"
        )
    if "fast_decode" in res:
        lines += [
            "",
            "`--fast-decode` vs the exact decode, scikit-image photographs as JPEG q90, max_pixels 224 x 224",
            "(embeddings: a random-weight tower, float32):",
            "",
        ]
        rows = [
            [
                name,
                "x".join(map(str, v["size"])),
                "yes" if v["draft"] else "no (target > half)",
                f"{v['pixel_mean_abs']:.2f}",
                f"{v['pixel_max_abs']:.0f}",
                f"{v['psnr_db']:.1f}",
                f"{v['emb_rel']:.3f}",
                f"{v['emb_min_cos']:.4f}",
            ]
            for name, v in res["fast_decode"].items()
        ]
        head = ["photo", "size", "draft applies", "mean abs px", "max abs px", "PSNR dB", "emb rel", "min token cos"]
        lines.append(markdown_table(head, rows))
    if "accel" in res:
        ours = merged["ours"]
        lines += [
            "",
            "Cores per device (device images/s from aot rooflines, bf16, estimates / ours host images/s per core):",
            "",
        ]
        rows = []
        for key, seconds in res["accel"].items():
            target, name = key.split("|")
            st = ours[name]
            host = (
                st["decode_resize_patch"] + st["plan"]
                if "decode_resize_patch" in st
                else st["read"] + st["decode"] + st["resize"] + st["pixels"] + st["plan"]
            )
            dev = 1 / seconds if "decode_resize_patch" not in st else st["frames"] / (seconds)
            rows.append(
                [target, name, f"{seconds * 1e3:.2f}", f"{dev:,.0f}", f"{1e3 / host:,.1f}", f"{dev / (1e3 / host):.1f}"]
            )
        lines.append(
            markdown_table(
                ["target", "input", "roofline ms (est.)", "device inputs/s", "host inputs/s/core", "cores"], rows
            )
        )
    return "\n".join(lines)


WORKERS = {
    "stages_ours": stages_ours,
    "stages_before": stages_before,
    "stages_hf": stages_hf,
    "accel": accel,
    "loader": loader,
    "fast_decode": fast_decode,
}
