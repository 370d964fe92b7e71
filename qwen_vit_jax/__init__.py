"""qwen_vit_jax: the Qwen2-VL / Qwen2.5-VL vision tower in JAX + Flax NNX.

    import qwen_vit_jax as qvj
    qvj.convert_checkpoint(hf_dir, out_dir)
    enc = qvj.VisionEncoder.from_pretrained(out_dir, dtype="float32")
    emb = enc.encode(pixel_values, grid_thw)      # [N // 4, out_dim]
"""

from qwen_vit_jax.config import PRESETS, VisionConfig
from qwen_vit_jax.convert import convert_checkpoint
from qwen_vit_jax.encoder import VisionEncoder
from qwen_vit_jax.plan import Bucket, BucketPolicy

__all__ = ["Bucket", "BucketPolicy", "PRESETS", "VisionConfig", "VisionEncoder", "convert_checkpoint"]
__version__ = "0.1.0"
