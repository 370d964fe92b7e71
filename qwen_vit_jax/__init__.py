"""qwen_vit_jax: the Qwen2-VL / Qwen2.5-VL vision tower in JAX + Flax NNX.

    import qwen_vit_jax as qvj
    qvj.convert_checkpoint(hf_dir, out_dir)
    enc = qvj.VisionEncoder.from_pretrained(out_dir, dtype="float32")
    emb = enc.encode(pixel_values, grid_thw)      # [N // 4, out_dim]
    embs = enc.encode_images(images)              # one [tokens, out_dim] array per image
    pv, thw = qvj.preprocess_images(images)
"""

from qwen_vit_jax.config import PRESETS, VisionConfig
from qwen_vit_jax.convert import convert_checkpoint
from qwen_vit_jax.encoder import VisionEncoder
from qwen_vit_jax.plan import Bucket, BucketPolicy
from qwen_vit_jax.preprocess import PreprocessConfig, preprocess_images, preprocess_video

__all__ = [
    "Bucket", "BucketPolicy", "PRESETS", "PreprocessConfig", "VisionConfig", "VisionEncoder",
    "convert_checkpoint", "preprocess_images", "preprocess_video",
]
__version__ = "0.1.0"
