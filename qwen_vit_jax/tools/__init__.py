"""What a person runs. Read in this order:

args.py          what the commands share: options defined once, `--sizes`, the help texts.
cli.py           `qwen-vit-jax`: every subcommand through argparse.
targets.py       the accelerators `aot` compiles for, from their data sheets.
aot.py           compiling the encoder's programs for an accelerator this machine does not have.
demo.py          a random-weight checkpoint in the real HF layout -> convert -> encode -> PCA picture.
hf_reference.py  HF transformers as the reference (tests, `verify`, benchmarks): configs, models.
"""
