#!/usr/bin/env python
"""Convert the vision tower of an HF Qwen2-VL / Qwen2.5-VL checkpoint to qwen_vit_jax params.

    python convert_weights.py HF_DIR OUT_DIR [--dtype {float32,bfloat16}] [--overwrite]

A thin wrapper over `qwen_vit_jax.convert.main` (also behind `qwen-vit-jax convert`).
"""

import sys

from qwen_vit_jax.convert import main

if __name__ == "__main__":
    sys.exit(main(prog="convert_weights.py"))
