"""Encode the images of parquet files with Ray Data: parquet in, parquet out.

    python examples/ray_encode.py CKPT data/ -o emb/ --encoders 4 --num-gpus 1   # join a Ray cluster
    python examples/ray_encode.py CKPT images.parquet -o emb/ --cpus 8          # a local Ray

Two stages, each scaled on its own (pip install 'qwen_vit_jax[ray]'): `qvj.ray.preprocess` decodes,
resizes and cuts the images into uint8 patches in CPU tasks; `--encoders` actors of `qvj.ray.Encoder`
turn them into embeddings, one per GPU with `--num-gpus 1`. For TPU hosts, `--tpus 4`: resources=
{"TPU": 4} instead of num_gpus (an Encoder shares each call across all of its actor's devices).
OUT_DIR gets Ray's parquet files: every input column but the image, plus `grid_thw` and `embedding`
(list<fixed_size_list<float32, D>>).

Use this when the data or the cluster already live in Ray: many independent accelerator hosts, a
heterogeneous or autoscaling cluster, spot instances. For one machine or one multi-host slice,
`qwen-vit-jax encode` does more (videos, webdataset and HF datasets, --resume, --cache, one
output file): see docs/scale.md.
"""

from __future__ import annotations

import argparse
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", metavar="CKPT", help="converted dir, HF checkpoint dir or hub id in the local cache")
    p.add_argument("inputs", metavar="INPUT", nargs="+", help="parquet files or folders (local paths or URIs)")
    p.add_argument("-o", "--output", metavar="OUT_DIR", required=True, help="folder Ray writes parquet files to")
    p.add_argument("--image-column", default="image", metavar="NAME", help="column of image bytes (default image)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="(default float32)")
    p.add_argument("--encoders", type=int, default=1, metavar="N", help="encoder actors (default 1)")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--num-gpus", type=float, default=0, metavar="G", help="GPUs per encoder actor (default 0)")
    dev.add_argument("--tpus", type=int, metavar="T", help='TPU chips per encoder actor: resources={"TPU": T}')
    p.add_argument("--batch-size", type=int, default=64, metavar="B", help="rows per batch, both stages (default 64)")
    p.add_argument("--cpus", type=int, metavar="N", help="start a local Ray with N CPUs (default: join RAY_ADDRESS)")
    p.add_argument("--compile-cache", metavar="DIR", help="JAX's persistent compilation cache, shared by the actors")
    return p.parse_args(argv)


def count_rows(path: str) -> int:
    """Rows of the parquet files under `path` (their footers only); 0 when there is none yet."""
    import pyarrow.dataset as pads

    try:
        return pads.dataset(path, format="parquet").count_rows()
    except FileNotFoundError:
        return 0


def main(argv=None) -> None:
    args = parse_args(argv)
    import ray

    import qwen_vit_jax as qvj

    if args.cpus:
        ray.init(num_cpus=args.cpus)  # a local Ray, started and stopped by this script
    else:
        ray.init()  # the cluster of RAY_ADDRESS, or the one running on this machine
    accel = {"resources": {"TPU": args.tpus}} if args.tpus else {"num_gpus": args.num_gpus}
    before, t0 = count_rows(args.output), time.perf_counter()

    ds = ray.data.read_parquet(args.inputs)
    ds = ds.map_batches(  # CPU tasks: decode, resize, uint8 patches (qvj_patches) and grid_thw
        qvj.ray.preprocess,
        fn_kwargs={"checkpoint": args.checkpoint, "image_column": args.image_column},
        batch_format="pyarrow",
        batch_size=args.batch_size,
    )
    ds = ds.map_batches(  # accelerator actors: qvj_patches -> embedding; each loads and compiles once
        qvj.ray.Encoder,
        fn_constructor_kwargs={
            "checkpoint": args.checkpoint,
            "dtype": args.dtype,
            "image_column": args.image_column,
            "compile_cache": args.compile_cache,
        },
        compute=ray.data.ActorPoolStrategy(size=args.encoders),  # concurrency=N before Ray 2.51
        batch_size=args.batch_size,
        batch_format="pyarrow",
        **accel,
    )
    ds = ds.drop_columns([args.image_column])  # the image bytes are not written back; every other column is
    ds.write_parquet(args.output)

    rows = count_rows(args.output) - before
    print(f"wrote {rows:,} rows to {args.output} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
