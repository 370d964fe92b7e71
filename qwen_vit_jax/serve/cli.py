"""`qwen-vit-jax serve CKPT`: the subcommand's flags (`add_parser`) and its run (`run`). Building the
parser imports no jax and no web framework (the CLI's --help stays light).

    qwen-vit-jax serve q3b --max-batch-patches 8192 --max-wait-ms 5 --declare 36x36 --cache ~/.cache/qvj-emb
    { printf '{"input": [{"image": "'; base64 < cat.jpg | tr -d '\\n'; printf '"}]}'; } > body.json
    curl -s localhost:8000/v1/embeddings -H 'Content-Type: application/json' --data-binary @body.json

SIGTERM (and Ctrl-C) stop accepting, answer what is in flight and exit (uvicorn's graceful
shutdown): 0 after a SIGTERM, 130 after a Ctrl-C, as every command.
"""

from __future__ import annotations

import argparse

from qwen_vit_jax.config import parse_sizes
from qwen_vit_jax.data.workers import default_workers
from qwen_vit_jax.serve.settings import Settings
from qwen_vit_jax.vllm import flags as vllm_flags

SERVE_HELP = """\
Serve the tower over HTTP: POST /v1/embeddings takes images and videos as bytes (base64 or data:
URLs in JSON; no path or URL is ever opened) and answers their embeddings, in the shape of OpenAI's
embeddings API (or, with Accept: application/vnd.safetensors, the file qvj.read_embeddings reads).
Items of concurrent requests are prepared in worker processes and batched into the encoder's
buckets: a batch leaves when --max-batch-patches is full or its oldest item waited --max-wait-ms.
An identical item is encoded once (in flight, the in-memory LRU, --cache DIR on disk: the format of
`encode --cache`). GET /healthz (alive), /readyz (loaded and the --declare sizes compiled, with
--warmup-batches their batch shapes too), /metrics (Prometheus). Binding anything but loopback
requires --api-key-file.

Strangers are expected: a request head must arrive whole within --header-timeout, and a body may not
pause longer (408); sockets that send no head never keep a client out (one that sends a head takes
the slot of the oldest that has not); an item costs at most --max-item-patches per frame (a larger
image is resized down to it, or refused with --oversize refuse); nothing is opened by name.
"""


def add_parser(subparsers, formatter_class=argparse.RawDescriptionHelpFormatter) -> argparse.ArgumentParser:
    """Add `serve` to the CLI's subparsers; its func is `run`."""
    p = subparsers.add_parser(
        "serve",
        formatter_class=formatter_class,
        help="an HTTP embeddings service with dynamic batching, a cache and metrics",
        description=SERVE_HELP,
        epilog="example: qwen-vit-jax serve q3b --declare 36x36 --max-wait-ms 5 --cache ~/.cache/qvj-emb",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="converted dir, HF checkpoint dir or hub id in the local cache")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need a key)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument(
        "--max-batch-patches", type=int, metavar="N", help="patches per device call (default: a full bucket, 16384)"
    )
    p.add_argument("--max-wait-ms", type=float, default=5.0, metavar="M", help="a batch's longest wait (default 5)")
    p.add_argument(
        "--max-queue", type=int, default=256, metavar="ITEMS", help="items queued at most; past it 429 (default 256)"
    )
    p.add_argument("--cache", metavar="DIR", help="content-hash cache directory (the format of encode --cache)")
    p.add_argument(
        "--cache-mb", type=int, default=256, metavar="MB", help="in-memory LRU of embeddings, MiB (default 256; 0 off)"
    )
    p.add_argument("--api-key-file", metavar="FILE", help="bearer token clients must send (its first line)")
    p.add_argument("--declare", metavar="SIZES", help="sizes to compile and declare before ready: 36x36,2x24x24")
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="preparation worker processes (default: cores - 1, at least 1; 0: a thread)",
    )
    p.add_argument("--max-items", type=int, default=64, help="items per request at most (default 64; 413 past)")
    p.add_argument("--max-body-mb", type=int, default=64, help="request body MiB at most (default 64; 413 past)")
    p.add_argument(
        "--max-image-pixels", type=int, default=50_000_000, help="pixels per image at most (default 50M; 413 past)"
    )
    p.add_argument(
        "--max-item-patches",
        type=int,
        metavar="N",
        help="patches per image or video frame at most (default: the patch budget of one device call)",
    )
    p.add_argument(
        "--oversize",
        choices=("resize", "refuse"),
        default="resize",
        help="an image over --max-item-patches: resized down keeping its aspect (default) or refused (413)",
    )
    p.add_argument(
        "--max-frames", type=int, metavar="N", help="frames per video at most (default: the checkpoint's max_frames)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take (default 60; 504 past)")
    p.add_argument(
        "--max-connections",
        type=int,
        default=512,
        help="open connections at most; one without a request head makes room, else 503 (default 512)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to send a whole request head, and the longest pause in a body (default 10; 408 past)",
    )
    p.add_argument(
        "--keep-alive",
        type=float,
        default=30.0,
        metavar="S",
        help="idle connections close after S seconds (default 30)",
    )
    p.add_argument("--compile-cache", metavar="DIR", help="JAX's persistent compilation cache directory")
    p.add_argument(
        "--warmup-batches",
        action=argparse.BooleanOptionalAction,
        help="compile the batch shapes of the --declare sizes before ready (default: on with --compile-cache)",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    vllm_flags.add_flags(p.add_argument_group("vLLM's encoder-cache store (docs/vllm.md)"))
    p.set_defaults(func=run)
    return p


def settings_from(args) -> Settings:
    return Settings(
        checkpoint=args.checkpoint,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        max_batch_patches=args.max_batch_patches,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        cache=args.cache,
        cache_bytes=args.cache_mb << 20,
        api_key_file=args.api_key_file,
        declare=parse_sizes(args.declare, "--declare") if args.declare else (),
        workers=default_workers() if args.workers is None else args.workers,
        max_items=args.max_items,
        max_body_bytes=args.max_body_mb << 20,
        max_image_pixels=args.max_image_pixels,
        max_item_patches=args.max_item_patches,
        oversize=args.oversize,
        max_frames=args.max_frames,
        request_timeout_s=args.timeout,
        max_connections=args.max_connections,
        keep_alive_s=args.keep_alive,
        header_timeout_s=args.header_timeout,
        compile_cache=args.compile_cache,
        warmup_batches=args.warmup_batches,
        vllm_store=args.vllm_store,
        vllm_ids=args.vllm_ids,
        vllm_model=args.vllm_model,
    )


def run(args) -> int:
    """Serve until SIGTERM / Ctrl-C; every bad flag, a missing checkpoint or key file is a ValueError /
    OSError (the CLI's `error: ...` line) before anything listens."""
    import logging
    import threading
    import time

    settings = settings_from(args)
    from qwen_vit_jax.weights.sources import resolve_source

    resolve_source(settings.checkpoint)  # a missing checkpoint fails here, not in the background load
    try:
        import uvicorn

        from qwen_vit_jax.serve.asgi import create_app
        from qwen_vit_jax.serve.connections import uvicorn_config
    except ImportError as e:
        raise ValueError(f"serve needs the serve extra: pip install 'qwen_vit_jax[serve]' ({e})") from None

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    app = create_app(settings)
    server = uvicorn.Server(uvicorn_config(app, settings, log_level=args.log_level))
    service = app.state.service

    def stop_if_load_fails() -> None:  # a server that can never be ready exits (the error below)
        while not (server.should_exit or service.ready):
            if service.error is not None:
                server.should_exit = True
                return
            time.sleep(0.2)

    threading.Thread(target=stop_if_load_fails, name="qvj-load-watch", daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt as e:
        # uvicorn re-raises the signal it shut down for once it has drained; the CLI turned SIGTERM
        # into KeyboardInterrupt("signal SIGTERM"): a drained SIGTERM is a clean exit.
        if str(e).startswith("signal SIGTERM"):
            return 0
        raise
    if service.error is not None:
        raise ValueError(f"cannot serve {settings.checkpoint}: {service.error}")
    return 0 if server.started else 1
