"""Datasets at scale on the host-bound tiny tower: 10,000 small JPEGs in a parquet file through
`qwen-vit-jax encode --workers 2` and through Ray Data (local, 2 CPUs); the CLI's peak RSS at 1,000
vs 10,000 inputs (parquet output is written as it goes: it must be flat); what a `--cache` hit costs.

    python -m benchmarks dataset                   # 10,000 inputs (RSS: 1,000 vs 10,000)
    python -m benchmarks dataset --n 2000 --skip-ray --repeats 3   # (RSS: 200 vs 2,000)
    python -m benchmarks dataset --quick           # 16 inputs, --workers 0, the --cache runs only

Inputs (written once under the bench cache, QVJ_BENCH_CACHE): parquet files of N and M (--n-small) JPEGs
(quality 90), sizes 64..160 px a side, each row a gradient plus noise from its own seed (row i is the
same image in every file: the small file is the big one's first rows), columns `image` (binary, the
JPEG bytes) and `id` (string), row groups of 256 rows (pyarrow). The tower: common.py's
`host_bound_checkpoint` (one window-attention block, width 32, random weights), float32.

  CLI        `qwen-vit-jax encode CKPT data.parquet -o OUT.parquet --workers 2 --overwrite` in a fresh
             process (`python -c` calling qwen_vit_jax.tools.cli.main, what `python -m
             qwen_vit_jax.tools.cli` runs, then printing getrusage: every run gives its peak RSS),
             with the default keys (FILE.parquet:ROW) and with --key-column id: images/s over the
             encode seconds of its summary line (N / its inputs/s: 3 digits) and over the whole
             process's wall time (imports, listing, compiles, worker start-up included)
  Ray        one process: ray.init(num_cpus=2) (timed apart), then read_parquet -> map_batches(
             qvj.ray.preprocess, pyarrow batches of 64) -> map_batches(qvj.ray.Encoder, one actor,
             batches of 64) -> write_parquet, timed from before read_parquet to after the write;
             its embeddings are compared with the CLI's (--key-column id) by id: max abs difference
             (and over max |embedding|). Ray 2.60 fuses the two map_batches into one actor stage
             (its log: MapBatches(preprocess)->MapBatches(Encoder)): the decode runs in that actor
  RSS        the CLI at M inputs and (the default-keys run above) N: ru_maxrss of the main process
             (RUSAGE_SELF) and of its children (RUSAGE_CHILDREN: the largest Grain worker process),
             MB and the ratio; the two encode times also give the cost per input past start-up
             (worker spawn, compiles): (seconds at N - seconds at M) / (N - M)
  cache      the CLI with --cache DIR on the N inputs twice (a fresh DIR: every input encoded and
             stored, then every input a hit, checked on the summary's "C from the cache"), then on
             the M inputs (the N's first rows: every one a hit): encode seconds per input of each
             run, next to the run without --cache, and past start-up as above; and
             `EmbeddingCache.get` alone in one process over the N entries (ms per hit), `put` alone
             (up to 200 entries into a scratch DIR: fsync and rename each)

With --repeats R every measurement runs R times (fresh processes; the cache runs from a fresh DIR
each time) and the tables show medians.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks import common
from benchmarks.common import log, markdown_table, run_worker

DEFAULTS = {"repeats": (1, 1)}
ROWS_PER_GROUP = 256
RAY_CPUS = 2
RAY_BATCH = 64
SIDE = (64, 160)  # image sides in pixels, inclusive
SEED = 0
SUMMARY = re.compile(
    r"encoded ([\d,]+) inputs? \(([\d,]+) tokens x (\d+)\) in ([\d.]+) s \(([\d.e+-]+) inputs/s.*?(\d+)% of it waiting"
    r".*?(\d+) program\(s\) compiled in ([\d.]+) s"
)
COUNTS = re.compile(r"([\d,]+) encoded, ([\d,]+) reused \(.*?\), ([\d,]+) from the cache")
RSS_TAG = "QVJ_RSS "
RSS_WRAPPER = f"""
import json, resource, sys
from qwen_vit_jax.tools.cli import main
code = main(sys.argv[1:])
kb = lambda who: resource.getrusage(who).ru_maxrss  # KiB on Linux
print({RSS_TAG!r} + json.dumps({{"self_kb": kb(resource.RUSAGE_SELF), "children_kb": kb(resource.RUSAGE_CHILDREN)}}))
sys.exit(code)
"""


# ---- inputs (PIL and pyarrow: no jax) --------------------------------------------------------------
def image_bytes(i: int) -> bytes:
    """Row i's JPEG: a colour gradient plus noise, its size and content from the seed (SEED, i)."""
    import io

    from PIL import Image

    rng = np.random.default_rng([SEED, i])
    w, h = (int(x) for x in rng.integers(SIDE[0], SIDE[1] + 1, 2))
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    a, b, c = rng.uniform(-1.5, 1.5, (3, 3)).astype(np.float32)  # x slope, y slope, offset of each channel
    img = np.stack([128 + 100 * np.tanh(a[k] * (x / w - 0.5) + b[k] * (y / h - 0.5) + c[k]) for k in range(3)], -1)
    img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def dataset(n: int) -> pathlib.Path:
    """DATA/images-N.parquet (written once, atomically): rows 0 .. n-1, columns image and id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = common.cache() / "dataset_inputs" / f"images-{n}.parquet"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"writing {path} ({n:,} JPEGs)")
    schema = pa.schema([pa.field("image", pa.binary()), pa.field("id", pa.string())])
    tmp = path.with_name(path.name + ".tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, n, ROWS_PER_GROUP):
            rows = range(start, min(start + ROWS_PER_GROUP, n))
            table = pa.table({"image": [image_bytes(i) for i in rows], "id": [f"img-{i:06d}" for i in rows]}, schema)
            writer.write_table(table, row_group_size=ROWS_PER_GROUP)
    tmp.rename(path)
    return path


def embeddings_by(path: str | os.PathLike, key: str) -> dict[str, np.ndarray]:
    """key column value -> float32 [tokens, D] of a parquet file or folder with an `embedding`
    column (list<fixed_size_list<float32, D>>: the CLI's and qvj.ray.Encoder's)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=[key, "embedding"])
    keys = table.column(key).to_pylist()
    col = table.column("embedding").combine_chunks()
    offsets = np.asarray(col.offsets, np.int64)
    tokens = col.flatten()
    flat = np.asarray(tokens.flatten(), np.float32).reshape(-1, tokens.type.list_size)
    offsets = offsets - offsets[0]
    return {k: flat[offsets[i] : offsets[i + 1]] for i, k in enumerate(keys)}


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict:
    """Max abs difference over the keys of both (shapes must agree)."""
    common = sorted(a.keys() & b.keys())
    worst, ref, shapes_differ, differ = 0.0, 0.0, 0, 0
    for k in common:
        if a[k].shape != b[k].shape:
            shapes_differ += 1
            continue
        d = float(np.abs(a[k] - b[k]).max(initial=0.0))
        worst, ref, differ = max(worst, d), max(ref, float(np.abs(b[k]).max(initial=0.0))), differ + (d > 0)
    return {
        "keys_a": len(a),
        "keys_b": len(b),
        "common": len(common),
        "shapes_differ": shapes_differ,
        "rows_differ": differ,
        "max_abs": worst,
        "max_ref": ref,
        "max_rel": worst / max(ref, 1e-30),
    }


# ---- workers ------------------------------------------------------------------------------------------
def ray_run(p: dict) -> dict:
    """Worker: ray.init, then the Ray Data pipeline of qvj.ray's docstring on p["data"] into p["out"]."""
    t0 = time.perf_counter()
    import ray

    ray.init(address="local", num_cpus=p["cpus"], include_dashboard=False, log_to_driver=False)
    t_init = time.perf_counter() - t0
    try:
        import ray.data

        import qwen_vit_jax as qvj

        ray.data.DataContext.get_current().enable_progress_bars = False
        shutil.rmtree(p["out"], ignore_errors=True)
        ckpt, batch = p["ckpt"], p["batch"]
        t1 = time.perf_counter()
        ds = ray.data.read_parquet(p["data"])
        ds = ds.map_batches(
            qvj.ray.preprocess, fn_kwargs={"checkpoint": ckpt}, batch_format="pyarrow", batch_size=batch
        )
        ds = ds.map_batches(
            qvj.ray.Encoder,
            fn_constructor_kwargs={"checkpoint": ckpt},
            concurrency=1,
            batch_size=batch,
            batch_format="pyarrow",
        )
        ds.write_parquet(p["out"])
        seconds = time.perf_counter() - t1
    finally:
        ray.shutdown()
    import pyarrow.parquet as pq

    n = pq.read_table(p["out"], columns=["id"]).num_rows
    return {"init_s": t_init, "seconds": seconds, "rows": n, "ray": ray.__version__}


def cache_get(p: dict) -> dict:
    """Worker: EmbeddingCache.get alone over every input's entry (under the key `encode --cache`
    files an image under: the checkpoint's fingerprint, the run's dtype, the encoder's preprocessing):
    ms per hit, median of repeats."""
    import pyarrow.parquet as pq

    import qwen_vit_jax as qvj
    from qwen_vit_jax.data.cache import ContentCache, EmbeddingCache, checkpoint_fingerprint
    from qwen_vit_jax.data.parquet import read_metadata
    from qwen_vit_jax.weights.sources import resolve_source

    dtype = read_metadata(p["out"])["dtype"]
    prep = qvj.VisionEncoder.from_pretrained(p["ckpt"], dtype=dtype).preprocessing
    contents = ContentCache(p["cache"], checkpoint_fingerprint(resolve_source(p["ckpt"]).path), dtype)
    cache = EmbeddingCache(p["cache"], contents.key("image", prep))
    digests = [hashlib.sha256(b).hexdigest() for b in pq.read_table(p["data"], columns=["image"]).column(0).to_pylist()]
    times = []
    for _ in range(p["repeats"]):
        cache.hits = cache.misses = 0
        t0 = time.perf_counter()
        for d in digests:
            cache.get(d)
        times.append(time.perf_counter() - t0)
        if cache.hits != len(digests):
            raise RuntimeError(f"{cache.hits} hits of {len(digests)} lookups ({cache.corrupt} corrupt) in {cache.dir}")
    rows = [cache.get(d) for d in digests[:200]]
    scratch = EmbeddingCache(p["scratch"], "0" * 64)
    t0 = time.perf_counter()
    for d, (grid, emb, stamps) in zip(digests, rows):
        scratch.put(d, grid, emb, stamps)
    put = (time.perf_counter() - t0) / len(rows)
    shutil.rmtree(p["scratch"], ignore_errors=True)
    return {
        "entries": len(digests),
        "ms_per_hit": 1e3 * statistics.median(times) / len(digests),
        "times": times,
        "puts": len(rows),
        "ms_per_put": 1e3 * put,
    }


# ---- the CLI, in subprocesses ------------------------------------------------------------------------
def _env() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu")


def cli(ckpt: str, data: pathlib.Path, out: pathlib.Path, workers: int, *extra: str) -> dict:
    """One `encode` run (a fresh process: the CLI's main() under RSS_WRAPPER): its summary, wall
    seconds and the peak RSS of the main process and of its children."""
    args = ["encode", ckpt, str(data), "-o", str(out), "--workers", str(workers), "--overwrite", *extra]
    t0 = time.perf_counter()
    cmd = [sys.executable, "-c", RSS_WRAPPER, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=common.ROOT, check=False)
    wall = time.perf_counter() - t0
    m, c = SUMMARY.search(proc.stdout), COUNTS.search(proc.stdout)
    if proc.returncode or m is None or c is None:
        raise RuntimeError(
            f"encode {' '.join(extra)} failed (exit {proc.returncode}): {proc.stdout[-1500:]} {proc.stderr[-3000:]}"
        )
    n, rate = int(m[1].replace(",", "")), float(m[5])
    res = {
        "inputs": n,
        "tokens": int(m[2].replace(",", "")),
        "dim": int(m[3]),
        "encode_s_printed": float(m[4]),
        "encode_s": n / rate,  # the printed inputs/s has 3 digits, the seconds 1 decimal
        "images_per_s": rate,
        "waiting": int(m[6]) / 100,
        "programs": int(m[7]),
        "compile_s": float(m[8]),
        "wall_s": wall,
        "encoded": int(c[1].replace(",", "")),
        "reused": int(c[2].replace(",", "")),
        "cached": int(c[3].replace(",", "")),
    }
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(RSS_TAG))
    kb = json.loads(line[len(RSS_TAG) :])
    res |= {"rss_self_mb": kb["self_kb"] / 1024, "rss_children_mb": kb["children_kb"] / 1024}
    log(
        f"  encode {data.name} {' '.join(extra)}: {n:,} inputs in {res['encode_s']:.2f} s ({rate:.3g}/s), "
        f"wall {wall:.1f} s, RSS {res['rss_self_mb']:.0f} MB (children {res['rss_children_mb']:.0f} MB)"
    )
    return res


def _median(runs: list[dict]) -> dict:
    """Every number's median over the runs (the first run's other values)."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = statistics.median(r[k] for r in runs)
    return out | {"runs": len(runs)}


# ---- the parent -------------------------------------------------------------------------------------
def add_args(p) -> None:
    p.add_argument("--n", type=int, help="inputs N (default 10,000; --quick 16)")
    p.add_argument("--n-small", type=int, help="the smaller run M, RSS vs N (default 1,000; N / 10 with --n)")
    p.add_argument("--workers", type=int, help="`encode --workers` (default 2; --quick 0)")
    p.add_argument("--skip-ray", action="store_true", help="no Ray Data run (--quick: none)")


def run(args) -> dict:
    n = args.n or (16 if args.quick else 10_000)
    n_small = args.n_small or max(n // 10, 1)
    workers = args.workers if args.workers is not None else (0 if args.quick else 2)
    if n < 2 or not 0 < n_small < n:
        raise SystemExit("dataset: --n must be at least 2, --n-small in 1 .. N - 1")
    big, small = dataset(n), dataset(n_small)
    ckpt = common.host_bound_checkpoint()
    work = common.cache() / "dataset_out"
    work.mkdir(parents=True, exist_ok=True)
    out = lambda name: work / f"{name}-{n}.parquet"  # noqa: E731
    res: dict = {"n": n, "n_small": n_small, "data_bytes": big.stat().st_size, "workers": workers}
    res["repeats"] = args.repeats

    log(f"CLI, --workers {workers}, {n:,} inputs")
    runs = {"default keys": [], "--key-column id": []}
    for _ in range(0 if args.quick else args.repeats):  # quick: the --cache runs below are the CLI's
        runs["default keys"].append(cli(ckpt, big, out("cli"), workers))
        runs["--key-column id"].append(cli(ckpt, big, out("cli-id"), workers, "--key-column", "id"))
    if not args.quick:
        res["cli"] = {k: _median(v) for k, v in runs.items()}
        by_row = embeddings_by(out("cli"), "key")
        by_id = embeddings_by(out("cli-id"), "key")
        ids = [f"img-{i:06d}" for i in range(n)]
        res["cli_keys_agree"] = compare({ids[int(k.rsplit(":", 1)[1])]: v for k, v in by_row.items()}, by_id)
    if not (args.skip_ray or args.quick):
        log(f"Ray Data, local, {RAY_CPUS} CPUs")
        payload = {"data": str(big), "ckpt": ckpt, "out": str(work / f"ray-{n}"), "cpus": RAY_CPUS, "batch": RAY_BATCH}
        rr = [run_worker(__name__, "ray", payload, env=_env()) for _ in range(args.repeats)]
        res["ray"] = _median(rr)
        res["ray"]["images_per_s"] = n / res["ray"]["seconds"]
        res["ray_vs_cli"] = compare(embeddings_by(payload["out"], "id"), by_id)
    if not args.quick:
        log(f"peak RSS, {n_small:,} inputs (against the {n:,}-input run above)")
        at_small = [cli(ckpt, small, out(f"rss-{n_small}"), workers) for _ in range(args.repeats)]
        res["rss"] = {str(n_small): _median(at_small), str(n): res["cli"]["default keys"]}

    log("--cache: a fresh cache, then every input a hit")
    cache_dir = work / f"cache-{n}"
    first, second, third, gets = [], [], [], []
    for _ in range(args.repeats):
        shutil.rmtree(cache_dir, ignore_errors=True)
        first.append(cli(ckpt, big, out("cache-1"), workers, "--cache", str(cache_dir)))
        second.append(cli(ckpt, big, out("cache-2"), workers, "--cache", str(cache_dir)))
        checks = [("first", first[-1], "encoded", n), ("second", second[-1], "cached", n)]
        if not args.quick:
            third.append(cli(ckpt, small, out("cache-3"), workers, "--cache", str(cache_dir)))
            checks.append(("third", third[-1], "cached", n_small))
        for what, r, want, m in checks:
            if r[want] != m:
                raise RuntimeError(f"--cache {what} run: {r[want]} of {m} inputs {want} ({r})")
        payload = {"cache": str(cache_dir), "ckpt": ckpt, "data": str(big), "out": str(out("cache-1")), "repeats": 3}
        payload["scratch"] = str(work / "cache-put-scratch")
        gets.append(run_worker(__name__, "cache_get", payload, env=_env()))
    res["cache"] = {"first": _median(first), "second": _median(second), "get": _median(gets)}
    if args.quick:
        res["cli"] = {"default keys, `--cache` fresh": res["cache"]["first"]}
        by_row = embeddings_by(out("cache-1"), "key")
    if third:
        res["cache"]["small"] = _median(third)
        res["past_start_up_ms"] = {  # per input, from the M- and N-input runs' encode seconds
            "encoded": _marginal(res["rss"][str(n_small)], res["rss"][str(n)], n - n_small),
            "cache_hit": _marginal(res["cache"]["small"], res["cache"]["second"], n - n_small),
        }
    res["cache_vs_cli"] = compare(embeddings_by(out("cache-2"), "key"), by_row)
    return res


def _marginal(at_small: dict, at_big: dict, extra: int) -> float:
    """ms per input past start-up: the encode seconds' difference over the extra inputs."""
    return 1e3 * (at_big["encode_s"] - at_small["encode_s"]) / extra


def report(result: dict) -> str:
    res = result["data"]
    n, small = res["n"], res["n_small"]
    mb = res["data_bytes"] / 1e6
    lines = [
        f"{n:,} JPEGs ({SIDE[0]}..{SIDE[1]} px a side, {mb:.1f} MB of parquet, an `image` and an `id` column, row "
        f"groups of {ROWS_PER_GROUP}), the host-bound tiny tower, float32; each row a fresh process; medians of "
        f"{res['repeats']} run(s).",
        "",
    ]
    rows = []
    for label, r in res["cli"].items():
        rows.append(
            [
                f"CLI --workers {res['workers']}, {label}",
                f"{r['encode_s']:.2f}",
                f"{r['images_per_s']:.1f}",
                f"{r['wall_s']:.2f}",
                f"{n / r['wall_s']:.1f}",
                f"{r['waiting']:.0%}",
                f"{r['programs']} in {r['compile_s']:.1f} s",
            ]
        )
    if "ray" in res:
        r = res["ray"]
        rows.append(
            [
                f"Ray Data local, {RAY_CPUS} CPUs (ray.init {r['init_s']:.1f} s apart)",
                f"{r['seconds']:.2f}",
                f"{r['images_per_s']:.1f}",
                f"{r['seconds'] + r['init_s']:.2f} (+ init)",
                f"{n / (r['seconds'] + r['init_s']):.1f}",
                "-",
                "-",
            ]
        )
    head = ["run", "encode s", "images/s", "wall s", "images/s (wall)", "waiting for inputs", "compiles"]
    lines.append(markdown_table(head, rows))
    if "cli_keys_agree" in res:
        k = res["cli_keys_agree"]
        lines.append(
            f"\nCLI default keys vs --key-column id: {k['common']:,} of {n:,} rows matched, max abs diff "
            f"{k['max_abs']:.2e}."
        )
    if "ray_vs_cli" in res:
        c = res["ray_vs_cli"]
        whole = c["common"] == n and c["shapes_differ"] == 0
        yes = lambda ok: "yes" if whole and ok else "NO"  # noqa: E731
        lines.append(
            f"Ray vs CLI (--key-column id), by id: {c['common']:,} of {n:,} ids in both, {c['shapes_differ']} shapes "
            f"differ, {c['rows_differ']:,} rows not bit-identical; max abs diff {c['max_abs']:.2e} (<= 1e-6: "
            f"{yes(c['max_abs'] <= 1e-6)}), over max |embedding| {c['max_ref']:.3g}: {c['max_rel']:.2e} "
            f"(<= 1e-6: {yes(c['max_rel'] <= 1e-6)})"
        )
    if "rss" in res:
        lines += ["", f"Peak RSS of `encode -o OUT.parquet --workers {res['workers']}` (ru_maxrss):", ""]
        a, b = res["rss"][str(small)], res["rss"][str(n)]
        rows = [
            [f"{x:,}", f"{r['rss_self_mb']:.0f}", f"{r['rss_children_mb']:.0f}", f"{r['encode_s']:.2f}", r["programs"]]
            for x, r in ((small, a), (n, b))
        ]
        ratio = [
            f"{b['rss_self_mb'] / a['rss_self_mb']:.2f}",
            f"{b['rss_children_mb'] / max(a['rss_children_mb'], 1e-9):.2f}",
        ]
        rows.append([f"ratio {n:,} / {small:,}", *ratio, "", ""])
        lines.append(markdown_table(["inputs", "main process MB", "largest child MB", "encode s", "programs"], rows))
    c = res["cache"]
    lines += ["", f"`--cache DIR`, {n:,} inputs (per input: encode seconds / inputs):", ""]
    runs = [("no `--cache`", res["cli"]["default keys"], "encoded", n)] if "default keys" in res["cli"] else []
    runs += [("`--cache`, fresh DIR", c["first"], "encoded", n)]
    runs += [("`--cache`, again", c["second"], "cached", n)]
    if "small" in c:
        runs.append((f"`--cache`, again, the first {small:,} rows", c["small"], "cached", small))
    what = {"encoded": "encoded", "cached": "from the cache"}
    rows = [
        [label, f"{r[k]:,} {what[k]}", f"{r['encode_s']:.2f}", f"{1e3 * r['encode_s'] / m:.2f}"]
        for label, r, k, m in runs
    ]
    rows.append(["`EmbeddingCache.get` alone", f"{c['get']['entries']:,} hits", "", f"{c['get']['ms_per_hit']:.2f}"])
    rows.append(["`EmbeddingCache.put` alone", f"{c['get']['puts']:,} entries", "", f"{c['get']['ms_per_put']:.2f}"])
    lines.append(markdown_table(["run", "inputs", "encode s", "ms per input"], rows))
    v = res["cache_vs_cli"]
    last = f"\nCached run vs no `--cache`: {v['common']:,} keys, max abs diff {v['max_abs']:.2e}."
    if "past_start_up_ms" in res:
        per = res["past_start_up_ms"]
        last += (
            f" Past start-up ((encode s at {n:,} - at {small:,}) / {n - small:,}): {per['encoded']:.2f} ms per input "
            f"encoded, {per['cache_hit']:.2f} ms per cache hit (a hit is still read, decoded and cut into patches by "
            "the workers)."
        )
    return "\n".join([*lines, last])


WORKERS = {"ray": ray_run, "cache_get": cache_get}
