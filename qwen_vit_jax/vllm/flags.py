"""The flags `encode` and `serve` share for vLLM's encoder-cache store, and their check. Light: the
commands' --help imports nothing more than this (no jax, no torch, no blake3)."""

from __future__ import annotations

from qwen_vit_jax.errors import BadInput

RULES = ("sha256", "vllm")  # ids.RULES (not imported: ids.py imports numpy)


def add_flags(group) -> None:
    group.add_argument("--vllm-store", metavar="STORE", help="also into vLLM's encoder-cache store")
    group.add_argument(
        "--vllm-ids",
        choices=RULES,
        default="sha256",
        help="store ids: sha256 (default) or vLLM's own",
    )
    group.add_argument("--vllm-model", metavar="MODEL", help="the model vLLM serves (--vllm-ids vllm)")


def check(store: str | None, ids: str, model: str | None) -> None:
    """A BadInput (a ValueError) for flags that do not go together."""
    if ids not in RULES:
        raise BadInput(f"--vllm-ids is one of {', '.join(RULES)}, got {ids!r}", limit="vllm_ids")
    if store is None and (ids != "sha256" or model is not None):
        raise BadInput("--vllm-ids and --vllm-model go with --vllm-store STORE", limit="vllm_store")
    if ids == "vllm" and not model:
        raise BadInput(
            "--vllm-ids vllm needs --vllm-model: the model exactly as vLLM is started with it", limit="vllm_model"
        )
    if ids == "sha256" and model is not None:
        raise BadInput("--vllm-model is for --vllm-ids vllm (sha256 ids do not depend on it)", limit="vllm_model")


def writer(store: str, ids: str, model: str | None, cfg):
    """The StoreWriter for these flags and a tower config (its deepstack layers go into the store)."""
    from qwen_vit_jax.vllm.ids import Ids
    from qwen_vit_jax.vllm.store import StoreWriter

    return StoreWriter(store, Ids(ids, model), deepstack=len(cfg.deepstack_layers))
