"""Guards on the hot path's structure, not its speed: the program the real-size Qwen2.5-VL-3B tower
runs on the CPU for one 1296-patch image (its 1536-row bucket), traced and compiled from shapes
alone (no weights). A change that makes the forward slower by changing what it computes (a dot in
another dtype, more dots, a transposed or copied weight, padding) fails here on any machine, where
a timing would only be noise on a shared 2-core runner.

What is pinned is what the fast version does (docs/numerics.md, "Precision rules"):
  - every dot_general takes its operands in the compute dtype and accumulates in float32;
  - the number of dots, and of transposes of anything weight-sized, per layer kind;
  - the compiled program copies or transposes no buffer as large as a weight matrix;
  - the matmul FLOPs the program does against the ideal (real rows only).
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import jax
import jax.extend.core as jax_core
import numpy as np
import pytest
from flax import nnx

from qwen_vit_jax.plan import segment_lengths
from qwen_vit_jax.presets import QWEN2_5_VL_3B
from qwen_vit_jax.runtime import cost
from qwen_vit_jax.runtime.program import forward, input_specs
from qwen_vit_jax.tools import aot

CFG = QWEN2_5_VL_3B
GRID = [[1, 36, 36]]  # 1296 patches, the image
WEIGHT = CFG.width * CFG.intermediate_size  # the smallest MLP matrix, elements (1280 x 3420)


def _bucket():
    (bucket, _), *_ = aot.buckets_for(CFG, [GRID])
    return bucket


@functools.cache
def _traced(dtype: str):
    """The forward traced once per dtype for the session (the compile test reuses the bf16 trace)."""
    graphdef, state = nnx.split(aot.abstract_model(CFG, dtype, "cpu"))
    state = jax.eval_shape(aot.as_bits, state)
    specs = input_specs(CFG, _bucket(), dtype, 1)  # uint8 Patches: what encode_images and the CLI send
    return jax.jit(lambda s, px, plan: forward(graphdef, s, px, plan)).trace(state, *specs)


def _eqns(jaxpr, times: int = 1):
    """(eqn, how many times it runs) for every equation, loop bodies times their trip counts."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn, times
        n = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for sub in jax_core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub, times * n)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def traced(request):
    return request.param, _traced(request.param)


def test_every_dot_in_the_compute_dtype_accumulating_in_float32(traced):
    dtype, t = traced
    kinds = Counter()
    for eqn, n in _eqns(t.jaxpr):
        if eqn.primitive.name == "dot_general":
            a, b = (str(v.aval.dtype) for v in eqn.invars)
            kinds[a, b, str(eqn.params["preferred_element_type"]), str(eqn.outvars[0].aval.dtype)] += n
    assert dict(kinds) == {(dtype, dtype, "float32", "float32"): sum(kinds.values())}, kinds


def test_dot_and_transpose_counts(traced):
    """Per call of the 1536-row bucket: the dots (patch embedding, per block qkv / attention tiles
    / proj / 3 SwiGLU matrices, the merger) and the transposes of anything weight-sized. The
    numbers of the fast version; a change must justify a new number with a benchmark. (958bdcf's
    tile loops, each head's strided columns rotated inside the loop, give 32 activation
    transposes: the one structural difference from today's head-major slabs, in both dtypes.)"""
    dtype, t = traced
    rows = _bucket().patches * CFG.width  # an activation [N, D]: q, k, v, a block's input
    counts = Counter()
    for eqn, n in _eqns(t.jaxpr):
        name = eqn.primitive.name
        size = math.prod(eqn.invars[0].aval.shape) if eqn.invars else 0
        if name == "dot_general":
            counts["dot"] += n
        elif name == "transpose" and size >= WEIGHT:
            counts["weight-sized transpose"] += n
        elif name == "transpose" and size >= rows:
            counts["activation transpose"] += n
    assert dict(counts) == {"dot": 1443, "activation transpose": 44}, counts


def test_matmul_flops_against_the_ideal(traced):
    """The program's dots at their padded shapes over the ideal (real rows, real segments only):
    padding to the bucket (1536 rows for 1296: 1.185) and the attention tiles' masked blocks."""
    _, t = traced
    ratio = cost.dot_flops(t.jaxpr) / cost.ideal_flops(CFG, *segment_lengths(GRID, CFG))
    assert ratio <= 1.20, ratio


def test_compiled_program_moves_no_weight():
    """The compiled bf16 program (this CPU's XLA) holds no copy or transpose of a buffer as large as
    a weight matrix: the layer loop reads the stacked weights in place (the TPU's 3420-wide MLP stacks
    were copied whole at every call until Numerics.mlp_multiple; the CPU must never start)."""
    import re

    text = _traced("bfloat16").lower().compile().as_text()
    big = []
    for m in re.finditer(r"= (\w+)\[([\d,]*)\][^ ]* (copy|transpose)\(", text):
        dims = [int(d) for d in m.group(2).split(",") if d]
        if dims and np.prod(dims) >= WEIGHT:
            big.append(m.group(0))
    assert not big, big
