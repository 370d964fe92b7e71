"""Inputs in, embeddings out: what `qwen-vit-jax encode` reads and writes. Read in this order:

stream.py        a background thread that prepares inputs ahead of the device; a progress bar.
encode_files.py  finding image and video files, loading and preprocessing them, and the encode
                 loop with progress, periodic saves, --resume and --keep-going.
embeddings.py    the embeddings file (safetensors / npz) and its sharded form (one per process).
"""
