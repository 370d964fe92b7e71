"""qwen_vit_jax: the Qwen vision towers (Qwen2-VL .. Qwen3.5, Qwen4-Exp, MoE, Omni, PaddleOCR-VL, GLM-4V) in JAX.

    import qwen_vit_jax as qvj
    qvj.convert_checkpoint(hf_dir, out_dir)
    enc = qvj.VisionEncoder.from_pretrained(out_dir, dtype="float32")
    emb = enc.encode(pixel_values, grid_thw)      # [N // 4, out_dim]
    embs = enc.encode_images(images)              # one [tokens, out_dim] array per image
    pv, thw = qvj.preprocess_images(images)
    pv, thw, ts = qvj.preprocess_video("clip.mp4", fps=2.0)   # decode + sample as HF's video processors
    for chunk in enc.iter_video("clip.mp4", fps=2.0):  # qvj.VideoChunk: a group of frames at a time
        chunk.embeddings, chunk.grid_thw, chunk.timestamps, chunk.first_frame
    enc = qvj.VisionEncoder.from_pretrained(out_dir, devices=jax.local_devices())  # several devices
    e = qvj.read_embeddings("emb.safetensors")    # what `qwen-vit-jax encode` wrote (or its shards)

    model = qvj.load_model(out_dir)               # the nnx.Module, for your own jit / grad
                                                  # (also an HF checkpoint dir or a cached hub id)
    qvj.add_lora(model, 8, rngs=nnx.Rngs(0))      # stacked nnx.LoRA adapters; qvj.merge_lora(model)
    qvj.export_hf(model, hf_out, like=hf_dir)     # back to a complete HF checkpoint
    for plan in qvj.make_plans(thw, model.cfg):   # one Plan (a pytree) per chunk
        emb = plan.unpad(jax.jit(model)(plan.take(pv), plan))

    pos, deltas = qvj.rope_index(ckpt, input_ids, image_grid_thw=thw, attention_mask=mask)
                                                  # [3, B, L], [B, 1] == HF's get_rope_index, in HF's
                                                  # dtype (int64; Qwen3-Omni float32)
    nxt = qvj.decode_positions(deltas, start, 1)  # [3, B, 1]: the next token's positions
    inp = qvj.lm_inputs(ckpt, input_ids, image_grid_thw=thw)   # positions, deltas, splice plan: one call
    cos, sin = qvj.mrope_tables(ckpt, pos)        # [B, L, rotary_dim]: the text model's rotary tables
    q, k = qvj.apply_mrope(q, k, cos, sin, ckpt)  # q, k [B, L, H, Dh] rotated as the family does
    cfg = qvj.prompt_config(ckpt)                 # qvj.PromptConfig: token ids + position rules

Names load on first use (PEP 562), so `import qwen_vit_jax` and the CLI's --help do not pay
for importing jax, flax and numba.
"""

import importlib

_EXPORTS = {
    "PRESETS": "presets",
    "abstract_model": "model.vit",
    "VisionConfig": "config",
    "convert_checkpoint": "weights.convert",
    "VisionEncoder": "runtime.encoder",
    "VideoChunk": "runtime.video",
    "enable_compilation_cache": "runtime.program",
    "Embeddings": "data.embeddings",
    "read_embeddings": "data.embeddings",
    "write_embeddings": "data.embeddings",
    "Bucket": "plan",
    "BucketPolicy": "plan",
    "Plan": "plan",
    "Patches": "plan",
    "make_plans": "plan",
    "to_spatial": "plan",
    "VisionTransformer": "model.vit",
    "load_model": "weights.sources",
    "export_hf": "weights.export",
    "add_lora": "model.lora",
    "merge_lora": "model.lora",
    "PreprocessConfig": "preprocess.config",
    "Preprocessing": "preprocess.config",
    "preprocess_images": "preprocess.images",
    "preprocess_paddleocr_images": "preprocess.images",
    "preprocess_glm4v_images": "preprocess.images",
    "preprocess_video": "preprocess.video",
    "splice": "prompt.splice",
    "expand_placeholders": "prompt.expand",
    "PromptConfig": "prompt.config",
    "prompt_config": "prompt.config",
    "rope_index": "prompt.positions",
    "decode_positions": "prompt.positions",
    "lm_inputs": "prompt.inputs",
    "mrope_tables": "prompt.rotary",
    "apply_mrope": "prompt.rotary",
}
__all__ = sorted(_EXPORTS)  # (and the `data` module)
__version__ = "0.1.0"


# modules that are part of the API: qvj.data.load(...), qvj.ray.Encoder (Ray Data's stages),
# qvj.serve.Client (the service's client) and qvj.serve.create_app, qvj.vllm.mm_data (vLLM)
_MODULES = {"data": "data", "ray": "data.ray_data", "serve": "serve", "vllm": "vllm"}


def __getattr__(name):
    if name in _MODULES:
        value = globals()[name] = importlib.import_module(f"qwen_vit_jax.{_MODULES[name]}")
        return value
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qwen_vit_jax' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"qwen_vit_jax.{_EXPORTS[name]}"), name)
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS, *_MODULES])
