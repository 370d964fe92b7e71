"""The service's settings: one frozen object, what `qwen-vit-jax serve`'s flags say (cli.py), what
`create_app` and the Ray Serve deployment take. No jax, no web framework here: the CLI's --help and
the worker processes import it.

    s = Settings(checkpoint="ckpt", max_batch_patches=4096, declare=((1, 36, 36),))
    app = qvj.serve.create_app(s)

Binding an address other than loopback requires an API key file (`check`): an encoder reachable
from the network answers only holders of the bearer token.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import pathlib

from qwen_vit_jax.vllm import flags as vllm_flags

LOOPBACK_NAMES = ("localhost",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Every knob of the service.

    checkpoint: what VisionEncoder.from_pretrained takes (a converted dir, an HF dir, a cached hub id).
    host, port: where uvicorn listens (loopback by default).
    dtype: "float32" or "bfloat16".
    max_batch_patches: the patch budget of one device call (None: the encoder's, a full bucket).
    max_wait_ms: how long the oldest waiting item may wait for its batch to fill.
    max_queue: items admitted and not yet answered, at most; a request past it gets 429.
    cache: the content-hash cache directory (the CLI's `--cache DIR` format), or None.
    cache_bytes: the in-memory LRU's size in bytes of embeddings (0: none).
    api_key_file: a file holding the bearer token (its first line), or None (no auth).
    declare: grids (t, h, w) in patches to compile and declare (tight buckets) before ready.
    workers: preparation worker processes (0: a thread of the server process).
    max_body_bytes, max_items, max_image_pixels: request limits (413 past them).
    max_item_patches: patches per image or video frame at most (None: the patch budget of one device
      call). An image over it is resized down to fit, keeping its aspect (`oversize="resize"`), or
      refused with 413 (`oversize="refuse"`); a video frame still over it is refused (bounds.py).
    max_frames: frames per video at most (None: the checkpoint's video max_frames; only lowers it).
    request_timeout_s: a request still unanswered after this gets 504, its queued items dropped.
    max_connections: open connections at most; past it a connection without a request head is
      closed to make room for one with a head, else 503 (connections.py). Bounds the bodies read at once.
    header_timeout_s: a request head must arrive whole within this, and a body may pause no longer
      (408 and closed past it; a body must be whole within request_timeout_s).
    keep_alive_s: an idle connection is closed after this. Longer than clients keep idle
      connections (httpx: 5 s), so a client never sends on a connection the server is closing.
    compile_cache: JAX's persistent compilation cache directory, or None.
    warmup_batches: before ready, compile (or load from compile_cache) the batch shapes the declared
      sizes form under the patch budget; None (the default): on when compile_cache is set.
    vllm_store: vLLM's encoder-cache store: every answered item is written there first, its
      identifier in the answer ("vllm_id"); vllm_ids "sha256" or "vllm" (vLLM's own, with
      vllm_model, the model vLLM is started with). docs/vllm.md.
    """

    checkpoint: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    max_batch_patches: int | None = None
    max_wait_ms: float = 5.0
    max_queue: int = 256
    cache: str | None = None
    cache_bytes: int = 256 << 20
    api_key_file: str | None = None
    declare: tuple[tuple[int, int, int], ...] = ()
    workers: int = 1
    max_body_bytes: int = 64 << 20
    max_items: int = 64
    max_image_pixels: int = 50_000_000
    max_item_patches: int | None = None
    oversize: str = "resize"
    max_frames: int | None = None
    request_timeout_s: float = 60.0
    max_connections: int = 512
    keep_alive_s: float = 30.0
    header_timeout_s: float = 10.0
    compile_cache: str | None = None
    warmup_batches: bool | None = None
    vllm_store: str | None = None
    vllm_ids: str = "sha256"
    vllm_model: str | None = None

    def __post_init__(self):
        if self.warmup_batches is None:  # a restart with the same compile cache loads them in seconds
            object.__setattr__(self, "warmup_batches", self.compile_cache is not None)
        positive = ("max_queue", "max_items", "max_body_bytes", "max_image_pixels", "max_connections")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_batch_patches is not None and (
            not isinstance(self.max_batch_patches, int) or self.max_batch_patches <= 0
        ):
            raise ValueError(f"max_batch_patches must be a positive int or None, got {self.max_batch_patches!r}")
        for name in ("max_item_patches", "max_frames"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.oversize not in ("resize", "refuse"):
            raise ValueError(f'oversize must be "resize" or "refuse", got {self.oversize!r}')
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s!r}")
        if not self.max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms!r}")
        if not self.keep_alive_s > 0:
            raise ValueError(f"keep_alive_s must be > 0, got {self.keep_alive_s!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s!r}")
        if not isinstance(self.workers, int) or self.workers < 0:
            raise ValueError(f"workers must be an int >= 0, got {self.workers!r}")
        if not isinstance(self.cache_bytes, int) or self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0, got {self.cache_bytes!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0 .. 65535, got {self.port!r}")
        for g in self.declare:
            if len(g) != 3 or min(g) <= 0:
                raise ValueError(f"declare holds {g!r}: each size is (t, h, w) in patches, all positive")
        vllm_flags.check(self.vllm_store, self.vllm_ids, self.vllm_model)
        if self.api_key_file is None and not is_loopback(self.host):
            raise ValueError(
                f"binding {self.host!r} (not loopback) requires an API key: --api-key-file FILE "
                "(a file holding the bearer token clients send)"
            )

    def api_key(self) -> str | None:
        """The bearer token (the key file's first line, stripped), or None without a key file."""
        if self.api_key_file is None:
            return None
        text = pathlib.Path(self.api_key_file).read_text().strip().splitlines()
        if not text or not text[0].strip():
            raise ValueError(f"{self.api_key_file}: the API key file is empty")
        return text[0].strip()


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or 'localhost'."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
