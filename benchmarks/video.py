"""Decode + sample + preprocess a 60 s 720p clip: ours (preprocess/video.py) vs HF's video processor,
each repetition in a fresh worker process (its wall time and peak RSS), ours and HF alternating; and
HF parity of the sampling and pixels, from the frozen reference run (tests/data/video_reference.json,
`bash benchmarks/video_reference.sh`).

HF's side is what HF does for a file when torchcodec is missing: `transformers.video_utils.load_video`
with its PyAV backend and the processor's own `sample_frames` (decode up to the last sampled frame,
keep the sampled ones, convert them to RGB), then the processor (torchvision resize, rescale,
normalise, patchify). It needs torchvision, so both sides run in the reference venv that
benchmarks/video_reference.sh builds (--ref-python or $VIDEO_REF_PYTHON: both see the same PyAV /
ffmpeg); without it only ours runs. --quick: a 2 s 320x240 clip, the first case.
"""

from __future__ import annotations

import collections
import fractions
import json
import os
import resource
import statistics
import time

from benchmarks import common

DEFAULTS = {"repeats": (3, 1)}
REFERENCE = common.ROOT / "tests" / "data" / "video_reference.json"  # HF's run, frozen for the tests

QWEN3_HUB = {  # Qwen3-VL's video_preprocessor_config.json on the hub
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "video_processor_type": "Qwen3VLVideoProcessor",
}
# (label, config dict for HF's processor class and our PreprocessConfig.from_hf(video=True), call)
CASES = [
    ("Qwen3-VL hub config, fps 2", QWEN3_HUB, {"fps": 2.0}),
    ("Qwen2-VL video defaults, fps 1", {"video_processor_type": "Qwen2VLVideoProcessor"}, {"fps": 1.0}),
    ("Qwen3-VL hub config, 16 frames", {**QWEN3_HUB, "fps": None}, {"num_frames": 16}),
]


def write_clip(path: str, seconds: float, width: int = 1280, height: int = 720, fps: int = 30) -> None:
    """A moving-shapes H.264 clip (yuv420p, the usual phone / web format)."""
    import av
    import numpy as np

    n = int(seconds * fps)
    y, x = np.mgrid[0:height, 0:width].astype(np.int32)
    with av.open(path, "w") as out:
        s = out.add_stream("libx264", rate=fractions.Fraction(fps, 1))
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.options = {"crf": "23", "preset": "veryfast"}
        for i in range(n):
            img = np.empty((height, width, 3), np.uint8)
            img[..., 0] = (x // 5 + i * 3) % 256
            img[..., 1] = (y // 3 + i) % 256
            img[..., 2] = ((x + y) // 4 + i * 5) % 256
            bx = int(i / n * (width - 200))
            img[300:460, bx : bx + 200] = (230, 30, 30)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)


def preprocess_worker(p: dict) -> dict:
    """Worker: one run of p["side"] ("ours" or "hf") on case p["case"] of p["clip"]: seconds, peak RSS
    of the process, output shape."""
    _, config, call = CASES[p["case"]]
    path = p["clip"]
    import numpy as np

    if p["side"] == "ours":
        from qwen_vit_jax.preprocess.config import PreprocessConfig
        from qwen_vit_jax.preprocess.video import preprocess_video

        cfg = PreprocessConfig.from_hf(config, video=True)
        t0 = time.perf_counter()
        pv, grid, _ = preprocess_video(path, config=cfg, **call)
        seconds = time.perf_counter() - t0
    else:
        import warnings
        from functools import partial

        from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
        from transformers.video_utils import load_video

        qwen3 = config["video_processor_type"].startswith("Qwen3")
        kw = {k: v for k, v in config.items() if not k.endswith("_type")}
        proc = (Qwen3VLVideoProcessor if qwen3 else Qwen2VLVideoProcessor)(**kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            frames, meta = load_video(path, backend="pyav", sample_indices_fn=partial(proc.sample_frames, **call))
            out = proc(videos=[frames], video_metadata=[meta], do_sample_frames=False, cap_pixels_per_frame=False)
            pv, grid = out["pixel_values_videos"].numpy(), out["video_grid_thw"].numpy()
            seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    return {"seconds": seconds, "peak_rss_mib": rss, "rows": int(pv.shape[0]), "grid": np.asarray(grid)[0].tolist()}


def add_args(p) -> None:
    p.add_argument("--seconds", type=float, help="the clip's length (default 60; --quick 2)")
    p.add_argument(
        "--ref-python",
        default=common.ref_python(),
        help="the video-reference venv's python (video_reference.sh builds it; $VIDEO_REF_PYTHON): HF's side",
    )


def parity() -> dict:
    """The frozen reference run's cases, by tower: how many, HF's two backends' max |diff| (min and max
    over the cases), ours vs HF's PIL path (max), whether every sampled grid equals HF's."""
    ref = json.loads(REFERENCE.read_text())
    out: dict = collections.defaultdict(lambda: {"cases": 0, "hf_min": float("inf"), "hf_max": 0.0, "ours_max": 0.0})
    for c in ref["cases"]:
        t = out[c["config_name"].split()[0]]
        d = c["max_abs"]["hf_video_vs_hf_pil"]
        t.update(cases=t["cases"] + 1, hf_min=min(t["hf_min"], d), hf_max=max(t["hf_max"], d))
        t["ours_max"] = max(t["ours_max"], c["max_abs"]["ours_vs_hf_pil"])
        t["grids_equal"] = t.get("grids_equal", True) and c["ours_grid_equal"]
    return {"versions": ref["versions"], "towers": dict(out)}


def run(args) -> dict:
    seconds = args.seconds or (2.0 if args.quick else 60.0)
    size = (320, 240) if args.quick else (1280, 720)
    clip = common.cache() / f"video_{size[0]}x{size[1]}_{seconds:g}s.mp4"
    if not clip.exists():
        clip.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write_clip(str(clip) + ".tmp.mp4", seconds, *size)
        os.replace(str(clip) + ".tmp.mp4", clip)
        common.log(f"wrote {clip} in {time.perf_counter() - t0:.0f} s")
    import av

    with av.open(str(clip)) as c:
        s = c.streams.video[0]
        about = {"width": s.width, "height": s.height, "frames": s.frames, "fps": float(s.average_rate)}
    sides = {"ours": args.ref_python, "hf": args.ref_python} if args.ref_python else {"ours": None}
    if not args.ref_python:
        common.log("no reference venv (--ref-python): ours only")
    cases = []
    for i, (label, _, _) in enumerate(CASES[:1] if args.quick else CASES):
        p = {"clip": str(clip), "case": i}
        runs = common.alternate(
            args.repeats,
            sides,
            lambda side, py, p=p: common.run_worker(__name__, "preprocess", p | {"side": side}, python=py),
        )
        cases.append({"case": label, "runs": runs})
    return {"clip": about, "repeats": args.repeats, "cases": cases, "parity": parity()}


def report(result: dict) -> str:
    d, rows = result["data"], []
    for c in d["cases"]:
        med = {side: statistics.median(r["seconds"] for r in rs) for side, rs in c["runs"].items()}
        rss = {side: max(r["peak_rss_mib"] for r in rs) for side, rs in c["runs"].items()}
        grid = "x".join(map(str, c["runs"]["ours"][0]["grid"]))
        hf = "hf" in med
        rows.append(
            [c["case"], grid, f"{med['ours']:.1f}", f"{med['hf']:.1f}" if hf else "-"]
            + [f"**{med['hf'] / med['ours']:.2f}x**" if hf else "-", f"{rss['ours']:.0f} MiB"]
            + [f"{rss['hf']:.0f} MiB" if hf else "-"]
        )
    clip = d["clip"]
    heads = ["case", "grid", "ours s", "HF s", "ours / HF throughput", "ours peak RSS", "HF peak RSS"]
    par = [
        [
            name,
            t["cases"],
            f"{t['hf_min']:.4f}",
            f"{t['hf_max']:.3f}",
            f"{t['ours_max']:.1f}",
            "yes" if t["grids_equal"] else "NO",
        ]
        for name, t in d["parity"]["towers"].items()
    ]
    v = d["parity"]["versions"]
    return (
        f"A {clip['frames'] / clip['fps']:.0f} s {clip['width']}x{clip['height']} {clip['fps']:g} fps H.264 clip "
        f"({clip['frames']} frames): decode + sample + preprocess to pixel_values, each repetition a fresh "
        f"process, sides alternating, medians of {d['repeats']}:\n\n"
        + common.markdown_table(heads, rows)
        + f"\n\nParity with HF (transformers {v['transformers']}, torchvision {v['torchvision']}: the frozen "
        "reference run of `bash benchmarks/video_reference.sh` on the test clips): sampled indices, grids and "
        "timestamps, and pixels against HF's PIL image processor on the same frames (max |diff| after "
        "normalisation); HF's own two backends (its video processor vs its PIL path) beside it:\n\n"
        + common.markdown_table(
            ["configs", "cases", "HF video vs HF PIL, min", "max", "ours vs HF PIL, max", "grids equal"], par
        )
    )


WORKERS = {"preprocess": preprocess_worker}
