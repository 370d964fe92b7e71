"""The tower as a Flax NNX module and how its matmuls run. Read in this order:

  numerics.py       `Numerics`: operand dtype (float32 / bf16 with float32 accumulation), the CPU's
                    tile loops, the attention kernel, the TPU's MLP padding; chosen per device
                    (`numerics_for`) or per platform without one (`platform_numerics`).
  attention.py      window attention (packed slots) and per-frame attention (host-planned tiles)
                    on static shapes: the XLA schedules, the reference.
  attention_gpu.py  the same tiles as one Pallas Triton kernel (NVIDIA GPUs).
  attention_tpu.py  the same tiles through Pallas splash attention (TPUs).
  vit.py            the model top to bottom: patch embedding, position table, blocks, mergers;
                    abstract init and filling the parameters.
  lora.py           LoRA adapters on the stacked blocks (Flax's nnx.LoRA), and merging them.

Nothing here reads a file or plans an index: parameters come from weights/, plans from plan/.
"""
