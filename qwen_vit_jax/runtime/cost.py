"""FLOP accounting: what the model needs (analytic) vs what a bucket's program computes.

`ideal_flops` counts the matmuls of the tower on the real rows only, with attention over
the real segments (frames, windows): what an exact, padding-free implementation must do.
`dot_flops` counts the matmuls of the program that actually runs: every dot_general of the
traced forward (the same jaxpr that is compiled), 2 FLOPs per multiply-add at its padded
shapes, each loop body (scan: the layer loops, the attention tile loops) times its trip
count. XLA's own cost analysis counts a loop body once, so it cannot be used on the scanned
program; elementwise work is left out on both sides.
"""

from __future__ import annotations

import math

import jax.extend.core as jax_core
import numpy as np

from qwen_vit_jax.config import VisionConfig


def ideal_flops(cfg: VisionConfig, frame_lengths, window_lengths) -> float:
    """Analytic FLOPs (2 per multiply-add) of the tower on real rows only: patch embedding,
    blocks (SwiGLU: 3 matrices; the fc1 / fc2 MLP: 2), the merger (GLM's: downsample, proj and a
    SwiGLU) and Qwen3-VL's deepstack
    mergers (each the merger's two matrices: the encoder computes them with every call). The
    position-table gather is elementwise work: not counted (nor is it in `dot_flops`).

    Args:
      frame_lengths: rows of every frame (full-attention segments).
      window_lengths: rows of every window (window-attention segments; empty for Qwen2-VL).
    """
    d, i = cfg.width, cfg.intermediate_size
    frames = np.asarray(frame_lengths, np.float64)
    windows = np.asarray(window_lengths, np.float64)
    n = frames.sum()
    mlp = (3 if cfg.mlp == "swiglu" else 2) * 2 * d * i
    per_row = 2 * cfg.patch_dim * d + cfg.depth * (2 * d * 3 * d + 2 * d * d + mlp)
    merge = 2 * (cfg.merge_unit * d) ** 2 + 2 * cfg.merge_unit * d * cfg.out_dim
    if cfg.merger == "glm":  # downsample [4D, O], proj [O, O], SwiGLU 3 x [O, J]
        o, j = cfg.out_dim, cfg.merger_intermediate_size
        merge = 2 * cfg.merge_unit * d * o + 2 * o * o + 3 * 2 * o * j
    full_layers = sum(cfg.full_attention_layers)
    attention = 4 * d * (full_layers * np.square(frames).sum() + (cfg.depth - full_layers) * np.square(windows).sum())
    mergers = 1 + cfg.num_deepstack
    return float(n * per_row + mergers * n / cfg.merge_unit * merge + attention)


def dot_flops(jaxpr) -> float:
    """FLOPs (2 per multiply-add) of every dot_general in a (closed) jaxpr, loop bodies times
    their trip counts (scan `length`; fori_loop with static bounds and lax.map are scans).
    Nested calls (pjit, checkpoint, custom_jvp / custom_vjp) count once per call; a Pallas kernel
    (the platforms' attention kernels) once per point of its grid, a conditional inside it (a
    block the kernel may skip) as if taken. A while loop or a conditional outside a kernel has no
    static trip count: ValueError (the forward has neither)."""

    def flops(eqn):
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)

    def kernel(eqn):
        return math.prod(eqn.params["grid_mapping"].grid) * _sum_dots(eqn.params["jaxpr"], flops, kernel, True)

    return _sum_dots(jaxpr, flops, kernel)


def dot_bytes(jaxpr) -> float:
    """Bytes the matmuls of a (closed) jaxpr move if each dot_general reads both operands and
    writes its result once, at their dtypes, loop bodies times their trip counts (as `dot_flops`).
    An estimate of the program's memory traffic for a roofline: the weights (read once per layer)
    and the activations every matmul reads and writes; elementwise work that XLA does not fuse
    into a matmul adds to it. A Pallas kernel counts its operands and results once (its inner dots
    work on chip)."""

    def moved(eqn):
        return float(sum(_nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars)))

    return _sum_dots(jaxpr, moved, moved)


def _nbytes(aval) -> int:
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _sum_dots(jaxpr, measure, kernel, in_kernel: bool = False) -> float:
    """measure(eqn) summed over every dot_general of a (closed) jaxpr and kernel(eqn) over every
    Pallas call, loop bodies times their trip counts, nested calls once per call; a while loop or
    a conditional: ValueError outside a kernel, the largest branch inside one."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # ClosedJaxpr -> Jaxpr
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += measure(eqn)
        elif name == "pallas_call":
            total += kernel(eqn)
        elif name == "cond" and in_kernel:
            total += max(_sum_dots(b, measure, kernel, True) for b in eqn.params["branches"])
        elif name in ("while", "cond"):
            raise ValueError(f"dot_flops: a {name} has no static trip count")
        else:
            times = eqn.params["length"] if name == "scan" else 1
            for sub in jax_core.jaxprs_in_params(eqn.params):
                total += times * _sum_dots(sub, measure, kernel, in_kernel)
    return total
