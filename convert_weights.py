#!/usr/bin/env python
"""Convert the vision tower of an HF checkpoint (any tower of the family) to qwen_vit_jax params.

    python convert_weights.py HF_DIR OUT_DIR [--dtype {float32,bfloat16}] [--overwrite]

A thin wrapper over `qwen-vit-jax convert` (qwen_vit_jax.tools.cli).
"""

import sys

from qwen_vit_jax.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
