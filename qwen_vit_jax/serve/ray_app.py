"""The service on Ray Serve (`qvj.serve.app`; pip install 'qwen_vit_jax[ray]'): the same FastAPI app
as `qwen-vit-jax serve`, one replica per accelerator, the replica count scaled on the requests each
replica holds.

    # svc.py
    import qwen_vit_jax as qvj
    app = qvj.serve.app("q3b", dtype="bfloat16", max_batch_patches=16384, declare=((1, 36, 36),))

    $ serve run svc:app                      # http://127.0.0.1:8000/v1/embeddings, /metrics, ...
    $ serve run qwen_vit_jax.serve.ray_app:build checkpoint=q3b dtype=bfloat16 declare=36x36

Each replica builds the app with `create_app(settings)` in its own process (Ray's late-bound ingress),
so the checkpoint loads, the declared sizes compile and the preparation workers start there, once
per replica, and only the settings (a small frozen object) travel through Ray. A replica batches the
requests Ray routes to it as the standalone server does; its queue limit (`max_queue`, 429) and
Ray's (`max_ongoing_requests` a little above it, then Ray's own 503 past `max_queued_requests`) keep
memory bounded when every replica is full.

Ray's HTTP proxy listens where `serve start --http-host` (or `serve.start(http_options=...)`) says:
127.0.0.1 by default, as the standalone server. An `api_key_file` must exist on every node.
"""

from __future__ import annotations

import asyncio

from qwen_vit_jax.serve.settings import FIELDS, Settings, parse

DEPLOYMENT = "qwen_vit_jax"


class _Replica:
    """One Ray Serve replica: holds the settings; Ray asks it for the ASGI app once it is built."""

    def __init__(self, settings: Settings):
        self._settings = settings

    def __serve_build_asgi_app__(self):
        from qwen_vit_jax.serve.asgi import create_app

        return _ReadyOnStartup(create_app(self._settings))


class _ReadyOnStartup:
    """An app whose lifespan startup completes once its service is ready (loaded, declared sizes
    compiled, workers started), or fails with the load's error. `create_app` loads in the background
    so that a standalone server's /healthz answers at once; a Ray replica instead counts as started
    only when it can answer, so Ray routes nothing to a replica still loading (new replicas of a
    scale-out included), and a replica whose load fails is restarted by Ray."""

    def __init__(self, app):
        self.app = app

    def __getattr__(self, name):  # what Ray asks of a FastAPI app (add_exception_handler, ...)
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        service = self.app.state.service

        async def send_when_ready(message):
            if message["type"] == "lifespan.startup.complete":
                while not service.ready and service.error is None:
                    await asyncio.sleep(0.05)
                if service.error is not None:
                    message = {"type": "lifespan.startup.failed", "message": f"loading failed: {service.error}"}
            await send(message)

        return await self.app(scope, receive, send_when_ready)


def app(checkpoint: str, **kwargs):
    """A Ray Serve application of the encoder service, for `serve run` or `serve.run`.

    Args:
      checkpoint: what `VisionEncoder.from_pretrained` takes, readable on every node.
      **kwargs: `deployment_options`' arguments (num_gpus, min_replicas, max_replicas,
        target_ongoing_requests, ray_actor_options, name) and the other `Settings` fields
        (`qwen-vit-jax serve`'s flags: dtype, max_batch_patches, max_wait_ms, max_queue, cache,
        api_key_file, declare, workers, ...). `host` and `port` do not apply (Ray's proxy listens).
    Returns:
      a `ray.serve.Application` whose replicas each serve `create_app(Settings(checkpoint, ...))`.
    """
    from ray import serve

    names = ("num_gpus", "min_replicas", "max_replicas", "target_ongoing_requests", "ray_actor_options", "name")
    ray_kw = {k: kwargs.pop(k) for k in names if k in kwargs}
    for key in ("host", "port"):
        if key in kwargs:
            raise ValueError(f"{key}= does not apply on Ray Serve: its HTTP proxy listens (serve start --http-{key})")
    settings = Settings(checkpoint=str(checkpoint), **kwargs)
    return serve.deployment(serve.ingress()(_Replica), **deployment_options(settings, **ray_kw)).bind(settings)


def deployment_options(
    settings: Settings,
    *,
    num_gpus: float | None = None,
    min_replicas: int = 1,
    max_replicas: int | None = None,
    target_ongoing_requests: float | None = None,
    ray_actor_options: dict | None = None,
    name: str = DEPLOYMENT,
) -> dict:
    """The keyword arguments of `serve.deployment` for the service's replicas.

    Args:
      settings: the replicas' settings (max_queue and request_timeout_s set Ray's limits).
      num_gpus: GPUs per replica. None: 1 when the cluster (when connected; else this machine, as
        Ray counts it) has GPUs, else 0 (CPU replicas, one per node).
      min_replicas, max_replicas: the autoscaling range; max_replicas None: one per GPU of the
        cluster (one per node for CPU replicas; 1 when not connected to Ray yet).
      target_ongoing_requests: requests per replica (in flight and queued there) that Ray's
        autoscaler aims at; None: a quarter of `max_queue` (a replica scales out well before it
        sends 429s).
      ray_actor_options: Ray's options for each replica (e.g. {"resources": {"TPU": 4}}); replaces
        the num_gpus / num_cpus chosen here.
      name: the deployment's name.
    """
    gpus, nodes = _cluster()
    if num_gpus is None:
        num_gpus = 1 if gpus else 0
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus!r}")
    if max_replicas is None:
        max_replicas = max(int(gpus // num_gpus), 1) if num_gpus else max(nodes, 1)
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {min_replicas} and {max_replicas}")
    target = target_ongoing_requests if target_ongoing_requests is not None else max(settings.max_queue / 4, 1.0)
    options = {
        "name": name,
        "ray_actor_options": ray_actor_options
        if ray_actor_options is not None
        else {"num_gpus": num_gpus, "num_cpus": 1},
        # the replica's own queue answers 429 first; Ray's backlog past it is bounded too (503)
        "max_ongoing_requests": settings.max_queue + 8,
        "max_queued_requests": settings.max_queue,
        "autoscaling_config": {
            "min_replicas": min_replicas,
            "initial_replicas": min_replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": target,
        },
        "graceful_shutdown_timeout_s": settings.request_timeout_s,
    }
    if not num_gpus:  # CPU replicas: one per node (its preparation workers and XLA use the node's cores)
        options["max_replicas_per_node"] = 1
    return options


def build(args: dict[str, str]):
    """`serve run qwen_vit_jax.serve.ray_app:build checkpoint=CKPT key=value ...` (Ray's application
    builder): `app(**parse_args(args))`."""
    return app(**parse_args(args))


def parse_args(args: dict[str, str]) -> dict:
    """`serve run`'s key=value strings -> `app`'s keyword arguments: each Settings field read by its
    flag's own parser (`settings.parse`: `declare` as `--declare` takes it, 36x36,2x24x24; values in
    the field's unit, bytes for cache_bytes), num_gpus, min_replicas, max_replicas and
    target_ongoing_requests as numbers; `checkpoint` is required."""
    args = dict(args)
    if "checkpoint" not in args:
        raise ValueError("serve run ...ray_app:build needs checkpoint=CKPT")
    numbers = {"num_gpus": float, "min_replicas": int, "max_replicas": int, "target_ongoing_requests": float}
    kw = {"checkpoint": args.pop("checkpoint")}
    for key, text in args.items():
        if key in numbers:
            kw[key] = _number(key, text, numbers[key])
        elif key in FIELDS:
            kw[key] = parse(key, text)
        else:
            raise ValueError(
                f"serve run ...ray_app:build: unknown argument {key!r} (the Settings fields, {', '.join(numbers)})"
            )
    return kw


def _number(name: str, text: str, cast):
    try:
        return cast(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: not {'an int' if cast is int else 'a number'}") from None


def _cluster() -> tuple[float, int]:
    """(GPUs, alive nodes) of the Ray cluster when connected; else this machine's GPUs as Ray counts
    them and one node (`serve run` imports the application before it connects)."""
    import ray

    if ray.is_initialized():
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        return float(ray.cluster_resources().get("GPU", 0)), nodes
    try:  # Ray's own count of this node's GPUs (what it will offer once started)
        from ray._private.accelerators import get_accelerator_manager_for_resource

        return float(get_accelerator_manager_for_resource("GPU").get_current_node_num_accelerators()), 1
    except Exception:  # noqa: BLE001 (a private API: its absence means no count, not an error)
        return 0.0, 1
