"""vLLM as the language model: our embeddings in vLLM's request form, and vLLM's encoder-cache store
written by us (encoder disaggregation: this encoder on its own hardware, a vLLM consumer reading
what it wrote). Read in this order:

  ids.py      the identifier rules: the sha256 of an item's bytes, or vLLM's own default (blake3)
  store.py    write_store / read_store: STORE/<id>/encoder_cache.safetensors (ECExampleConnector);
              StoreWriter, the one writer of `encode --vllm-store` and `serve --vllm-store`
  inputs.py   mm_data(enc, images, videos, **sampling): `multi_modal_data` with embeddings
  sink.py     the encode loop's sink for --vllm-store
  flags.py    the flags both commands take

    from qwen_vit_jax import vllm as qv
    mm = qv.mm_data(enc, images=[img], videos=["clip.mp4"], fps=2.0)
    qv.write_store(store, qv.sha256_id(jpeg_bytes), enc.encode_images([img])[0])

torch (mm_data's tensors) and blake3 (vLLM's identifiers) are imported when used: importing this
package costs nothing, and neither is a dependency of the core. docs/vllm.md has the whole set-up.
"""

import importlib

_EXPORTS = {
    "mm_data": "inputs",
    "write_store": "store",
    "read_store": "store",
    "store_path": "store",
    "vllm_layout": "store",
    "StoreWriter": "store",
    "Ids": "ids",
    "sha256_id": "ids",
    "vllm_image_id": "ids",
    "VLLM_TESTED": "ids",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qwen_vit_jax.vllm' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"qwen_vit_jax.vllm.{_EXPORTS[name]}"), name)
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
