"""The service's settings: one frozen object, the one source of its defaults. `qwen-vit-jax serve`'s
flags are built from its fields (cli.py: each field's flag, help and unit are its metadata), and
so are the Ray app's key=value arguments (ray_app.py). No jax, no web framework here: the CLI's
--help and the worker processes import it.

    s = Settings(checkpoint="ckpt", max_batch_patches=4096, declare=((1, 36, 36),))
    app = qvj.serve.create_app(s)

Settings that contradict each other are refused when the object is made (a ValueError naming both
flags): more items per request than the queue admits, a per-item bound above the batch budget,
more body slots per peer than connections. Binding an address other than loopback requires an API
key file: an encoder reachable from the network answers only holders of the bearer token.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import pathlib

from qwen_vit_jax.vllm import flags as vllm_flags

LOOPBACK_NAMES = ("localhost",)
DEFAULT_MAX_ITEMS = 64
KiB, MiB = 1 << 10, 1 << 20


def _sizes(text: str):
    from qwen_vit_jax.config import parse_sizes

    return parse_sizes(text, "--declare")


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not true or false")


def knob(default, flag: str, help: str, *, parse=str, metavar: str | None = None, scale: int = 1, choices=None):
    """A Settings field and what its flag is: `flag` (None: positional), `help` ("{default}" is the
    default in the flag's unit), `parse` (text -> value in the flag's unit), `scale` (the flag's unit
    in the field's: MiB for a field in bytes)."""
    meta = {"flag": flag, "help": help, "parse": parse, "metavar": metavar, "scale": scale, "choices": choices}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Every knob of the service; each field's help says what it does (`qwen-vit-jax serve --help`
    prints them, docs/serve.md tabulates them with their status codes)."""

    checkpoint: str = knob(
        dataclasses.MISSING, None, "converted dir, HF checkpoint dir or hub id in the local cache", metavar="CKPT"
    )
    host: str = knob("127.0.0.1", "--host", "address to bind (default {default}; others need --api-key-file)")
    port: int = knob(8000, "--port", "port (default {default})", parse=int)
    dtype: str = knob("float32", "--dtype", "compute dtype (default {default})", choices=("float32", "bfloat16"))
    max_batch_patches: int | None = knob(
        None, "--max-batch-patches", "patches per device call (default: a full bucket, 16384)", parse=int, metavar="N"
    )
    max_wait_ms: float = knob(
        5.0, "--max-wait-ms", "a batch's longest wait (default {default:g})", parse=float, metavar="M"
    )
    max_queue: int = knob(
        256,
        "--max-queue",
        "items admitted and not answered at most; past it 429 (default {default})",
        parse=int,
        metavar="ITEMS",
    )
    cache: str | None = knob(
        None, "--cache", "content-hash cache directory (the format of encode --cache)", metavar="DIR"
    )
    cache_bytes: int = knob(
        256 * MiB,
        "--cache-mb",
        "in-memory LRU of embeddings, MiB (default {default}; 0 off)",
        parse=int,
        scale=MiB,
        metavar="MB",
    )
    api_key_file: str | None = knob(
        None, "--api-key-file", "bearer token clients must send (its first line: printable ASCII)", metavar="FILE"
    )
    declare: tuple[tuple[int, int, int], ...] = knob(
        (), "--declare", "sizes to compile and declare before ready: 36x36,2x24x24", parse=_sizes, metavar="SIZES"
    )
    workers: int | None = knob(
        None,
        "--workers",
        "preparation worker processes (default: cores - 1, at least 1; 0: a thread)",
        parse=int,
        metavar="N",
    )
    max_body_bytes: int = knob(
        64 * MiB,
        "--max-body-mb",
        "request body MiB at most (default {default}; 413 past)",
        parse=int,
        scale=MiB,
        metavar="MB",
    )
    max_items: int | None = knob(
        None,
        "--max-items",
        "items per request at most (default: 64, or --max-queue if less; 413 past)",
        parse=int,
        metavar="N",
    )
    max_image_pixels: int = knob(
        50_000_000,
        "--max-image-pixels",
        "pixels per image at most (default {default:,}; 413 past)",
        parse=int,
        metavar="N",
    )
    max_item_patches: int | None = knob(
        None,
        "--max-item-patches",
        "patches per image or video frame at most (default: --max-batch-patches)",
        parse=int,
        metavar="N",
    )
    oversize: str = knob(
        "resize",
        "--oversize",
        "an image over --max-item-patches: resized down keeping its aspect (default) or refused (413)",
        choices=("resize", "refuse"),
    )
    max_frames: int | None = knob(
        None,
        "--max-frames",
        "frames per video at most, with or without fps (default: the checkpoint's max_frames)",
        parse=int,
        metavar="N",
    )
    max_video_patches: int | None = knob(
        None,
        "--max-video-patches",
        "patches per video in all at most, before decoding (default: 16 x --max-batch-patches; 413 past)",
        parse=int,
        metavar="N",
    )
    request_timeout_s: float = knob(
        60.0, "--timeout", "seconds a request may take (default {default:g}; 504 past)", parse=float, metavar="S"
    )
    max_connections: int = knob(
        512,
        "--max-connections",
        "open connections at most; one without a request head makes room, else 503 (default {default})",
        parse=int,
        metavar="N",
    )
    max_peer_bodies: int | None = knob(
        None,
        "--max-peer-bodies",
        "connections of one client address reading a body at once; past it 429 (default: --max-connections / 4)",
        parse=int,
        metavar="N",
    )
    max_head_bytes: int = knob(
        64 * KiB,
        "--max-head-kb",
        "a request head's KiB at most (default {default}; 431 past)",
        parse=int,
        scale=KiB,
        metavar="KB",
    )
    header_timeout_s: float = knob(
        10.0,
        "--header-timeout",
        "seconds to send a whole request head, the longest pause in a body and the longest a client may "
        "leave its answer unread (default {default:g}; 408 past)",
        parse=float,
        metavar="S",
    )
    keep_alive_s: float = knob(
        30.0, "--keep-alive", "idle connections close after S seconds (default {default:g})", parse=float, metavar="S"
    )
    compile_cache: str | None = knob(
        None, "--compile-cache", "JAX's persistent compilation cache directory", metavar="DIR"
    )
    warmup_batches: bool | None = knob(
        None,
        "--warmup-batches",
        "compile the batch shapes of the --declare sizes before ready (default: on with --compile-cache)",
        parse=_bool,
    )
    # vLLM's encoder-cache store (docs/vllm.md): every answered item written there first, its
    # identifier in the answer ("vllm_id")
    vllm_store: str | None = knob(
        None, "--vllm-store", "also write every answered item into vLLM's encoder-cache store", metavar="STORE"
    )
    vllm_ids: str = knob(
        "sha256",
        "--vllm-ids",
        "store ids: sha256 of the bytes (default) or vLLM's own of images (with --vllm-model)",
        choices=vllm_flags.RULES,
    )
    vllm_model: str | None = knob(
        None, "--vllm-model", "the model exactly as vLLM is started with it (for --vllm-ids vllm)", metavar="MODEL"
    )

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        if self.warmup_batches is None:  # a restart with the same compile cache loads them in seconds
            put("warmup_batches", self.compile_cache is not None)
        if self.workers is None:
            from qwen_vit_jax.data.workers import default_workers

            put("workers", default_workers())
        positive = ("max_queue", "max_body_bytes", "max_image_pixels", "max_connections", "max_head_bytes")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_items is None:
            put("max_items", min(DEFAULT_MAX_ITEMS, self.max_queue))
        if self.max_peer_bodies is None:
            put("max_peer_bodies", max(self.max_connections // 4, 1))
        bounded = ("max_items", "max_batch_patches", "max_item_patches", "max_frames", "max_video_patches")
        for name in (*bounded, "max_peer_bodies"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        for name in ("dtype", "oversize"):
            if getattr(self, name) not in (choices := _field(name).metadata["choices"]):
                raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {getattr(self, name)!r}")
        for name in ("header_timeout_s", "keep_alive_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms!r}")
        if not isinstance(self.workers, int) or self.workers < 0:
            raise ValueError(f"workers must be an int >= 0, got {self.workers!r}")
        if not isinstance(self.cache_bytes, int) or self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0, got {self.cache_bytes!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0 .. 65535, got {self.port!r}")
        for g in self.declare:
            if len(g) != 3 or min(g) <= 0:
                raise ValueError(f"declare holds {g!r}: each size is (t, h, w) in patches, all positive")
        self._refuse_contradictions()
        vllm_flags.check(self.vllm_store, self.vllm_ids, self.vllm_model)
        if self.api_key_file is None and not is_loopback(self.host):
            raise ValueError(
                f"binding {self.host!r} (not loopback) requires an API key: --api-key-file FILE "
                "(a file holding the bearer token clients send)"
            )

    def _refuse_contradictions(self) -> None:
        """Pairs of settings that cannot both hold: a ValueError naming both flags."""
        pairs = [
            ("max_items", "max_queue", "a request of more items than the queue admits could never be answered"),
            ("max_peer_bodies", "max_connections", "one address could never hold that many"),
        ]
        if self.max_batch_patches is not None:  # (None: the encoder's budget, checked when it is known)
            pairs.append(("max_item_patches", "max_batch_patches", "an item could never fit one device call"))
        for low, high, why in pairs:
            a, b = getattr(self, low), getattr(self, high)
            if a is not None and a > b:
                raise ValueError(
                    f"{flag(low)} {self.shown(low)} is more than {flag(high)} {self.shown(high)}: {why} "
                    f"({low}={a!r}, {high}={b!r}); lower {flag(low)} or raise {flag(high)}"
                )

    def shown(self, name: str):
        """A field's value in its flag's unit (bytes as MiB for --cache-mb, ...)."""
        value = getattr(self, name)
        scale = _field(name).metadata["scale"]
        return value // scale if scale != 1 and value is not None else value

    def api_key(self) -> str | None:
        """The bearer token (the key file's first line, stripped), or None without a key file. A
        ValueError for an empty key or one that is not printable ASCII without spaces: an HTTP
        header carries it as bytes, and a client could not send any other as it reads."""
        if self.api_key_file is None:
            return None
        text = pathlib.Path(self.api_key_file).read_text(encoding="utf-8", errors="replace").strip().splitlines()
        if not text or not text[0].strip():
            raise ValueError(f"{self.api_key_file}: the API key file is empty")
        key = text[0].strip()
        bad = sorted({c for c in key if not "!" <= c <= "~"})
        if bad:
            shown = ", ".join(f"U+{ord(c):04X}" for c in bad[:3])
            raise ValueError(
                f"{self.api_key_file}: the API key must be printable ASCII without spaces (it travels in an "
                f"HTTP header); it holds {shown}"
            )
        return key


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _field(name: str) -> dataclasses.Field:
    return FIELDS[name]


def flag(name: str) -> str:
    """The `qwen-vit-jax serve` flag of a Settings field ("max_items" -> "--max-items")."""
    return _field(name).metadata["flag"] or name.upper()


def parse(name: str, text: str):
    """A field's value from its text in the field's own unit (Ray's key=value arguments): the flag's
    parser, "none" for a field that may be None."""
    f = _field(name)
    if text.lower() == "none" and f.default is None:
        return None
    try:
        return f.metadata["parse"](text)
    except ValueError as e:
        kind = {int: "an int", float: "a number"}.get(f.metadata["parse"], None)
        raise ValueError(f"{name}={text!r}: {f'not {kind}' if kind else e}") from None


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or 'localhost'."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
