"""What each kind of stop costs `qwen-vit-jax encode`, and what a checkpoint costs.

    python -m benchmarks faults           # 240 inputs, 3 repeats
    python -m benchmarks faults --quick   # 8 inputs, tiny rows, one stop (SIGTERM), --workers 1

The tower is the demo's tiny Qwen2.5-VL (tools/demo.py TINY, random weights, out_dim 128), built once
under the bench cache (QVJ_BENCH_CACHE); the inputs N small PNGs (56..140 px a side, 36..64 patches),
each a call of its own (--batch-patches 64), so that every input can be a checkpoint.

  checkpoint   in one process, the sinks `encode` writes through (qwen_vit_jax.data.sinks.open_sink):
               parquet: k rows added, then `checkpoint()` timed (the part closed, fsynced, renamed);
               safetensors: n rows in all, one save timed (OUT rewritten whole, fsynced, renamed).
               Rows of the tiny tower (16 tokens x 128) and of the 3B tower for a 504x504 photo
               (324 tokens x 2048 float32: 2.65 MB). Median of R.
  save-every   the CLI (--workers 1, -o OUT.parquet) on the N inputs with --save-every 0 (a part per
               input) and with the default 600 (one part, at the end), alternating A/B, R rounds:
               inputs/s of the summary line (the encode loop, compiles loaded from the cache).
  stops        the CLI (--workers 2, --save-every 0, -o OUT.parquet) in a session of its own, sent
               SIGINT (what Ctrl-C sends), SIGTERM or SIGKILL once N/2 parts are checkpointed:
               seconds from the signal to the run's exit, and until no process of its session is
               left (its workers and multiprocessing's resource tracker); the inputs checkpointed
               at the signal and those OUT (or its parts) holds afterwards; temporary files left.
               A full disk: the same run with OUT on a tmpfs (--disk-kb, a mount namespace of its
               own: root or user namespaces needed, else skipped): seconds to the error, inputs
               kept, temporary files left.

"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import common
from benchmarks.common import log, markdown_table
from benchmarks.workloads.sessions import session_pids

DEFAULTS = {"repeats": (3, 1)}


def add_args(p) -> None:
    p.add_argument("--disk-kb", type=int, default=1024, help="the tmpfs of the full-disk run (1024)")


SIZES = [(112, 84), (84, 112), (56, 140), (112, 112), (84, 84), (140, 56)]
# rows (tokens x D) -> {form: the row counts timed}
ROWS = {
    (16, 128): {"parquet part": (1, 64), "safetensors": (100, 1000)},  # the tiny tower
    (324, 2048): {"parquet part": (1, 16), "safetensors": (10, 100)},  # the 3B tower, a 504x504 photo
}


def setup(n: int) -> tuple[pathlib.Path, pathlib.Path]:
    """(the tiny checkpoint, a folder of n images), built once under the bench cache."""
    from PIL import Image

    root = common.cache() / "faults"
    ckpt = root / "ckpt"
    if not ckpt.is_dir():
        code = (
            "import sys; from qwen_vit_jax.tools.demo import TINY, write_random_hf_checkpoint; "
            "from qwen_vit_jax.weights.convert import convert_checkpoint; "
            "convert_checkpoint(write_random_hf_checkpoint(TINY, sys.argv[1] + '/hf', seed=0), sys.argv[1] + '/ckpt')"
        )
        subprocess.run([sys.executable, "-c", code, str(root)], check=True, cwd=common.ROOT)
    images = root / f"images-{n}"
    if not images.is_dir():
        tmp = pathlib.Path(tempfile.mkdtemp(dir=root))
        rng = np.random.default_rng(0)
        for i in range(n):
            h, w = SIZES[i % len(SIZES)]
            Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(tmp / f"im{i:04d}.png")
        tmp.rename(images)
    return ckpt, images


def env() -> dict:
    return common.rev_env(
        common.ROOT, dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(common.cache() / "faults" / "jax"))
    )


def encode_cmd(ckpt, images, out, *extra) -> list[str]:
    return [sys.executable, "-m", "qwen_vit_jax.tools.cli", "encode", str(ckpt), str(images), "-o", str(out)] + [
        "--batch-patches",
        "64",
        *map(str, extra),
    ]


# ---- checkpoints --------------------------------------------------------------------------------
def checkpoint_costs(repeats: int, quick: bool) -> list[dict]:
    from qwen_vit_jax.data.embeddings import FORMAT, VERSION
    from qwen_vit_jax.data.sinks import open_sink

    meta = {"format": FORMAT, "version": VERSION, "checkpoint": "x", "dtype": "float32"}
    meta.update(preprocess={}, video_preprocess={})
    table = []
    for (tokens, dim), forms in list(ROWS.items())[:1] if quick else ROWS.items():
        label = f"{tokens} x {dim}"
        row = (np.ones(3, np.int64), np.random.default_rng(0).random((tokens, dim), np.float32), np.full(1, np.nan))
        for kind, counts in forms.items():
            for k in counts[:1] if quick else counts:
                times = []
                for _ in range(repeats + 1):  # the first warms up (imports, the writers' first use): dropped
                    d = pathlib.Path(tempfile.mkdtemp(prefix="qvj-bench-faults-"))
                    target = d / ("o.parquet" if kind == "parquet part" else "o.safetensors")
                    sink = open_sink(target, meta, dim, resume=False)
                    for i in range(k):
                        sink.add(f"k{i}", row, None)
                    t0 = time.perf_counter()
                    sink.checkpoint()
                    times.append(time.perf_counter() - t0)
                    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                    sink.abandon()
                    shutil.rmtree(d)
                t = statistics.median(times[1:])
                table.append({"row": label, "form": kind, "rows": k, "mb": size / 1e6, "ms": t * 1e3})
                log(f"checkpoint {label} {kind} {k} rows: {t * 1e3:.1f} ms")
    return table


# ---- --save-every 0 vs 600 ----------------------------------------------------------------------
def save_every(ckpt, images, repeats: int) -> dict:
    rates = {"0": [], "600": []}
    for r in range(repeats):
        for s in ("0", "600"):
            d = pathlib.Path(tempfile.mkdtemp(prefix="qvj-bench-faults-"))
            p = subprocess.run(
                encode_cmd(ckpt, images, d / "o.parquet", "--workers", "1", "--save-every", s),
                capture_output=True,
                text=True,
                env=env(),
                check=True,
            )
            rate = float(p.stdout.split(" inputs/s")[0].rsplit("(", 1)[1])
            rates[s].append(rate)
            log(f"--save-every {s} round {r}: {rate} inputs/s")
            shutil.rmtree(d)
    return {s: statistics.median(v) for s, v in rates.items()} | {"all": rates}


# ---- stops --------------------------------------------------------------------------------------
def _rows(out: pathlib.Path) -> tuple[int, int]:
    """(rows in OUT, rows in its completed parts)."""
    import pyarrow.parquet as pq

    from qwen_vit_jax.data import parquet

    held = pq.ParquetFile(out).metadata.num_rows if out.exists() else 0
    return held, sum(pq.ParquetFile(p).metadata.num_rows for p in parquet.part_files(out))


def stop(ckpt, images, n: int, sig: signal.Signals, workers: int) -> dict:
    from qwen_vit_jax.data import parquet

    d = pathlib.Path(tempfile.mkdtemp(prefix="qvj-bench-faults-"))
    out = d / "o.parquet"
    cmd = encode_cmd(ckpt, images, out, "--workers", workers, "--save-every", "0")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env(), start_new_session=True)
    while len(parquet.part_files(out)) < n // 2:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before the signal: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.01)
    checkpointed = len(parquet.part_files(out))  # one input per part
    t0 = time.perf_counter()
    os.kill(proc.pid, sig)
    proc.wait()  # (its stderr is a few lines: the pipe never fills)
    t_exit = time.perf_counter() - t0
    while session_pids(proc.pid):
        time.sleep(0.01)
    t_gone = time.perf_counter() - t0
    err = proc.stderr.read().decode()
    held, in_parts = _rows(out)
    left = [f.name for f in d.rglob("*") if f.name.endswith(".tmp")]
    shutil.rmtree(d)
    last = err.strip().splitlines()[-1] if err.strip() else ""
    return {
        "stop": {"SIGINT": "Ctrl-C (SIGINT)"}.get(sig.name, sig.name),
        "rc": proc.returncode,
        "exit_s": t_exit,
        "gone_s": t_gone,
        "checkpointed": checkpointed,
        "kept": held + in_parts,
        "tmp_left": len(left),
        "said": last[:160],
    }


FULL = r"""
import json, os, subprocess, sys, time
mount, kb, cmd = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kb}k", "tmpfs", mount], check=True)
t0 = time.perf_counter()
p = subprocess.run(cmd, capture_output=True, text=True)
files = {os.path.relpath(os.path.join(r, f), mount): os.path.getsize(os.path.join(r, f))
         for r, _, fs in os.walk(mount) for f in fs}
print(json.dumps({"rc": p.returncode, "s": time.perf_counter() - t0, "err": p.stderr, "files": files}))
"""


def full_disk(ckpt, images, kb: int) -> dict | None:
    if shutil.which("unshare") is None:
        return None
    d = pathlib.Path(tempfile.mkdtemp(prefix="qvj-bench-faults-"))
    out = d / "o.parquet"
    cmd = encode_cmd(ckpt, images, out, "--workers", "2", "--save-every", "0")
    for ns in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        inner = [*ns, sys.executable, "-c", FULL, str(d), str(kb), json.dumps(cmd)]
        p = subprocess.run(inner, capture_output=True, text=True, env=env())
        if p.returncode == 0:
            break
    else:
        log(f"full disk: no mount namespace here ({p.stderr.strip()[-200:]}): skipped")
        return None
    shutil.rmtree(d)
    r = json.loads(p.stdout)
    said = r["err"].strip().splitlines()[-1]
    kept = int(m[1]) if (m := re.search(r"keeps the (\d+) inputs? checkpointed", said)) else 0
    return {
        "stop": f"full disk ({kb} kB tmpfs)",
        "rc": r["rc"],
        "exit_s": r["s"],
        "kept": kept,
        "tmp_left": sum(1 for f in r["files"] if f.endswith(".tmp")),
        "bytes_left": sum(r["files"].values()),
        "said": said[:200],
    }


def run(args) -> dict:
    # A benchmark started in the background (`... &`) has SIGINT ignored, and its runs would inherit
    # that: a Python handler here is reset to the default in every child, as in a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    n, workers = (8, 1) if args.quick else (240, 2)
    ckpt, images = setup(n)
    fs = subprocess.run(["stat", "-f", "-c", "%T", tempfile.gettempdir()], capture_output=True, text=True).stdout
    warm = common.cache() / "faults" / "warm.npz"
    if not args.quick:  # the compilation cache warm: the stops then measure the run, not its compiles
        subprocess.run(encode_cmd(ckpt, images / "im0000.png", warm, "--overwrite"), env=env(), capture_output=True)
    out = {"n": n, "workers": workers, "repeats": args.repeats, "tmp": f"{tempfile.gettempdir()} ({fs.strip()})"}
    out["checkpoint"] = checkpoint_costs(args.repeats, args.quick)
    out["save_every"] = None if args.quick else save_every(ckpt, images, args.repeats)
    signals = (signal.SIGTERM,) if args.quick else (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
    out["stops"] = [stop(ckpt, images, n, s, workers) for s in signals]
    out["full"] = None if args.quick else full_disk(ckpt, images, args.disk_kb)
    return out


def said(stop: dict) -> str:
    """The run's last line of stderr, its temporary folder named OUT's."""
    return re.sub(r"/\S*qvj-bench-faults-\w+/o\.parquet", "OUT.parquet", stop["said"]).strip()


def report(result: dict) -> str:
    d, n = result["data"], result["data"]["n"]
    rows = [
        [s["stop"], s["rc"] if s["rc"] >= 0 else "killed", f"{s['exit_s']:.2f}", f"{s['gone_s']:.2f}"]
        + [f"{s['checkpointed']} of {n}", s["kept"], s["tmp_left"]]
        for s in d["stops"]
    ]
    if d.get("full"):
        f = d["full"]
        rows.append([f["stop"], f["rc"], f"{f['exit_s']:.1f} after the start", "at the error", "", f["kept"]])
        rows[-1].append(f"{f['tmp_left']} ({f['bytes_left'] / 1e3:,.0f} kB of parts on it)")
    text = (
        f"The demo's tiny tower, {n} small PNGs, a call each; a run (`--workers {d['workers']} --save-every 0 -o "
        f"OUT.parquet`) stopped once {n // 2} parts were checkpointed; temporary files in {d['tmp']}:\n\n"
        + markdown_table(
            ["stop", "exit", "signal -> exit s", "-> no process of the run left s", "checkpointed"]
            + ["inputs kept", "`.tmp` left"],
            rows,
        )  # fmt: skip
        + "\n\n"
        + "\n".join(
            f"- {s['stop']}, its last line: `{said(s)}`"
            for s in d["stops"] + ([d["full"]] if d.get("full") else [])
            if s["rc"] >= 0  # a killed run says nothing (its last line is the resource tracker's)
        )
    )
    rows = [[c["row"], c["form"], c["rows"], f"{c['mb']:.3f}", f"{c['ms']:.1f}"] for c in d["checkpoint"]]
    text += f"\n\nA save, median of {d['repeats']}, one process (`open_sink`, then `checkpoint()`):\n\n"
    text += markdown_table(["row (tokens x D)", "form", "rows", "MB written", "ms"], rows)
    if d.get("save_every"):
        se = d["save_every"]
        text += (
            f"\n\n`--save-every 0` (a part per input) vs 600 on {n} inputs, `--workers 1`, alternating: "
            f"{se['0']:.3g} vs {se['600']:.3g} inputs/s (**{se['0'] / se['600']:.2f}x**; rounds {se['all']})."
        )
    return text


WORKERS: dict = {}
