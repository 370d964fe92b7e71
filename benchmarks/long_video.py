"""Long videos: what `qwen-vit-jax encode` costs on 1-, 5- and 10-minute clips, and what a long video
costs the service's other clients; the working tree beside a revision (--against) in one run.

    python -m benchmarks long_video --against main    # both sides, alternating
    python -m benchmarks long_video --quick           # a 4 s 320x240 clip, the tree alone: seconds
    python -m benchmarks long_video --label rows --against main --out-dim 2048 --minutes 1,5 \
        --outs .safetensors,.npz,.parquet --no-serve  # what a real tower's rows cost each format

  encode  `qwen-vit-jax encode` of a 640x360 30 fps H.264 clip at --fps 2 with the frame cap raised
          (--max-frames 100000: every sampled frame), to each of --outs, --workers 0 (the run is one
          process), each run in a fresh worker process, sides alternating: its peak RSS (the
          process's ru_maxrss when the CLI returns), the loop's seconds (the CLI's summary line) and
          sampled frames per second of them. The demo's tiny tower (random weights), D = 128 or
          --out-dim: at D = 128 what grows with the clip is the path of its frames, not its
          embeddings (9 MB a minute at 640x360); at D = 2048 (Qwen2.5-VL-3B's) the row of embeddings
          is 147 MB a minute, and the report gives what each format costs per byte of it: the peak's
          growth from the shortest clip to the longest over the row's.
  serve   `qwen-vit-jax serve` of each side (one preparation worker, no cache; the demo's tiny tower,
          D = 128, whatever --out-dim says): the first clip at --fps POSTed, then a 224x224 PNG 1 s
          later: both latencies, medians of --repeats (after a first round that compiles their
          programs, not timed).
"""

from __future__ import annotations

import base64
import contextlib
import io
import re
import statistics
import threading
import time

from benchmarks import common

DEFAULTS = {"repeats": (1, 1)}
AGAINST = "ours at REV beside the working tree (its worktree first on PYTHONPATH): the same runs, alternating"
SIZE = (640, 360)


def add_args(p) -> None:
    p.add_argument(
        "--minutes",
        type=lambda s: [float(x) for x in s.split(",")],
        help="the clips' lengths in minutes (default 1,5,10; --quick 4 s)",
    )
    p.add_argument("--fps", type=float, default=2.0, help="frames sampled per second (default 2)")
    p.add_argument("--out-dim", type=int, help="the tiny tower with this out_hidden_size D (default the demo's, 128)")
    p.add_argument(
        "--outs",
        type=lambda s: s.split(","),
        default=[".safetensors", ".parquet"],
        help="the output formats (default .safetensors,.parquet)",
    )
    p.add_argument("--no-serve", action="store_true", help="leave out the service's case")


def clip(minutes: float, size: tuple[int, int]) -> str:
    """A moving-shapes H.264 clip at 30 fps under the bench cache, written once."""
    from benchmarks.video import write_clip

    path = common.cache() / f"long_video_{size[0]}x{size[1]}_{minutes:g}min.mp4"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write_clip(str(path) + ".tmp.mp4", minutes * 60, *size)
        (path.parent / (path.name + ".tmp.mp4")).replace(path)
        common.log(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    return str(path)


def encode_worker(p: dict) -> dict:
    """Worker: `qwen-vit-jax encode` of p["clip"] to p["out"] in this process: its peak RSS (MiB), the
    loop's seconds, the frames sampled, the size of its row of embeddings (MiB)."""
    import resource

    from qwen_vit_jax.tools.cli import main

    args = ["encode", p["ckpt"], p["clip"], "-o", p["out"], "--overwrite", "--fps", str(p["fps"])]
    args += ["--max-frames", "100000", "--workers", "0"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before anything is read back
    loop = re.search(r"\(([0-9,]+) tokens x (\d+)\) in ([0-9.]+) s", out.getvalue())
    if rc != 0 or loop is None:
        raise RuntimeError(f"encode failed ({rc}): {out.getvalue()[-2000:]}")
    row = int(loop[1].replace(",", "")) * int(loop[2]) * 4 / 2**20  # float32 [tokens, D]
    return {"peak_mib": peak, "seconds": float(loop[3]), "frames": 2 * frames_of(p["out"]), "row_mib": row}


def frames_of(path: str) -> int:
    """The t of the one input's grid in an embeddings file, its grid alone read."""
    import numpy as np

    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return int(pq.read_table(path, columns=["grid_thw"]).column(0)[0].as_py()[0])
    if path.endswith(".npz"):
        with np.load(path) as z:
            return int(z["grid_thw"][0, 0])
    from safetensors import safe_open

    with safe_open(path, "np") as f:
        return int(f.get_tensor("grid_thw")[0, 0])


def tower(p: dict) -> dict:
    """Worker: the demo's tiny tower with out_hidden_size p["out_dim"] (random weights, HF layout
    converted), built once under the cache."""
    import dataclasses
    import shutil

    from qwen_vit_jax.tools.demo import TINY, write_random_hf_checkpoint
    from qwen_vit_jax.weights.convert import convert_checkpoint

    root = common.cache() / f"demo-tiny-d{p['out_dim']}"
    if not (root / "ours").is_dir():
        shutil.rmtree(root, ignore_errors=True)
        write_random_hf_checkpoint(dataclasses.replace(TINY, out_dim=p["out_dim"]), root / "hf")
        convert_checkpoint(root / "hf", root / "ours")
    return {"path": str(root / "ours")}


def _post(url: str, out: dict, kind: str, item: dict) -> None:
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(url, json={"input": [item]}, timeout=900)
    out[kind] = (time.perf_counter() - t0, r.status_code)


def serve_side(tree, ckpt: str, video: bytes, fps: float, repeats: int) -> dict:
    """A server of `tree`: the video, then an image 1 s later, `repeats` times: their latencies."""
    import numpy as np
    from PIL import Image

    from benchmarks.workloads.traffic import ROUTE, Server

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (224, 224, 3), np.uint8)).save(buf, "PNG")
    image, video64 = base64.b64encode(buf.getvalue()).decode(), base64.b64encode(video).decode()
    got = {"video": [], "image": []}
    args = ("--workers", "1", "--cache-mb", "0", "--timeout", "600")
    with Server(ckpt, *args, env=common.rev_env(tree), cwd=str(tree), ready_timeout=600) as server:
        for r in range(repeats + 1):  # the first compiles the programs: not timed
            out: dict = {}
            t = threading.Thread(target=_post, args=(server.url + ROUTE, out, "video", {"video": video64, "fps": fps}))
            t.start()
            time.sleep(1.0)
            _post(server.url + ROUTE, out, "image", {"image": image})
            t.join()
            for kind in got:
                if out[kind][1] != 200:
                    raise RuntimeError(f"{tree}: the {kind} got {out[kind][1]}")
                if r:
                    got[kind].append(out[kind][0])
    return got


def run(args) -> dict:
    minutes = args.minutes or ([4 / 60] if args.quick else [1.0, 5.0, 10.0])
    size = (320, 240) if args.quick else SIZE
    demo = common.run_worker(__name__, "demo", {"model": "tiny"})["path"]
    ckpt = common.run_worker(__name__, "tower", {"out_dim": args.out_dim})["path"] if args.out_dim else demo
    sides = {"tree": common.ROOT}
    if args.against:
        rev = common.rev_info(args.against)
        sides[rev["hash"][:7]] = common.worktree(rev["hash"])
    encode = []
    for m in minutes:
        path = clip(m, size)
        for suffix in args.outs:

            def one(side, tree, path=path, suffix=suffix):
                p = {"ckpt": ckpt, "clip": path, "fps": args.fps}
                p["out"] = str(common.cache() / f"long_video_out_{side}{suffix}")
                env = None if tree == common.ROOT else common.rev_env(tree)
                return common.run_worker(__name__, "encode", p, env=env)

            encode.append({"minutes": m, "out": suffix, "runs": common.alternate(args.repeats, sides, one)})
    serve = {}
    if not args.no_serve:
        video = open(clip(minutes[0], size), "rb").read()
        serve = {side: serve_side(tree, demo, video, args.fps, args.repeats) for side, tree in sides.items()}
    d = {"size": list(size), "fps": args.fps, "out_dim": args.out_dim or 128, "sides": list(sides)}
    return d | {"encode": encode, "serve": serve}


def report(result: dict) -> str:
    d = result["data"]
    sides = d["sides"]
    rows = []
    for case in d["encode"]:
        runs = case["runs"]
        m = case["minutes"]
        cells = [f"{m:g} min" if m >= 1 else f"{m * 60:.0f} s", case["out"], runs[sides[0]][0]["frames"]]
        cells += [f"{runs[sides[0]][0]['row_mib']:,.0f}"] if "row_mib" in runs[sides[0]][0] else []
        cells += [f"{max(r['peak_mib'] for r in runs[s]):,.0f}" for s in sides]
        cells += [f"{statistics.median(r['frames'] / r['seconds'] for r in runs[s]):.1f}" for s in sides]
        rows.append(cells)
    heads = ["clip", "OUT", "frames"] + ["row MiB"] * ("row_mib" in d["encode"][0]["runs"][sides[0]][0])
    heads += [f"{s} peak RSS MiB" for s in sides] + [f"{s} frames/s" for s in sides]
    w, h = d["size"]
    dim = d.get("out_dim", 128)
    text = (
        f"`encode` of {w}x{h} 30 fps clips at fps {d['fps']:g}, every sampled frame, one process each (the tiny "
        f"tower, D = {dim}):\n\n{common.markdown_table(heads, rows)}"
    )
    multiples = _row_multiples(d)
    if multiples:
        text += (
            "\n\nWhat the clip's own row of embeddings costs (it is the only thing that grows with the clip): "
            "the peak's growth from the shortest clip to the longest, over the row's growth "
            f"({multiples.pop('row')}): {'; '.join(multiples.values())}. Every format holds the row "
            "once until it is written; pyarrow's parquet writer adds several times the row while it writes "
            "the row group that holds it (one parquet row per input), .safetensors and .npz write it from "
            "where it is held."
        )
    if d["serve"]:
        lat = "; ".join(
            f"{s}: the clip {statistics.median(v['video']):.1f} s, the image {statistics.median(v['image']):.2f} s"
            for s, v in d["serve"].items()
        )
        text += (
            f"\n\n`serve` (the tiny tower, D = 128), the first clip then a 224x224 PNG 1 s later, medians (one "
            f"preparation worker; the tree's videos have one of their own): {lat}."
        )
    return text


def _row_multiples(d: dict) -> dict[str, str]:
    """{"row": the row's MB a minute, OUT: "OUT side 1.0x, ..."} from the shortest and the longest
    clip of each OUT; {} for results without the row's size or with one clip length."""
    out = {}
    for fmt in dict.fromkeys(c["out"] for c in d["encode"]):
        cases = sorted((c for c in d["encode"] if c["out"] == fmt), key=lambda c: c["minutes"])
        first, last = cases[0]["runs"], cases[-1]["runs"]
        if len(cases) < 2 or "row_mib" not in first[d["sides"][0]][0]:
            return {}
        row = last[d["sides"][0]][0]["row_mib"] - first[d["sides"][0]][0]["row_mib"]
        minutes = cases[-1]["minutes"] - cases[0]["minutes"]
        out["row"] = f"{row * 2**20 / 1e6 / minutes:,.0f} MB a minute"
        grow = {s: max(r["peak_mib"] for r in last[s]) - max(r["peak_mib"] for r in first[s]) for s in d["sides"]}
        out[fmt] = f"{fmt} " + ", ".join(f"{s} {g / row:.1f}x" for s, g in grow.items())
    return out


WORKERS = {"encode": encode_worker, "demo": common.demo_checkpoint, "tower": tower}
