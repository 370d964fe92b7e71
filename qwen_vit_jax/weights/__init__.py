"""Checkpoints in and out. Read in this order:

safetensors_io.py  safetensors files: read through the `safetensors` package, errors as
                   CheckpointError naming the file and tensor; written part by part.
keys.py            the key table: every HF vision tensor of every family -> one of our params,
                   its transform and shapes, declared once and read both ways.
hf_read.py         an HF checkpoint's vision tower -> our params, strictly (only vision shards read).
convert.py         our converted directory: `convert_checkpoint` writes it, `load_converted` reads it.
sources.py         what a user passes (converted dir, HF dir, hub id in the local cache) resolved and
                   loaded; `load_model`.
export.py          our tower back into a complete HF checkpoint (`export_hf`).
"""
