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
import dataclasses

from qwen_vit_jax.serve.settings import Settings

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

Strangers are expected: a request head must arrive whole within --header-timeout and hold at most
--max-head-kb (408, 431), a body may not pause longer (408) and an answer may not be left unread
longer (cut off); sockets that send no head never keep a client out (one that sends a head takes
the slot of the oldest that has not), and one address reads at most --max-peer-bodies bodies at
once (429); an item costs at most --max-item-patches per frame (a larger image is resized down to
it, or refused with --oversize refuse); images come in JPEG, PNG, WebP, GIF, BMP, TIFF or PNM (415
otherwise), sized from their headers; nothing is opened by name. Settings that contradict each
other are refused before anything listens.
"""


def add_parser(subparsers, formatter_class=argparse.RawDescriptionHelpFormatter) -> argparse.ArgumentParser:
    """Add `serve` to the CLI's subparsers; its func is `run`. Every flag but --log-level is a
    Settings field's (its metadata: flag, help, unit; its default: the field's)."""
    p = subparsers.add_parser(
        "serve",
        formatter_class=formatter_class,
        help="an HTTP embeddings service with dynamic batching, a cache and metrics",
        description=SERVE_HELP,
        epilog="example: qwen-vit-jax serve q3b --declare 36x36 --max-wait-ms 5 --cache ~/.cache/qvj-emb",
    )
    for f in dataclasses.fields(Settings):
        m = f.metadata
        default = None if f.default is dataclasses.MISSING or f.default is None else f.default
        shown = default // m["scale"] if default is not None and m["scale"] != 1 else default
        kw = {"help": m["help"].format(default=shown), "metavar": m["metavar"], "choices": m["choices"]}
        if m["flag"] is None:
            p.add_argument(f.name, **kw)
        elif f.type == "bool | None":
            p.add_argument(m["flag"], dest=f.name, action=argparse.BooleanOptionalAction, help=kw["help"])
        else:  # the default stays None on the parser: an absent flag leaves the field's own default
            p.add_argument(m["flag"], dest=f.name, type=m["parse"], **kw)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)
    return p


def settings_from(args) -> Settings:
    """The flags given -> Settings (a flag left out: the field's default; a flag in a larger unit,
    --cache-mb, scaled to the field's)."""
    given = {}
    for f in dataclasses.fields(Settings):
        value = getattr(args, f.name, None)
        if value is not None:
            given[f.name] = value * f.metadata["scale"] if f.metadata["scale"] != 1 else value
    return Settings(**given)


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
