"""Decode + sample + preprocess a 60 s 720p clip: ours (video.py) vs HF 5.24's video processor, in one
run, each repetition in a fresh child process (its wall time and peak RSS), ours and HF alternating.

HF's side is what HF does for a file when torchcodec is missing: `transformers.video_utils.load_video`
with its PyAV backend and the processor's own `sample_frames` (decode up to the last sampled frame,
keep the sampled ones, convert them to RGB), then the processor (torchvision resize, rescale,
normalise, patchify). It needs torchvision, so it runs in the reference venv
(benchmarks/video_reference.sh builds it); ours runs there too, so both see the same PyAV / ffmpeg.

    flock /tmp/qvj-heavy.lock /work/venv-video-ref/bin/python benchmarks/bench_video.py
    ... --seconds 60 --repeats 3 --clip /tmp/qvj_720p_60s.mp4
"""

from __future__ import annotations

import argparse
import fractions
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (label, config dict for HF's processor class and our PreprocessConfig.from_hf(video=True), call)
CASES = [
    (
        "Qwen3-VL hub config, fps 2",
        {
            "size": {"longest_edge": 25165824, "shortest_edge": 4096},
            "patch_size": 16,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "video_processor_type": "Qwen3VLVideoProcessor",
        },
        {"fps": 2.0},
    ),
    ("Qwen2-VL video defaults, fps 1", {"video_processor_type": "Qwen2VLVideoProcessor"}, {"fps": 1.0}),
    (
        "Qwen3-VL hub config, 16 frames",
        {
            "size": {"longest_edge": 25165824, "shortest_edge": 4096},
            "patch_size": 16,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "video_processor_type": "Qwen3VLVideoProcessor",
            "fps": None,
        },
        {"num_frames": 16},
    ),
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


def child(kind: str, path: str, case: int) -> None:
    """One run in this (fresh) process; prints a JSON line: seconds, peak RSS, output shape."""
    _, config, call = CASES[case]
    import numpy as np

    if kind == "ours":
        sys.path.insert(0, ROOT)
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
    grid = np.asarray(grid)[0].tolist()
    print(json.dumps({"seconds": seconds, "peak_rss_mib": rss, "rows": int(pv.shape[0]), "grid": grid}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clip", default="/tmp/qvj_720p_60s.mp4", help="written once, reused while it exists")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=3, metavar=("KIND", "PATH", "CASE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    if not os.path.exists(args.clip):
        t0 = time.perf_counter()
        write_clip(args.clip, args.seconds)
        print(f"wrote {args.clip} in {time.perf_counter() - t0:.0f} s")
    import av

    with av.open(args.clip) as c:
        s = c.streams.video[0]
        print(f"clip: {s.width}x{s.height}, {s.frames} frames at {float(s.average_rate):g} fps, {s.codec_context.name}")
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    print(f"CPU: {cpu.split(':', 1)[-1].strip()} ({os.cpu_count()} visible cores); Python {platform.python_version()}")
    print(f"{'case':34} {'who':5} {'median s':>9} {'frames/s of clip':>17} {'peak RSS MiB':>13}  grid")
    for i, (label, _, _) in enumerate(CASES):
        runs = {"ours": [], "hf": []}
        for _ in range(args.repeats):
            for kind in ("ours", "hf"):  # alternating: drift in the machine's load hits both
                p = subprocess.run(
                    [sys.executable, __file__, "--child", kind, args.clip, str(i)], capture_output=True, text=True
                )
                if p.returncode:
                    raise SystemExit(f"{kind} failed:\n{p.stderr[-3000:]}")
                runs[kind].append(json.loads(p.stdout.strip().splitlines()[-1]))
        with av.open(args.clip) as c:
            total = c.streams.video[0].frames
        for kind, rs in runs.items():
            med = statistics.median(r["seconds"] for r in rs)
            rss = max(r["peak_rss_mib"] for r in rs)
            print(f"{label:34} {kind:5} {med:>9.2f} {total / med:>17.0f} {rss:>13.0f}  {rs[0]['grid']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
