"""Video: three measurements, each a fresh child process per run (its wall time and peak RSS).

Default (`hf`): decode + sample + preprocess a 60 s 720p clip: ours (video.py) vs HF 5.24's video
processor, in one run, ours and HF alternating.

`--encode`: `qwen-vit-jax encode` of 1-, 5- and 10-minute 640x360 30 fps clips at `--fps 2` with the
frame cap raised (`--max-frames 100000`: every sampled frame), to .safetensors and .parquet, the
working tree vs `--against REV` (default main) alternating, one process each (`--workers 0`: the run
is that one process): peak RSS (the child's ru_maxrss), the loop's seconds (what the CLI prints) and
sampled frames per second of it. The demo's tiny tower (D = 128): what grows with the clip is the
decode path, not the embeddings.

`--serve`: `qwen-vit-jax serve` (one preparation worker, no cache) of each tree: a 1-minute clip
at fps 2 POSTed, then a 224x224 PNG 1 s later: both latencies, median of --repeats.

HF's side is what HF does for a file when torchcodec is missing: `transformers.video_utils.load_video`
with its PyAV backend and the processor's own `sample_frames` (decode up to the last sampled frame,
keep the sampled ones, convert them to RGB), then the processor (torchvision resize, rescale,
normalise, patchify). It needs torchvision, so it runs in the reference venv
(benchmarks/video_reference.sh builds it); ours runs there too, so both see the same PyAV / ffmpeg.

    flock /tmp/qvj-heavy.lock /work/venv-video-ref/bin/python benchmarks/bench_video.py
    ... --seconds 60 --repeats 3 --clip /tmp/qvj_720p_60s.mp4
    python benchmarks/bench_video.py --encode [--against main] [--minutes 1,5,10] [--repeats 1]
    python benchmarks/bench_video.py --serve [--against main] [--repeats 3]
Clips and the checkpoint are written once under the bench cache (QVJ_BENCH_CACHE).
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


# ---- --encode and --serve: the working tree vs a revision -----------------------------------------
def _cache():
    sys.path.insert(0, HERE)
    import common

    return common


def tiny_checkpoint() -> str:
    """The demo's tiny Qwen2.5-VL tower (its hub preprocessor config), converted once under the
    bench cache by the working tree."""
    common = _cache()
    root = common.CACHE / "video-tiny"
    if not (root / "converted").is_dir():
        code = (
            "import sys; from qwen_vit_jax.tools.demo import TINY, write_random_hf_checkpoint; "
            "from qwen_vit_jax.weights.convert import convert_checkpoint; "
            "hf = write_random_hf_checkpoint(TINY, sys.argv[1] + '/hf', seed=0); "
            "convert_checkpoint(hf, sys.argv[1] + '/converted')"
        )
        subprocess.run([sys.executable, "-c", code, str(root)], check=True, env=common.rev_env(ROOT))
    return str(root / "converted")


def clip_of(minutes: float, width: int = 640, height: int = 360) -> str:
    """A moving-shapes H.264 clip at 30 fps under the bench cache (written once)."""
    common = _cache()
    path = common.CACHE / f"video-{width}x{height}-{minutes:g}min.mp4"
    if not path.exists():
        t0 = time.perf_counter()
        tmp = path.with_suffix(".tmp.mp4")
        write_clip(str(tmp), minutes * 60, width, height, 30)
        tmp.rename(path)
        print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    return str(path)


PEAK = "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); " + (
    "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode)"
)


def encode_run(tree, ckpt: str, clip: str, out: str, fps: float) -> dict:
    """One `encode` in a fresh process of `tree`: its peak RSS (MiB), loop seconds, sampled frames."""
    import re

    common = _cache()
    cli = [sys.executable, "-m", "qwen_vit_jax.tools.cli", "encode", ckpt, clip, "-o", out, "--overwrite"]
    cli += ["--fps", str(fps), "--max-frames", "100000", "--workers", "0"]
    p = subprocess.run(
        [sys.executable, "-c", PEAK, *cli], capture_output=True, text=True, env=common.rev_env(tree, common.torch_env())
    )
    peak = re.search(r"PEAK (\d+) (-?\d+)", p.stdout)
    loop = re.search(r"tokens x \d+\) in ([0-9.]+) s", p.stdout)
    if peak is None or int(peak[2]) != 0 or loop is None:
        raise SystemExit(f"encode failed in {tree}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    grid = re.search(r"video [^:]+: (\d+) x (\d+)x(\d+) patches", p.stderr)
    return {"peak_mib": int(peak[1]) / 1024, "seconds": float(loop[1]), "frames": 2 * int(grid[1])}


def bench_encode(args) -> None:
    common = _cache()
    trees = {"tree": ROOT, args.against: common.worktree(args.against)}
    ckpt = tiny_checkpoint()
    print(common.machine_line())
    print(f"tree {common.tree_info()} vs {args.against} {common.rev_info(args.against)['hash'][:12]}")
    rows = []
    for minutes in args.minutes:
        clip = clip_of(minutes)
        for suffix in (".safetensors", ".parquet"):
            runs = {name: [] for name in trees}
            for r in range(args.repeats):
                for name in list(trees)[:: 1 if r % 2 == 0 else -1]:  # who goes first alternates
                    out = str(common.CACHE / f"video-out-{name}{suffix}")
                    runs[name].append(encode_run(trees[name], ckpt, clip, out, args.fps))
            for name, rs in runs.items():
                seconds = statistics.median(r["seconds"] for r in rs)
                peak = max(r["peak_mib"] for r in rs)
                frames = rs[0]["frames"]
                rows.append(
                    [
                        f"{minutes:g} min",
                        suffix,
                        name,
                        frames,
                        f"{peak:,.0f}",
                        f"{seconds:.1f}",
                        f"{frames / seconds:.1f}",
                    ]
                )
                print(" | ".join(map(str, rows[-1])), flush=True)
    headers = ["clip (640x360, 30 fps)", "OUT", "tree", "frames at fps 2", "peak RSS MiB", "loop s", "frames/s"]
    print(common.markdown_table(headers, rows))


def bench_serve(args) -> None:
    import base64
    import io
    import threading

    from PIL import Image

    common = _cache()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import serve_traffic as st

    trees = {"tree": ROOT, args.against: common.worktree(args.against)}
    ckpt, clip = tiny_checkpoint(), clip_of(1)
    video = base64.b64encode(open(clip, "rb").read()).decode()
    buf = io.BytesIO()
    Image.fromarray(__import__("numpy").random.default_rng(0).integers(0, 256, (224, 224, 3), "uint8")).save(buf, "PNG")
    image = base64.b64encode(buf.getvalue()).decode()
    print(common.machine_line())
    rows = []
    for name, tree in trees.items():
        got = {"video": [], "image": []}
        args_ = ["--workers", "1", "--cache-mb", "0", "--timeout", "600"]
        with st.Server(ckpt, *args_, env=common.rev_env(tree), cwd=str(tree), ready_timeout=600) as server:
            url = server.url + st.ROUTE
            for _ in range(args.repeats):
                out = {}
                t = threading.Thread(target=_post, args=(url, out, "video", {"video": video, "fps": 2}))
                t.start()
                time.sleep(1.0)
                _post(url, out, "image", {"image": image})
                t.join()
                for kind in got:
                    assert out[kind][1] == 200, (name, kind, out[kind])
                    got[kind].append(out[kind][0])
        rows.append([name, f"{statistics.median(got['video']):.1f}", f"{statistics.median(got['image']):.2f}"])
        print(" | ".join(rows[-1]), flush=True)
    print(common.markdown_table(["tree", "1-min clip at fps 2, s", "224x224 PNG sent 1 s later, s"], rows))


def _post(url: str, out: dict, kind: str, body: dict) -> None:
    """POST one item; out[kind] = (seconds, status)."""
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(url, json={"input": [body]}, timeout=900)
    out[kind] = (time.perf_counter() - t0, r.status_code)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clip", default="/tmp/qvj_720p_60s.mp4", help="written once, reused while it exists")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--encode", action="store_true", help="encode's peak RSS and frames/s: tree vs --against")
    ap.add_argument(
        "--serve", action="store_true", help="a small image's latency beside a long video: tree vs --against"
    )
    ap.add_argument("--against", default="main", help="the revision --encode / --serve compare with")
    ap.add_argument("--minutes", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 5.0, 10.0])
    ap.add_argument("--fps", type=float, default=2.0)
    ap.add_argument("--child", nargs=3, metavar=("KIND", "PATH", "CASE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    if args.encode:
        bench_encode(args)
        return 0
    if args.serve:
        bench_serve(args)
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
