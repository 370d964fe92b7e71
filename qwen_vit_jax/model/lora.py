"""LoRA on the tower's block projections with Flax's own `nnx.LoRA`: `add_lora`, `merge_lora`.

The blocks are stacked (every parameter leads with [depth]) and run under lax.scan, one layer's
slice at a time (vit.py). The adapters are therefore stacked the same way: `add_lora` replaces
a block Linear (kernel [L, in, out]) by a `LoRA` module whose `base_module` is that Linear and
whose `lora_a` [L, in, r], `lora_b` [L, r, out] and `scale` [L] are sliced with it, so the
forward, remat and the scan need no change. "Chosen layers" are a per-layer scale: alpha / rank
on the chosen blocks, 0 elsewhere. The unchosen rows then get exactly zero gradients, so an
optimizer over `nnx.LoRAParam` leaves them at their initial values and they never change the
output.

  model = qvj.load_model(path)
  qvj.add_lora(model, 8, targets=("qkv", "proj"), layers=[28, 29, 30, 31], rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.LoRAParam)   # train the adapters only
  ...
  qvj.merge_lora(model)        # back to the plain tower: kernel += scale * lora_a @ lora_b

`lora_b` starts at zero (nnx.LoRA's default), so a fresh adapter leaves the output unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen_vit_jax.model.vit import Linear

# Short name -> (the block's submodule, attribute); which ones exist depends on the variant's MLP.
TARGETS = {
    "qkv": ("attn", "qkv"),
    "proj": ("attn", "proj"),
    "fc1": ("mlp", "fc1"),
    "fc2": ("mlp", "fc2"),
    "gate": ("mlp", "gate"),
    "up": ("mlp", "up"),
    "down": ("mlp", "down"),
}
_HIGHEST = jax.lax.Precision.HIGHEST  # the project's float32 matmuls (docs/numerics.md)


class LoRAScale(nnx.Variable):
    """The per-layer LoRA scale (alpha / rank, or 0 for a layer left out): a constant, not trained."""


class LoRA(nnx.LoRA):
    """`nnx.LoRA` wrapping a block Linear, with a per-layer scale:
    y = base_module(x) + scale * (x @ lora_a @ lora_b), the adapter path in float32."""

    def __init__(self, in_features: int, rank: int, out_features: int, *, scale: jax.Array, rngs: nnx.Rngs):
        super().__init__(in_features, rank, out_features, rngs=rngs)
        self.scale = LoRAScale(jnp.asarray(scale, jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., in] -> [..., out] float32."""
        y = self.base_module(x)
        xa = jnp.matmul(x.astype(jnp.float32), self.lora_a[...], precision=_HIGHEST)  # [..., r]
        return y + self.scale[...] * jnp.matmul(xa, self.lora_b[...], precision=_HIGHEST)


def _layer_scales(layers, depth: int, scale: float) -> np.ndarray:
    """`layers` (None = all; block indices; or a [depth] per-layer mask / weights) -> [depth] scales."""
    if layers is None:
        return np.full(depth, scale, np.float32)
    a = np.asarray(layers)
    if a.dtype == bool or a.dtype.kind == "f":  # a mask or per-layer weights
        if a.shape != (depth,):
            raise ValueError(f"layers: a per-layer mask needs {depth} entries, got shape {a.shape}")
        return (a.astype(np.float32) * scale).astype(np.float32)
    idx = [int(i) for i in np.atleast_1d(a)]
    bad = [i for i in idx if not 0 <= i < depth]
    if bad or len(set(idx)) != len(idx) or not idx:
        raise ValueError(f"layers: block indices must be distinct, in 0 .. {depth - 1}, got {list(idx)}")
    out = np.zeros(depth, np.float32)
    out[idx] = scale
    return out


def _stacked_lora(base: Linear, rank: int, scales: np.ndarray, rngs: nnx.Rngs) -> LoRA:
    """One LoRA per block, stacked like the blocks (nnx.vmap over fresh keys, as vit.py builds
    them): lora_a [L, in, r], lora_b [L, r, out], scale [L]."""
    depth, din, dout = base.kernel[...].shape  # [L, in, out]

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0, 0), out_axes=0)
    def make(rngs, scale):
        return LoRA(din, rank, dout, scale=scale, rngs=rngs)

    return make(rngs, jnp.asarray(scales))


def add_lora(
    model,
    rank: int,
    *,
    targets: Iterable[str] = ("qkv", "proj"),
    layers=None,
    alpha: float | None = None,
    rngs: nnx.Rngs,
):
    """Add LoRA adapters to chosen projections of chosen blocks, in place.

    Args:
      model: a `VisionTransformer` (load_model).
      rank: the adapters' rank r.
      targets: block projections, by name: "qkv", "proj" (attention), and "fc1", "fc2" (Qwen2-VL,
        Qwen3) or "gate", "up", "down" (Qwen2.5-VL's SwiGLU).
      layers: None (every block), block indices, or a [depth] per-layer mask (bool) or weight (float).
      alpha: the LoRA alpha; the update is scaled by alpha / rank (default alpha = rank: scale 1).
      rngs: for `lora_a` (nnx.LoRA's He-uniform init; `lora_b` starts at zero).
    Returns:
      the model (changed in place).
    Raises:
      ValueError naming an unknown or repeated target, a bad rank or bad layers.
    """
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    targets = tuple(targets)
    blocks, depth = model.blocks, model.cfg.depth
    unknown = [t for t in targets if t not in TARGETS or not hasattr(getattr(blocks, TARGETS[t][0]), TARGETS[t][1])]
    if unknown or not targets or len(set(targets)) != len(targets):
        have = [t for t, (m, a) in TARGETS.items() if hasattr(getattr(blocks, m), a)]
        raise ValueError(f"targets: {list(targets)} (unknown or repeated: {unknown}); this tower has {have}")
    scales = _layer_scales(layers, depth, (rank if alpha is None else alpha) / rank)
    for t in targets:
        parent, name = getattr(blocks, TARGETS[t][0]), TARGETS[t][1]
        base = getattr(parent, name)
        if not isinstance(base, Linear):
            raise ValueError(f"targets: {t!r} already has a LoRA adapter (merge_lora first)")
        lora = _stacked_lora(base, rank, scales, rngs)
        lora.base_module = nnx.data(base)  # None at construction (static): now a submodule
        setattr(parent, name, lora)
    return model


def _merged_kernel(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
    """kernel [L, in, out] + scale [L] * a [L, in, r] @ b [L, r, out], in float32, in kernel's dtype."""
    delta = jnp.einsum("lir,lro->lio", a.astype(jnp.float32), b.astype(jnp.float32), precision=_HIGHEST)
    return (kernel.astype(jnp.float32) + scale.astype(jnp.float32)[:, None, None] * delta).astype(kernel.dtype)


def _adapters(model) -> list[tuple[nnx.Module, str, LoRA]]:
    """(parent module, attribute, LoRA) of every adapter in the blocks."""
    found = []
    for sub in ("attn", "mlp"):
        parent = getattr(model.blocks, sub)
        for _, name in (v for v in TARGETS.values() if v[0] == sub):
            m = getattr(parent, name, None)
            if isinstance(m, LoRA):
                found.append((parent, name, m))
    return found


def merge_lora(model):
    """Fold every adapter into its base kernel (kernel += scale * lora_a @ lora_b, per layer, float32
    then the kernel's dtype) and put the plain Linear back, in place: the model is again exactly the
    `load_model` structure (export_hf, the encoder's params). Returns the model."""
    for parent, name, lora in _adapters(model):
        base = lora.base_module
        base.kernel[...] = _merged_kernel(base.kernel[...], lora.lora_a[...], lora.lora_b[...], lora.scale[...])
        setattr(parent, name, base)
    return model


def merged_params(model) -> dict[str, jax.Array]:
    """The model's parameters as `load_model` lays them out (flat keys, e.g.
    "blocks.attn.qkv.kernel" [L, D, 3D]), adapters merged exactly as `merge_lora` would, without
    changing the model (export_hf)."""
    flat = {tuple(str(k) for k in path): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    scales = {tuple(str(k) for k in path): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, LoRAScale))}
    out = {}
    for path, value in flat.items():
        if path[-1] in ("lora_a", "lora_b"):
            continue
        if "base_module" in path:  # [..., target, "base_module", leaf]: the wrapped Linear's params
            i = path.index("base_module")
            owner = path[:i]
            if path[i + 1 :] == ("kernel",):
                value = _merged_kernel(
                    value, flat[(*owner, "lora_a")], flat[(*owner, "lora_b")], scales[(*owner, "scale")]
                )
            path = owner + path[i + 1 :]
        out[".".join(path)] = value
    return out
