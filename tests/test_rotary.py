"""The language model's rotary against HF's own modules, every family: `PromptConfig.rotary` (the
inverse frequencies, rotary width, scaling) against the family's HF text rotary module built from
the same config.json dict; `mrope_tables` against that module's forward; `apply_mrope` against the
family's `apply_rotary_pos_emb`. Float32 and bfloat16, jitted and on the host.

Bars (docs/numerics.md; never loosened):
- inv_freq: within one float32 ulp of HF's (torch's float32 pow is off by one ulp from the correctly
  rounded power on ~1% of entries; ours is the correctly rounded one).
- float32 tables: |ours - HF| <= |position| * |our inv_freq - HF's| + 2^-22 * |angle| where the two
  differ, + 2^-23: what the last bit of inv_freq allows (at most ~2.4e-4 at 1,000 rad where they
  differ, 1.2e-7 where they agree: the two float32 angles are then the same product and only the
  cos / sin implementations differ, by an ulp).
- bfloat16 tables: within one bf16 ulp of HF's float32 tables cast to bf16.
- apply_mrope: equal on numpy and eager jax (each product and sum rounds at the same step as
  torch's, float32 or bf16); jitted, within 2 ulps of the result's scale (XLA fuses the
  multiply-adds).
"""

from __future__ import annotations

import importlib
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from prompt_configs import FAMILIES, config_dict

import qwen_vit_jax as qvj
from qwen_vit_jax.families import OMNI
from qwen_vit_jax.prompt.config import RULES, config_from_dict
from qwen_vit_jax.prompt.rope_config import frequency_axes
from qwen_vit_jax.tools.hf_reference import _hf_classes

# The text models of released checkpoints (their config.json's rotary fields), in the layout each
# was published in: 4.4x top-level `rope_scaling` with "type": "mrope", or 5.x `rope_parameters`.
_MROPE = {"type": "mrope", "mrope_section": [16, 24, 24]}  # 4.4x configs: HF reads it as "default"
_QWEN3 = {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}
_QWEN3_5 = dict(_QWEN3, mrope_section=[11, 11, 10], rope_theta=1e7, partial_rotary_factor=0.25)
_GLM = {"type": "default", "mrope_section": [8, 12, 12]}
REAL_TEXT = {
    "qwen2_vl": dict(hidden_size=1536, num_attention_heads=12, rope_theta=1e6, rope_scaling=_MROPE),
    "qwen2_5_vl": dict(hidden_size=2048, num_attention_heads=16, rope_theta=1e6, rope_scaling=_MROPE),
    "qwen3_vl": dict(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=5e6, rope_scaling=_QWEN3),
    "qwen3_vl_moe": dict(hidden_size=2048, num_attention_heads=32, head_dim=128, rope_theta=1e6, rope_scaling=_QWEN3),
    "qwen3_5": dict(hidden_size=2048, num_attention_heads=16, head_dim=256, rope_parameters=_QWEN3_5),
    "qwen3_5_moe": dict(hidden_size=2048, num_attention_heads=16, head_dim=256, rope_parameters=_QWEN3_5),
    "qwen4_exp": dict(hidden_size=2048, num_attention_heads=16, head_dim=256, rope_parameters=_QWEN3_5),
    # HF 5.x's Omni config classes do not read "mrope" as "default": the released files say "default"
    "qwen2_5_omni": dict(
        hidden_size=2048, num_attention_heads=16, rope_theta=1e6, rope_scaling=dict(_MROPE, type="default")
    ),
    "qwen3_omni_moe": dict(
        hidden_size=2048,
        num_attention_heads=32,
        head_dim=128,
        rope_theta=1e6,
        rope_scaling=dict(_QWEN3, interleaved=True),
    ),
    "paddleocr_vl": dict(
        hidden_size=1024,
        num_attention_heads=16,
        head_dim=128,
        rope_theta=5e5,
        rope_scaling=dict(_MROPE, type="default"),
    ),
    "glm4v": dict(
        hidden_size=4096, num_attention_heads=32, partial_rotary_factor=0.5, rope_theta=1e4, rope_scaling=_GLM
    ),
    "glm4v_moe": dict(
        hidden_size=4096,
        num_attention_heads=96,
        head_dim=128,
        partial_rotary_factor=0.5,
        rope_theta=1e4,
        rope_scaling=_GLM,
    ),
}
# HF's text rotary module and the module holding apply_rotary_pos_emb, per family
HF_ROTARY = {
    "qwen2_vl": "Qwen2VLRotaryEmbedding",
    "qwen2_5_vl": "Qwen2_5_VLRotaryEmbedding",
    "qwen3_vl": "Qwen3VLTextRotaryEmbedding",
    "qwen3_vl_moe": "Qwen3VLMoeTextRotaryEmbedding",
    "qwen3_5": "Qwen3_5TextRotaryEmbedding",
    "qwen3_5_moe": "Qwen3_5MoeTextRotaryEmbedding",
    "qwen4_exp": "Qwen4ExpTextRotaryEmbedding",
    "qwen2_5_omni": "Qwen2_5OmniRotaryEmbedding",
    "qwen3_omni_moe": "Qwen3OmniMoeThinkerTextRotaryEmbedding",
    "paddleocr_vl": "PaddleOCRRotaryEmbedding",
    "glm4v": "Glm4vTextRotaryEmbedding",
    "glm4v_moe": "Glm4vMoeTextRotaryEmbedding",
}


def with_text(family: str, text: dict | None, layout: str = "nested") -> dict:
    """config_dict(family) with its text model's fields replaced: nested in text_config (5.x), or
    at the top level (4.4x; not for the Omni thinkers, whose text config is always nested)."""
    d = config_dict(family)
    owner = d["thinker_config"] if family in OMNI else d
    owner.pop("text_config", None)
    if layout == "top":
        owner.update(text)
    elif text is not None:
        owner["text_config"] = dict(text)
    return json.loads(json.dumps(d))  # HF's config classes change the dicts they are given


def hf_rotary(family: str, d: dict):
    """(HF's text rotary module of `d`, the module with the family's apply_rotary_pos_emb)."""
    hf_cfg = _hf_classes(family)[0].from_dict(json.loads(json.dumps(d)))
    text = hf_cfg.thinker_config.text_config if family in OMNI else hf_cfg.get_text_config()
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(module, HF_ROTARY[family])(text).eval(), module


def ours_vs_hf_inv_freq(cfg, rot) -> tuple[np.ndarray, np.ndarray]:
    ours = np.asarray(cfg.rotary.inv_freq, np.float32)
    theirs = rot.inv_freq.numpy()
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    ulps = np.abs(ours.view(np.int32).astype(np.int64) - theirs.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1, f"inv_freq differs from HF's by {ulps.max()} ulps"
    assert np.float32(cfg.rotary.attention_scaling) == np.float32(rot.attention_scaling)
    return ours, theirs


def random_positions(family: str, rng, batch=2, length=48, top=40000) -> np.ndarray:
    """[3, B, L] positions up to `top` (angles up to `top` rad); Qwen3-Omni's fractional float32."""
    p = rng.integers(0, top, (3, batch, length))
    if RULES[family].float_positions:
        return (p + rng.choice([0.0, 0.5, 1 / 3], p.shape)).astype(np.float32)
    return p.astype(np.int64)


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """The bf16 ulp at |x| (8 significant bits)."""
    a = np.maximum(np.abs(x.astype(np.float64)), 2.0**-126)
    return 2.0 ** (np.floor(np.log2(a)) - 7)


def check_tables(family, cfg, rot, pos):
    """Our tables (jax, jitted and numpy) against HF's module, float32 and bf16, within the bars."""
    ours_inv, hf_inv = ours_vs_hf_inv_freq(cfg, rot)
    with torch.no_grad():
        ref = [t.numpy() for t in rot(torch.zeros(1), torch.from_numpy(pos))]
        ref16 = [t.float().numpy() for t in rot(torch.zeros(1, dtype=torch.bfloat16), torch.from_numpy(pos))]
    # the bound: the positions each column reads (t, h or w), and where our inv_freq differs
    f, width = len(ours_inv), cfg.rotary.rotary_dim
    col = np.arange(width) // 2 if RULES[family].rotate == "pairs" else np.arange(width) % f  # each column's frequency
    rows = frequency_axes(RULES[family].mrope, cfg.rotary.mrope_section, f)[col]
    p = np.abs(np.moveaxis(pos.astype(np.float64)[rows], 0, -1))  # [B, L, R]
    dinv = np.abs(ours_inv.astype(np.float64) - hf_inv)[col]
    bound = p * dinv + 2.0**-22 * p * hf_inv[col] * (dinv > 0) + 2.0**-23
    jitted = jax.jit(lambda q: qvj.mrope_tables(cfg, q))
    for got in (qvj.mrope_tables(cfg, pos), jitted(jnp.asarray(pos)), qvj.mrope_tables(cfg, jnp.asarray(pos))):
        for g, r in zip(got, ref):
            assert g.shape == r.shape and g.dtype == jnp.float32
            err = np.abs(np.asarray(g, np.float64) - r)
            assert (err <= bound).all(), f"{family}: float32 table off by {err.max():.3g} (bound {bound.max():.3g})"
    for g, r in zip(qvj.mrope_tables(cfg, pos, dtype=jnp.bfloat16), ref16):
        assert g.dtype == ml_dtypes.bfloat16
        err = np.abs(np.asarray(g, np.float64) - r)
        assert (err <= bf16_ulp(r)).all(), f"{family}: bf16 table off by more than one bf16 ulp ({err.max():.3g})"
    return ref


def check_apply(family, cfg, module, cos, sin, rng):
    """apply_mrope against the family's apply_rotary_pos_emb on random q / k (HF's own tables)."""
    b, length, r = cos.shape
    dh = cfg.rotary.head_dim
    q = rng.standard_normal((b, length, 3, dh)).astype(np.float32)
    k = rng.standard_normal((b, length, 2, dh)).astype(np.float32)
    for dtype, tdtype in ((np.float32, torch.float32), (ml_dtypes.bfloat16, torch.bfloat16)):
        tq, tk, tc, ts = (torch.from_numpy(np.asarray(a, np.float32)).to(tdtype) for a in (q, k, cos, sin))
        with torch.no_grad():  # HF's layout [B, H, L, D] with unsqueeze_dim 1 is ours transposed: [B, L, H, D], 2
            rq, rk = module.apply_rotary_pos_emb(tq, tk, tc, ts, unsqueeze_dim=2)
        args = [np.asarray(a).astype(dtype) for a in (q, k, cos, sin)]
        jitted = jax.jit(lambda *a: qvj.apply_mrope(*a, cfg))(*args)
        for got in (qvj.apply_mrope(*args, cfg), qvj.apply_mrope(*map(jnp.asarray, args), cfg), jitted):
            for g, ref in zip(got, (rq, rk)):
                ref = ref.float().numpy()
                assert g.shape == ref.shape and g.dtype == dtype
                g = np.asarray(g, np.float32)
                if got is jitted:  # XLA fuses the multiply-add where torch rounds each product
                    np.testing.assert_allclose(g, ref, rtol=0, atol=2 * np.spacing(np.abs(ref).max().astype(dtype)))
                else:  # numpy and eager jax: each product and sum rounded as torch's
                    np.testing.assert_array_equal(g, ref)
    # the pass-through dimensions of a partial rotary are q's own
    if r < dh:
        np.testing.assert_array_equal(np.asarray(qvj.apply_mrope(q, k, cos, sin, cfg)[0])[..., r:], q[..., r:])


@pytest.mark.parametrize("family", FAMILIES)
def test_rotary_equals_hf(family):
    """Each family, the released text model's rotary fields: tables and rotation equal HF's."""
    rng = np.random.default_rng(7)
    d = with_text(family, REAL_TEXT[family])
    cfg = config_from_dict(d)
    rot, module = hf_rotary(family, d)
    assert cfg.rotary.rotary_dim == 2 * len(rot.inv_freq)
    pos = random_positions(family, rng)
    cos, sin = check_tables(family, cfg, rot, pos)
    check_apply(family, cfg, module, cos, sin, rng)


@pytest.mark.parametrize("family", FAMILIES)
def test_rotary_defaults_and_layouts_equal_hf(family):
    """What HF's config classes fill in: no text fields at all (the class defaults), the tiny test
    text models, and (not for the thinkers) the 4.4x top-level layout."""
    rng = np.random.default_rng(3)
    cases = [with_text(family, None), config_dict(family)]
    if family not in OMNI:
        cases.append(with_text(family, REAL_TEXT[family], layout="top"))
    for d in cases:
        cfg = config_from_dict(d)
        rot, _ = hf_rotary(family, d)
        hf = rot.config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        try:  # some class defaults do not work in HF either: Qwen3-Omni's and GLM-4.5V's odd head widths
            # (2048 / 28, 4096 / 96 / 2: tables wider than q), GLM-4.1V's 64 frequencies in [8, 12, 12]
            rot(torch.zeros(1), torch.zeros((3, 1, 1), dtype=torch.long))
            broken = 2 * len(rot.inv_freq) > head_dim
        except RuntimeError:
            broken = True
        if broken:
            with pytest.raises(ValueError, match="rotary width|must add up to the"):
                qvj.mrope_tables(cfg, np.zeros((3, 1, 1), np.int64))
            continue
        assert cfg.rotary.head_dim == head_dim
        check_tables(family, cfg, rot, random_positions(family, rng, length=8))


@pytest.mark.parametrize(
    "family, rope",
    [
        ("qwen2_5_vl", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
        ("qwen3_vl", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536, "beta_fast": 16}),
        ("qwen2_vl", {"rope_type": "linear", "factor": 2.0}),
        ("qwen3_vl", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
    ],
)  # fmt: skip
def test_rope_types_equal_hf(family, rope):
    """The scaled rope types: inverse frequencies and yarn's attention scaling as HF's."""
    text = dict(REAL_TEXT[family])
    text.pop("rope_scaling", None)
    text["rope_parameters"] = {**rope, "mrope_section": list(RULES[family].mrope_section), "rope_theta": 1e6}
    d = with_text(family, text)
    cfg = config_from_dict(d)
    rot, _ = hf_rotary(family, d)
    assert cfg.rotary.rope_type == rope["rope_type"]
    assert (cfg.rotary.attention_scaling != 1) == (rope["rope_type"] == "yarn")
    check_tables(family, cfg, rot, random_positions(family, np.random.default_rng(0), length=8))


def test_rotary_errors_and_dtypes():
    d = with_text("qwen2_5_vl", REAL_TEXT["qwen2_5_vl"])
    cfg = config_from_dict(d)
    pos = np.arange(12).reshape(1, 12)
    cos, sin = qvj.mrope_tables(cfg, pos)  # [B, L]: text, all three rows alike (HF's expand)
    np.testing.assert_array_equal(cos, qvj.mrope_tables(cfg, np.broadcast_to(pos, (3, 1, 12)))[0])
    assert isinstance(cos, np.ndarray) and cos.shape == (1, 12, 128)
    with pytest.raises(ValueError, match=r"position_ids must be \[3, B, L\] or \[B, L\]"):
        qvj.mrope_tables(cfg, np.zeros((2, 1, 12), np.int64))
    q = np.zeros((1, 12, 2, 128), np.float32)
    with pytest.raises(ValueError, match=r"k must be \[B, L, H, Dh\]"):
        qvj.apply_mrope(q, q[:, :6], cos, sin, cfg)
    with pytest.raises(ValueError, match="cos and sin must both be"):
        qvj.apply_mrope(q, q, cos, sin[..., :64], cfg)
    bad = config_from_dict(with_text("qwen2_5_vl", dict(REAL_TEXT["qwen2_5_vl"], rope_scaling={"type": "dynamic"})))
    qvj.rope_index(bad, np.array([[1, 2, 3]]))  # the positions do not need the rotary
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        qvj.mrope_tables(bad, pos)
    odd = with_text(
        "qwen2_5_vl", dict(REAL_TEXT["qwen2_5_vl"], rope_scaling={"type": "mrope", "mrope_section": [16, 24, 23]})
    )
    with pytest.raises(ValueError, match=r"mrope_section \[16, 24, 23\] must add up to the 64 frequencies"):
        qvj.mrope_tables(config_from_dict(odd), pos)
    hand = qvj.PromptConfig(family="qwen2_5_vl", image_token_id=1, video_token_id=2, vision_start_token_id=3,
                            vision_end_token_id=4)  # fmt: skip
    with pytest.raises(ValueError, match="no text rotary numbers"):
        qvj.mrope_tables(hand, pos)
