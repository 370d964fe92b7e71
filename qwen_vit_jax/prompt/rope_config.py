"""The language model's rotary numbers, read from a checkpoint's text config: `TextRotary` (head and
rotary width, theta, mrope_section, the rope type's inverse frequencies and attention scaling) and
the static layout `mrope_tables` follows (`frequency_axes`: which of t / h / w each frequency reads).

HF 5.x computes these in each family's text rotary module (`compute_default_rope_parameters` or
`ROPE_INIT_FUNCTIONS[rope_type]`) from the text config's `rope_parameters`; the family's own choices
(sections or interleave, rotate style, whether the default init reads `partial_rotary_factor`) are
its row of `config.RULES`. numpy only: no torch, transformers or jax.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# How a family recomposes its frequencies from the three position rows (RopeRules.mrope).
SECTIONS = "sections"  # consecutive blocks of mrope_section[k] frequencies read row k % 3 (Qwen2-VL's)
INTERLEAVE = "interleave"  # frequency i reads h if i % 3 == 1 and i < 3 * s[1], w if i % 3 == 2 and
#                            i < 3 * s[2], else t (Qwen3-VL's)
# How the table's two halves are laid out and q / k rotated (RopeRules.rotate).
HALVES = "halves"  # [f, f] and rotate_half: (-x2, x1) over the two halves
PAIRS = "pairs"  # each frequency twice in place, pairs (0::2, 1::2) rotated: GLM-4.1V's rotate_half_llm

# HF 5.x's text config class defaults, used where a config.json leaves a field out (as HF would):
# (hidden_size, num_attention_heads, head_dim (None: hidden // heads), rope_theta,
#  partial_rotary_factor (None: not set), max_position_embeddings).
_TEXT_DEFAULTS = {
    "qwen2_vl": (8192, 64, None, 1e6, None, 32768),
    "qwen2_5_vl": (8192, 64, None, 1e6, None, 32768),
    "qwen3_vl": (4096, 32, 128, 5e5, None, 128000),
    "qwen3_vl_moe": (2048, 16, None, 5e5, None, 128000),
    "qwen3_5": (4096, 16, 256, 1e4, 0.25, 32768),
    "qwen3_5_moe": (2048, 16, 256, 1e4, 0.25, 32768),
    "qwen4_exp": (2048, 16, 256, 1e4, None, 32768),
    "paddleocr_vl": (1024, 16, 128, 5e5, None, 131072),
    "glm4v": (4096, 32, None, 1e4, None, 32768),
    "glm4v_moe": (4096, 96, None, 1e4, 0.5, 65536),
    "qwen2_5_omni": (3584, 28, None, 1e6, None, 32768),
    "qwen3_omni_moe": (2048, 28, None, 1e6, None, 32768),
}
# The families released with 4.4x config.json files, which keep the text model's fields at their
# top level (HF 5.x moves them into text_config); the later families' HF classes read only
# text_config (its class defaults when it is missing).
_FLAT_TEXT = ("qwen2_vl", "qwen2_5_vl", "paddleocr_vl")
_TEXT_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "max_position_embeddings",
)
ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TextRotary:
    """A checkpoint's text rotary: what HF's text rotary module of its family holds.

    head_dim: the attention head width. inv_freq: the rotary_dim // 2 inverse frequencies (float32
    values); rotary_dim = 2 * len(inv_freq) <= head_dim, the rest of a head passes through
    (partial_rotary_factor). attention_scaling: multiplies cos and sin (yarn's; 1.0 otherwise).
    mrope_section: t / h / w frequency counts (the config's, else the family's default).
    """

    rope_type: str
    head_dim: int
    rope_theta: float
    mrope_section: tuple[int, ...]
    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    error: str = ""  # why the tables cannot be made (an unsupported rope type, an odd width): mrope_tables raises it

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)


def text_fields(family: str, thinker: dict) -> dict:
    """The text model's config fields: `text_config` (5.x), else the top-level ones of a 4.4x
    file where HF reads them there, else none (HF's class defaults)."""
    text = thinker.get("text_config")
    if isinstance(text, dict):
        return text
    return {k: thinker[k] for k in _TEXT_KEYS if k in thinker} if family in _FLAT_TEXT else {}


def read_text_rotary(family: str, text: dict, mrope_section: tuple, reads_partial: bool, where: str) -> TextRotary:
    """`TextRotary` from the text config fields (HF's standardisation: `rope_scaling` before
    `rope_parameters`, `rope_theta` / `partial_rotary_factor` inside it or beside it, "mrope" is
    "default"). A rope type whose tables depend on call history or sequence length ("dynamic",
    "longrope") or an odd rotary width gives a TextRotary whose `error` says so (naming `where`):
    the prompt's positions do not need the rotary, only `mrope_tables` raises."""
    try:
        return _read(family, text, mrope_section, reads_partial, where)
    except ValueError as e:
        return TextRotary(rope_type="", head_dim=0, rope_theta=0.0, mrope_section=(), inv_freq=(), error=str(e))


def _read(family: str, text: dict, mrope_section: tuple, reads_partial: bool, where: str) -> TextRotary:
    hidden, heads, head_dim, theta, partial, max_pos = _TEXT_DEFAULTS[family]
    hidden = int(text.get("hidden_size", hidden))
    heads = int(text.get("num_attention_heads", heads))
    head_dim = int(text.get("head_dim", head_dim) or hidden // heads)
    rp = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
    theta = float(rp.get("rope_theta", text.get("rope_theta", theta)))
    partial = rp.get("partial_rotary_factor", text.get("partial_rotary_factor", partial))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    rope_type = "default" if rope_type == "mrope" else rope_type
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{where}: rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)}; HF's "
            "'dynamic' and 'longrope' change their frequencies with the sequence length at run time)"
        )
    # HF's default init of most families ignores partial_rotary_factor; the other rope types read it
    dim = (
        int(head_dim * float(partial))
        if partial is not None and (reads_partial or rope_type != "default")
        else head_dim
    )
    if dim < 2 or dim > head_dim or dim % 2:
        raise ValueError(f"{where}: rotary width {dim} for head_dim {head_dim} (partial_rotary_factor {partial})")
    sections = tuple(int(s) for s in rp.get("mrope_section", mrope_section))
    inv, scaling = _inv_freq(rope_type, rp, dim, theta, int(text.get("max_position_embeddings", max_pos)), where)
    return TextRotary(
        rope_type=rope_type,
        head_dim=head_dim,
        rope_theta=theta,
        mrope_section=sections,
        inv_freq=tuple(float(x) for x in inv),
        attention_scaling=float(scaling),
    )


def _default_inv_freq(dim: int, theta: float) -> np.ndarray:
    """1 / theta^(arange(0, dim, 2) / dim) in float32 as HF's torch code, the power correctly
    rounded: torch's float32 pow is off by one ulp on ~1% of entries (tests/test_rotary.py)."""
    e = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return np.float32(1.0) / (np.float64(theta) ** e.astype(np.float64)).astype(np.float32)


def _inv_freq(rope_type: str, rp: dict, dim: int, theta: float, max_pos: int, where: str):
    """(inv_freq float32 [dim // 2], attention_scaling) of a rope type, HF's formulas in float32."""
    inv = _default_inv_freq(dim, theta)
    if rope_type == "default":
        return inv, 1.0
    if "factor" not in rp and rope_type != "yarn":
        raise ValueError(f"{where}: rope_type {rope_type!r} needs a factor")
    f32 = np.float32
    if rope_type == "linear":
        return inv / f32(rp["factor"]), 1.0
    original = int(rp.get("original_max_position_embeddings", max_pos))
    if rope_type == "llama3":
        factor, lo, hi = float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
        low_wavelen, high_wavelen = original / lo, original / hi
        wavelen = f32(2 * math.pi) / inv
        scaled = np.where(wavelen > f32(low_wavelen), inv / f32(factor), inv)
        smooth = (f32(original) / wavelen - f32(lo)) / f32(hi - lo)
        smoothed = (f32(1) - smooth) * scaled / f32(factor) + smooth * scaled
        medium = ~(wavelen < f32(high_wavelen)) & ~(wavelen > f32(low_wavelen))
        return np.where(medium, smoothed, scaled).astype(f32), 1.0
    # yarn
    factor = rp.get("factor") or max_pos / original
    scaling = rp.get("attention_factor")
    if scaling is None:
        mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
        scaling = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            if mscale and mscale_all
            else _yarn_mscale(factor)
        )
    fast, slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def correction(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos_freqs = (np.float64(theta) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)).astype(np.float64)).astype(f32)
    extrapolation = f32(1) / pos_freqs
    interpolation = f32(1) / (f32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    extra = f32(1) - ramp
    return (interpolation * (f32(1) - extra) + extrapolation * extra).astype(f32), float(scaling)


def _yarn_mscale(scale, mscale=1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def frequency_axes(mrope: str, sections: tuple[int, ...], n: int, where: str = "rotary") -> np.ndarray:
    """Which position row (0 t, 1 h, 2 w) each of the n frequencies reads: int64 [n].

    SECTIONS: HF splits the frequencies into blocks of `sections` (their sum must be n) and block k
    reads row k % 3. INTERLEAVE: frequency i reads h where i % 3 == 1 and i < 3 * sections[1], w
    where i % 3 == 2 and i < 3 * sections[2], t elsewhere."""
    if mrope == SECTIONS:
        if sum(sections) != n or min(sections, default=0) < 0:
            raise ValueError(f"{where}: mrope_section {list(sections)} must add up to the {n} frequencies")
        return np.concatenate([np.full(s, k % 3, np.int64) for k, s in enumerate(sections)])
    if len(sections) < 3:
        raise ValueError(f"{where}: an interleaved mrope_section needs three entries, got {list(sections)}")
    axes = np.zeros(n, np.int64)
    for row in (1, 2):
        axes[row : 3 * sections[row] : 3] = row
    return axes
