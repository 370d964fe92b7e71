"""The language model's rotary, as each family's HF text rotary module and `apply_rotary_pos_emb`
compute it: `mrope_tables` turns the [3, B, L] positions of `rope_index` / `decode_positions` into
the cos / sin tables that multiply q and k, `apply_mrope` rotates q and k with them.

    cos, sin = qvj.mrope_tables(ckpt, position_ids, dtype=jnp.bfloat16)   # [B, L, rotary_dim] each
    q, k = qvj.apply_mrope(q, k, cos, sin, ckpt)                          # q, k [B, L, H, Dh]

Every family is the same computation on its row of rules (config.RULES) and its rotary numbers
(PromptConfig.rotary): frequency i reads position row `frequency_axes[i]` (t, h or w: blocks of
mrope_section, or interleaved), the angle is position * inv_freq[i] in float32, cos and sin are
scaled by the rope type's attention_scaling and cast to `dtype` (HF: `cos.to(x.dtype)`); the table
is the frequencies twice, as halves ([f, f], rotate_half) or pairs (GLM-4.1V: each frequency twice in
place, rotate_half_llm). Heads wider than the table (partial_rotary_factor) pass their other
dimensions through. Taking each frequency's row before the cos (HF takes it after) computes a third
of the cosines and gives the same numbers.

Both work on jax arrays (jittable: positions in, tables out; the checkpoint's numbers are read on
the host when traced) and on numpy arrays (host numpy, bf16 through ml_dtypes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .config import PromptConfig, RopeRules, prompt_config
from .rope_config import PAIRS, TextRotary, frequency_axes


@functools.lru_cache(maxsize=64)
def _layout(rules: RopeRules, rotary: TextRotary, where: str):
    """(frequency_axes int64 [F], inv_freq float32 [F], attention_scaling float32, pairs)."""
    inv = np.asarray(rotary.inv_freq, np.float32)
    axes = frequency_axes(rules.mrope, rotary.mrope_section, len(inv), where)
    return axes, inv, np.float32(rotary.attention_scaling), rules.rotate == PAIRS


def _rotary(source) -> tuple[PromptConfig, tuple]:
    cfg = prompt_config(source)
    if cfg.rotary is None:
        raise ValueError(
            f"{cfg.family}: this PromptConfig has no text rotary numbers (built by hand?); read it from the "
            "checkpoint's config with qvj.prompt_config"
        )
    if cfg.rotary.error:
        raise ValueError(cfg.rotary.error)
    return cfg, _layout(cfg.rules, cfg.rotary, cfg.family)


def _xp(*arrays):
    """jnp if any input is a jax array (or a tracer), else numpy."""
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def mrope_tables(source, position_ids, dtype=jnp.float32):
    """The cos and sin tables of the checkpoint's text rotary for these positions: what HF's text
    rotary module of the family returns (`rotary_emb(x, position_ids)` with x of `dtype`).

    Args:
        source: a PromptConfig or what `prompt_config` takes (read once, on the host).
        position_ids: [3, B, L] (t, h, w rows: `rope_index`, `decode_positions`; int, or float32 for
            Qwen3-Omni) or [B, L] (text: the same position in all three rows, as HF expands it). A
            jax array (traced or not) gives jax arrays; a numpy array gives numpy arrays.
        dtype: the tables' dtype (HF's: the hidden states' dtype); computed in float32, then cast.
    Returns:
        (cos, sin), each [B, L, rotary_dim] (rotary_dim = PromptConfig.rotary.rotary_dim <= head_dim).
    Raises:
        ValueError for positions of another shape, a config without rotary numbers.
    """
    cfg, (axes, inv, scaling, pairs) = _rotary(source)
    xp = _xp(position_ids)
    pos = xp.asarray(position_ids)
    if pos.ndim == 2:
        pos = pos[None]
    if pos.ndim != 3 or pos.shape[0] not in (1, 3):
        raise ValueError(f"position_ids must be [3, B, L] or [B, L], got shape {tuple(pos.shape)}")
    rows = np.zeros_like(axes) if pos.shape[0] == 1 else axes
    angles = xp.moveaxis(xp.take(pos.astype(xp.float32), rows, axis=0), 0, -1) * inv  # [B, L, F] float32
    cos, sin = xp.cos(angles), xp.sin(angles)
    if scaling != 1:
        cos, sin = cos * scaling, sin * scaling
    if pairs:  # [B, L, F] -> [B, L, 2F]: f0 f0 f1 f1 ...
        cos, sin = xp.repeat(cos, 2, axis=-1), xp.repeat(sin, 2, axis=-1)
    else:  # f0 .. fF-1 f0 .. fF-1
        cos, sin = xp.concatenate([cos, cos], axis=-1), xp.concatenate([sin, sin], axis=-1)
    return cos.astype(dtype), sin.astype(dtype)


def apply_mrope(q, k, cos, sin, source):
    """q and k rotated as the family's attention rotates them (HF's `apply_rotary_pos_emb`): the
    first rotary_dim dimensions of each head by the tables, the rest passed through.

    Args:
        q: [B, L, H, Dh]; k: [B, L, Hk, Dh] (its own head count).
        cos, sin: [B, L, R] from `mrope_tables` (R even, R <= Dh).
        source: a PromptConfig or what `prompt_config` takes: the rotate style (halves, or GLM-4.1V's
            pairs).
    Returns:
        (q, k) rotated, their shapes; the dtype of q * cos (bf16 q and tables stay bf16, each product
        and sum rounded as HF's bf16 tensors are).
    """
    cfg, (_, _, _, pairs) = _rotary(source)
    xp = _xp(q, k, cos, sin)
    q, k, cos, sin = (xp.asarray(a) for a in (q, k, cos, sin))
    r = cos.shape[-1]
    if cos.ndim != 3 or sin.shape != cos.shape or r % 2:
        raise ValueError(f"cos and sin must both be [B, L, R] with R even, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    for name, x in (("q", q), ("k", k)):
        if x.ndim != 4 or x.shape[:2] != cos.shape[:2] or x.shape[-1] < r:
            raise ValueError(
                f"{name} must be [B, L, H, Dh] with [B, L] = {tuple(cos.shape[:2])} and Dh >= {r}, got {tuple(x.shape)}"
            )
    c, s = cos[:, :, None, :], sin[:, :, None, :]  # [B, L, 1, R]: every head

    def rotate(x):
        xr = x[..., :r]
        if pairs:  # rotate_half_llm: (x0, x1) -> (-x1, x0) for each pair
            half = xp.stack([-xr[..., 1::2], xr[..., 0::2]], axis=-1).reshape(xr.shape)
        else:  # rotate_half: the two halves
            half = xp.concatenate([-xr[..., r // 2 :], xr[..., : r // 2]], axis=-1)
        out = xr * c + half * s
        return out if r == x.shape[-1] else xp.concatenate([out, x[..., r:].astype(out.dtype)], axis=-1)

    return rotate(q), rotate(k)
