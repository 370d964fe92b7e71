"""FLOP accounting: what the model needs (analytic) vs what a bucket's program computes (XLA).

`ideal_flops` counts the matmuls of the tower on the real rows only, with attention over
the real segments (frames, windows): what an exact, padding-free implementation must do.
`compiled_flops` asks XLA's cost analysis about the program a bucket runs. XLA counts a
loop body once, so the analysis runs on an unrolled copy of the same forward (one copy of
every layer and of every key-block step); the arithmetic is identical to the scanned
program that actually runs, elementwise work included.
"""

from __future__ import annotations

import numpy as np

from qwen_vit_jax.config import QWEN2_5_VL, VisionConfig


def ideal_flops(cfg: VisionConfig, frame_lengths, window_lengths) -> float:
    """Analytic FLOPs (2 per multiply-add) of the tower on real rows only.

    Args:
      frame_lengths: rows of every frame (full-attention segments).
      window_lengths: rows of every window (window-attention segments; empty for Qwen2-VL).
    """
    d, i = cfg.width, cfg.intermediate_size
    frames = np.asarray(frame_lengths, np.float64)
    windows = np.asarray(window_lengths, np.float64)
    n = frames.sum()
    mlp = (3 if cfg.variant == QWEN2_5_VL else 2) * 2 * d * i
    per_row = 2 * cfg.patch_dim * d + cfg.depth * (2 * d * 3 * d + 2 * d * d + mlp)
    merge = 2 * (cfg.merge_unit * d) ** 2 + 2 * cfg.merge_unit * d * cfg.out_dim
    full_layers = sum(cfg.full_attention_layers)
    attention = 4 * d * (full_layers * np.square(frames).sum()
                         + (cfg.depth - full_layers) * np.square(windows).sum())
    return float(n * per_row + n / cfg.merge_unit * merge + attention)
