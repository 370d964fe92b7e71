"""Running the tower on devices. Read in this order:

program.py    the compiled program of one bucket (one device, or `shard_map` over a mesh), its
              input shapes, and `Programs`: the weights on the devices, one program per bucket.
batching.py   inputs packed into calls by patch budget; sequences cut into even ranges.
devices.py    a request's frames balanced over several local devices, one bucket for all.
cost.py       FLOP accounting: the ideal vs what a bucket's program computes.
pixels.py     a request's pixels checked once; PaddleOCR-VL's raster rows put in merge-unit order.
calls.py      a request's program calls: `prepare` (plan, check, pad) and `run` (one transfer,
              every call, the rows in request order); what the next encode costs.
encoder.py    `VisionEncoder`: the facade over the parts above, the plan layer's `BucketChoice`
              and the `Preprocessing` settings.
multihost.py  several processes (hosts): jax.distributed start-up, the split of the inputs, barriers.
"""
