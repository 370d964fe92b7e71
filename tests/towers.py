"""The test towers: every tiny vision config the tests build, defined once (shrunk from a released
preset with `dataclasses.replace`), and the session's registry that builds each tower at most once
per run (tests/conftest.py's `towers` fixture): its HF model (random weights, every vision parameter
re-initialised the docs/numerics.md way), the folder HF's `save_pretrained` wrote, our converted
folder and an encoder per dtype, each made on first use.

A tower is shared by every test file that names it, so a test never changes what it is given: a
test that needs another dtype or layout of the HF model works on `copy.deepcopy(tower.hf)`, one that
changes an encoder's state (warmups, tight buckets) builds its own from `tower.ours`. Seeds are the
registry's: a test that needs other weights builds its own model.

The real-size checks (`check_real_size`) build the released tower once per test: HF's reference is
computed once, the checkpoint converted once, and float32 and bfloat16 are loaded from the converted
folder.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import pathlib
import shutil
import time

import numpy as np

from qwen_vit_jax.config import VisionConfig
from qwen_vit_jax.families import GLM4V, PADDLEOCR_VL, QWEN3_5
from qwen_vit_jax.presets import PRESETS, QWEN2_5_VL_3B, QWEN2_VL_2B, QWEN3_5_27B, QWEN3_VL_8B
from qwen_vit_jax.tools.demo import (
    HUB_PREPROCESSOR,
    HUB_PREPROCESSOR_GLM4V,
    HUB_PREPROCESSOR_PADDLEOCR,
    HUB_PREPROCESSOR_QWEN3,
)

# ---- tiny towers with an HF twin (parity, conversion, gradients) -----------------------------------
HD16 = dict(width=64, num_heads=4, out_dim=48)  # head_dim 16
# Qwen2.5-VL: window (blocks 0, 2) and full (1, 3) attention
Q25 = dataclasses.replace(QWEN2_5_VL_3B, **HD16, depth=4, intermediate_size=96, fullatt_block_indexes=(1, 3))
# head_dim 32, one full-attention block
Q25_HD32 = dataclasses.replace(
    QWEN2_5_VL_3B, depth=4, width=128, num_heads=4, intermediate_size=176, out_dim=64, fullatt_block_indexes=(2,)
)
# Qwen2-VL: LayerNorm + quick_gelu MLP, full attention everywhere; head_dim 16 and 32
Q2 = dataclasses.replace(QWEN2_VL_2B, **HD16, depth=4, intermediate_size=256)
Q2_HD32 = dataclasses.replace(Q2, width=128, intermediate_size=512, out_dim=64)
# Qwen3-VL: a 6 x 6 position table, deepstack taps on inner blocks (1 and 2 of 4)
Q3 = dataclasses.replace(
    QWEN3_VL_8B, **HD16, depth=4, intermediate_size=96, num_position_embeddings=36, deepstack_layers=(1, 2)
)
# Qwen3.5: head_dim 24 (not a power of two, like the real 72), an 8 x 8 table
Q35 = dataclasses.replace(
    Q3, variant=QWEN3_5, depth=3, width=48, num_heads=2, intermediate_size=80, out_dim=32, num_position_embeddings=64,
    deepstack_layers=(),
)  # fmt: skip
# Qwen3.5 as the Qwen3-VL one, no taps (head_dim 16, the 6 x 6 table)
Q35_HD16 = dataclasses.replace(Q3, variant=QWEN3_5, depth=3, deepstack_layers=())
SIDE6 = dict(HD16, depth=3, num_position_embeddings=36)  # a 6 x 6 table (image_size 84 / patch 14)
# GLM-4.1V: block MLP = out 48, merger SwiGLU 80
GLM_TINY = dataclasses.replace(PRESETS["glm-4.1v-9b"], **SIDE6, intermediate_size=48, merger_intermediate_size=80)
PADDLE_TINY = dataclasses.replace(PRESETS["paddleocr-vl"], **SIDE6, intermediate_size=96)  # PaddleOCR-VL

# ---- small towers without an HF twin (behaviour, compiles: random parameters) ----------------------
SMALL = dict(depth=2, width=32, num_heads=2)
SMALL_Q25 = dataclasses.replace(QWEN2_5_VL_3B, **SMALL, intermediate_size=48, out_dim=24, fullatt_block_indexes=(1,))
SMALL_Q2 = dataclasses.replace(QWEN2_VL_2B, **SMALL, intermediate_size=64, out_dim=24)
SMALL_Q3 = dataclasses.replace(QWEN3_VL_8B, **SMALL, intermediate_size=64, out_dim=24, deepstack_layers=(0,))
# deviceless compiles (test_aot.py): one of each variant, head_dim 32
AOT = dict(depth=2, width=64, num_heads=2, intermediate_size=128, out_dim=32)
AOT_TOWERS = {
    "qwen2-vl": dataclasses.replace(QWEN2_VL_2B, **AOT),
    "qwen2.5-vl": dataclasses.replace(QWEN2_5_VL_3B, **AOT, fullatt_block_indexes=(1,)),
    "qwen3-vl": dataclasses.replace(QWEN3_VL_8B, **AOT, deepstack_layers=(0,)),
    "qwen3.5": dataclasses.replace(QWEN3_5_27B, **AOT),
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """How a registry tower is made: its config, the HF model's seed, the preprocessor_config.json
    written beside HF's checkpoint (and so carried into the converted folder), and HF's shard size."""

    cfg: VisionConfig
    seed: int
    preprocessor: dict | None = None
    max_shard_size: str = "10GB"


# The hub's Qwen3-VL preprocessor_config.json (patch 16, mean / std 0.5, the budget as `size`).
HUB_PREPROCESSOR_QWEN3_VL = dict(HUB_PREPROCESSOR_QWEN3, processor_class="Qwen3VLProcessor")
# The rest of the family (tests/test_family.py): the towers under other HF model families.
FAMILY = {
    "qwen3_vl_moe": dataclasses.replace(Q3, family="qwen3_vl_moe"),
    "qwen3_5_moe": dataclasses.replace(Q35_HD16, family="qwen3_5_moe"),
    "qwen4_exp": dataclasses.replace(Q35_HD16, family="qwen4_exp"),
    "qwen3_omni_moe": dataclasses.replace(Q3, family="qwen3_omni_moe"),
    "qwen2_5_omni": dataclasses.replace(Q25, family="qwen2_5_omni"),
}


def hub_preprocessor(cfg: VisionConfig) -> dict:
    """The hub's preprocessor_config.json of `cfg`'s family (Qwen3 towers: patch 16, mean / std 0.5)."""
    if cfg.variant == PADDLEOCR_VL:
        return HUB_PREPROCESSOR_PADDLEOCR
    if cfg.variant == GLM4V:
        return HUB_PREPROCESSOR_GLM4V
    return HUB_PREPROCESSOR_QWEN3 if cfg.patch_size == 16 else HUB_PREPROCESSOR


SPECS = {
    "q25": Spec(Q25, seed=8),
    "q25-hd32": Spec(Q25_HD32, seed=8, max_shard_size="200KB"),  # sharded: the index path
    "q2": Spec(Q2, seed=7),
    "q2-hd32": Spec(Q2_HD32, seed=7),
    "q3": Spec(Q3, seed=21, preprocessor=HUB_PREPROCESSOR_QWEN3_VL),
    "q35": Spec(Q35, seed=21, preprocessor=HUB_PREPROCESSOR_QWEN3_VL),
    "glm4v": Spec(GLM_TINY, seed=13, preprocessor=HUB_PREPROCESSOR_GLM4V),
    "glm4v_moe": Spec(dataclasses.replace(GLM_TINY, family="glm4v_moe", qkv_bias=True), 13, HUB_PREPROCESSOR_GLM4V),
    "paddleocr_vl": Spec(PADDLE_TINY, seed=11, preprocessor=HUB_PREPROCESSOR_PADDLEOCR),
    **{name: Spec(cfg, seed=len(name), preprocessor=hub_preprocessor(cfg)) for name, cfg in FAMILY.items()},
}


class Tower:
    """One registry tower; each part is made on first use and kept for the session."""

    def __init__(self, name: str, spec: Spec, root: pathlib.Path):
        self.name, self.spec, self.cfg, self.root = name, spec, spec.cfg, root
        self._hf = self._hf_dir = self._ours = None
        self._encoders: dict[str, object] = {}

    @property
    def hf(self):
        """HF's full model (float32, eval, vision tower re-initialised). Shared: never change it."""
        if self._hf is None:
            from qwen_vit_jax.tools.hf_reference import build_hf_model

            self._hf = build_hf_model(self.cfg, seed=self.spec.seed)
        return self._hf

    @property
    def hf_dir(self) -> pathlib.Path:
        """The checkpoint HF's save_pretrained wrote (with the spec's preprocessor_config.json)."""
        if self._hf_dir is None:
            path = self.root / "hf"
            self.hf.save_pretrained(path, max_shard_size=self.spec.max_shard_size)
            if self.spec.preprocessor is not None:
                (path / "preprocessor_config.json").write_text(json.dumps(self.spec.preprocessor))
            assert VisionConfig.from_hf(path) == self.cfg
            self._hf_dir = path
        return self._hf_dir

    @property
    def ours(self) -> pathlib.Path:
        """hf_dir converted by our converter."""
        if self._ours is None:
            from qwen_vit_jax.weights.convert import convert_checkpoint

            self._ours = convert_checkpoint(self.hf_dir, self.root / "ours")
        return self._ours

    def encoder(self, dtype: str = "float32"):
        """The session's VisionEncoder of `ours` in `dtype` (default settings). Tests that count its
        compiles count differences; one that warms up or declares sizes builds its own."""
        if dtype not in self._encoders:
            from qwen_vit_jax.runtime.encoder import VisionEncoder

            self._encoders[dtype] = VisionEncoder.from_pretrained(self.ours, dtype=dtype)
        return self._encoders[dtype]


class Towers:
    """The session's towers by name (SPECS), each built at most once."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self._built: dict[str, Tower] = {}

    def __getitem__(self, name: str) -> Tower:
        if name not in self._built:
            (self.root / name).mkdir(parents=True)
            self._built[name] = Tower(name, SPECS[name], self.root / name)
        return self._built[name]


def case_fixture(names):
    """A module-scoped fixture over the registry's towers `names`, one tower at a time:
    (name, cfg, HF model, root with hf/ and ours/)."""
    import pytest

    @pytest.fixture(scope="module", params=list(names))
    def case(request, towers):
        tower = towers[request.param]
        return request.param, tower.cfg, tower.hf, tower.ours.parent

    return case


def assert_compiled_dots_are_ideal(encoder) -> None:
    """256 patches of one frame fill their bucket and its attention tiles exactly: the compiled
    program's dots are the ideal ones (cost.ideal_flops)."""
    report = encoder.cost_report([[1, 16, 16]])
    assert report["padded_patches"] == 256
    assert abs(report["flops_ratio"] - 1.0) <= 1e-12, report["flops_ratio"]


# ---- real size --------------------------------------------------------------------------------------
def check_real_size(cfg: VisionConfig, name: str, tmp_path: pathlib.Path, grid, reference, deepstack=False) -> None:
    """A released tower at its real size on one request: HF's model with random weights (seed 7; its
    text part left uninitialised: only the vision weights are read) saved to tmp_path / "hf",
    `reference(hf, px, grid)` computed once (the tokens, or with `deepstack` (tokens, [features])),
    the checkpoint converted once (HF's folder then removed: disk), float32 and bfloat16 loaded from
    the converted folder, each at its bar."""
    from hf_utils import assert_bf16_close, assert_fp32_close, random_pixels
    from transformers.initialization import no_init_weights

    import qwen_vit_jax as qvj
    from qwen_vit_jax.tools.hf_reference import build_hf_model

    t0 = time.perf_counter()
    grid = np.asarray(grid)
    with no_init_weights():  # HF's own init would be thrown away: build_hf_model re-initialises every vision weight
        hf = build_hf_model(cfg, seed=7)
    hf.save_pretrained(tmp_path / "hf")
    px = random_pixels(cfg, grid, seed=8)
    ref, ref_feats = reference(hf, px, grid) if deepstack else (reference(hf, px, grid), [])
    del hf
    gc.collect()
    ours = qvj.convert_checkpoint(tmp_path / "hf", tmp_path / "ours")
    assert qvj.VisionConfig.from_hf(tmp_path / "hf") == cfg
    shutil.rmtree(tmp_path / "hf")
    for dtype, bar in (("float32", assert_fp32_close), ("bfloat16", assert_bf16_close)):
        enc = qvj.VisionEncoder.from_pretrained(ours, dtype=dtype)
        tokens, feats = enc.encode(px, grid, return_deepstack=True) if deepstack else (enc.encode(px, grid), [])
        del enc
        measures = [bar(tokens, ref)] + [bar(f, r) for f, r in zip(feats, ref_feats, strict=True)]
        what = "rel, max abs / max|ref|" if dtype == "float32" else "min token cos, rel"
        print(f"\n{name} real size {dtype} ({what}): " + "; ".join(f"{a:.5g}, {b:.3g}" for a, b in measures))
    print(f"{name} real-size test: {time.perf_counter() - t0:.1f} s")
