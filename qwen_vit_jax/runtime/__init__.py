"""Running the tower on devices. Read in this order:

program.py    the compiled program of one bucket (one device, or `shard_map` over a mesh) and its
              input shapes.
batching.py   inputs packed into calls by patch budget; sequences cut into even ranges.
devices.py    a request's frames balanced over several local devices, one bucket for all.
cost.py       FLOP accounting: the ideal vs what a bucket's program computes.
encoder.py    `VisionEncoder`: validate once, plan, one transfer, one program per bucket, unpad.
multihost.py  several processes (hosts): jax.distributed start-up, the split of the inputs, barriers.
"""
