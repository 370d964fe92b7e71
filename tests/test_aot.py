"""Ahead-of-time compiles for accelerators this machine does not have (qwen_vit_jax.aot).

For the tiny tower of every variant, in both dtypes, on one device and on a 4-device mesh, for an
H100 and a TPU v5e: the program compiles, holds no host callback or transfer, and its temp memory
grows linearly with the bucket's rows. Needs the accel extra (libtpu and the CUDA plugin); without
it these tests skip, unless QVJ_REQUIRE_ACCEL=1 (CI) makes that a failure.
"""

from __future__ import annotations

import importlib.util
import os

import jax
import numpy as np
import pytest
from towers import AOT_TOWERS

import qwen_vit_jax as qvj
from qwen_vit_jax.tools import aot

TOWERS = AOT_TOWERS  # tests/towers.py: one of each variant
TARGETS = ("h100", "tpu-v5e")
pytestmark = pytest.mark.accel


def _have(target: str) -> bool:
    module = "libtpu" if target.startswith("tpu") else "jax_plugins.xla_cuda13"
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _need(target: str) -> None:
    if _have(target):
        return
    if os.environ.get("QVJ_REQUIRE_ACCEL") == "1":
        pytest.fail(f"QVJ_REQUIRE_ACCEL=1 but the {target} compiler is not installed (pip install -e '.[accel]')")
    pytest.skip(f"the {target} compiler is not installed (pip install -e '.[accel]')")


@pytest.fixture(scope="module", autouse=True)
def no_compilation_cache():
    """A deviceless program cannot be loaded back from JAX's persistent cache (no client): keep these
    compiles out of the session's cache (conftest.py), which would only warn on every lookup."""
    saved = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", saved)


@pytest.fixture(scope="module")
def devices():
    """target -> {count: devices}, each topology made once."""
    cache = {}

    def get(target: str, count: int):
        _need(target)
        if (target, count) not in cache:
            cache[target, count] = aot.target_named(target).devices(count)
        return cache[target, count]

    return get


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", TOWERS)
def test_a_users_jit_compiles_for_the_target(variant, dtype, target, devices):
    """What a user writes: jax.jit over qvj.abstract_model and qvj.make_plans, lowered with
    shape-only arguments on the target's (absent) device; a mixed request (an image and a
    two-frame video) so that tiles straddle frames."""
    cfg = TOWERS[variant]
    grid = np.array([[1, 8, 12], [2, 8, 8]])
    model = qvj.abstract_model(cfg, dtype=dtype, platform=aot.target_named(target).platform)
    (plan,) = qvj.make_plans(grid, cfg)
    device = devices(target, 1)[0]
    where = jax.sharding.SingleDeviceSharding(device)

    def on_target(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)

    graphdef, state = _split(model, on_target)
    pixels = on_target(jax.ShapeDtypeStruct((plan.bucket.patches, cfg.patch_dim), np.dtype(dtype)))
    plan_specs = jax.tree.map(on_target, qvj.Plan.abstract(plan.bucket))

    @jax.jit
    def embed(state, pixels, plan):
        from flax import nnx

        return nnx.merge(graphdef, state)(pixels, plan)

    compiled = embed.lower(state, pixels, plan_specs).compile()
    assert aot.host_ops(compiled.as_text()) == ()
    assert compiled.memory_analysis().temp_size_in_bytes > 0


def _split(model, on_target):
    from flax import nnx

    graphdef, state = nnx.split(model)
    return graphdef, jax.tree.map(on_target, state)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", TOWERS)
def test_the_mesh_program_compiles_for_four_devices(variant, dtype, target, devices):
    """The encoder's multi-device program (one shard_map over frames) for a 4-device topology."""
    devices(target, 4)
    cfg = TOWERS[variant]
    ((bucket, rows),) = aot.buckets_for(cfg, [np.array([[3, 8, 8], [1, 8, 12]])], devices=4)
    _, report = aot.compile_bucket(aot.target_named(target), cfg, bucket, dtype, devices=4, patches=rows)
    assert report.host_ops == ()
    assert report.fits() and report.flops > 0 and report.bytes_moved > 0


@pytest.mark.parametrize("target", TARGETS)
def test_temp_memory_is_linear_in_rows(target, devices):
    """4x the rows (frames of a video; and one frame 4x the size) needs at most ~4x the temp
    memory: nothing [N, N] is ever built. Allowance 1.3 for fixed costs and layout rounding."""
    devices(target, 1)
    cfg = TOWERS["qwen2.5-vl"]
    t = aot.target_named(target)
    for small, large in [([4, 16, 16], [16, 16, 16]), ([1, 32, 32], [1, 64, 64])]:
        temps = []
        for g in (small, large):
            ((bucket, rows),) = aot.buckets_for(cfg, [np.array([g])])
            _, report = aot.compile_bucket(t, cfg, bucket, "bfloat16", patches=rows)
            temps.append((report.temp_bytes, bucket.patches))
        (t0, n0), (t1, n1) = temps
        assert t1 / n1 <= 1.3 * t0 / n0, f"{target}: temp {t0} B at {n0} rows -> {t1} B at {n1} rows"


def test_aot_command_on_a_checkpoint(tiny_dirs, capsys, devices):
    """`qwen-vit-jax aot CKPT --target h100`: the table, one row per bucket, no host ops."""
    devices("h100", 1)
    rc = qvj_cli(["aot", str(tiny_dirs[1]), "--target", "h100", "--sizes", "8x8", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    header, row = [line for line in out.splitlines() if line.strip().startswith(("rows", "64"))]
    assert header.split()[:3] == ["rows", "real", "compile"] and row.split()[:2] == ["64", "64"]


def qvj_cli(argv):
    from qwen_vit_jax.tools.cli import main

    return main(argv)


def test_host_ops_finds_a_callback():
    """The detector itself: a program with a host callback is caught (compiled for this CPU)."""

    def f(x):
        jax.debug.callback(lambda v: None, x)
        return x * 2

    text = jax.jit(f).lower(np.zeros(4, np.float32)).compile().as_text()
    assert aot.host_ops(text), text[:2000]
    assert aot.host_ops(jax.jit(lambda x: x * 2).lower(np.zeros(4, np.float32)).compile().as_text()) == ()


def test_abstract_model_has_the_loaded_dtypes():
    """abstract_model's parameters are what load_model would hold: matrices in the compute
    dtype, norms and biases float32; no memory is spent."""
    from flax import nnx

    model = qvj.abstract_model(TOWERS["qwen2.5-vl"], dtype="bfloat16", platform="tpu")
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    assert all(isinstance(v.get_value(), jax.ShapeDtypeStruct) for v in flat.values())
    dtypes = {".".join(map(str, k)): v.get_value().dtype for k, v in flat.items()}
    assert dtypes["blocks.attn.qkv.kernel"] == np.dtype("bfloat16") and dtypes["blocks.attn.qkv.bias"] == np.float32
    with pytest.raises(ValueError, match="platform"):
        qvj.abstract_model(TOWERS["qwen2.5-vl"], platform="npu")


@pytest.mark.parametrize("devices_count", [1, 4])
@pytest.mark.parametrize("target", TARGETS)
def test_the_kernel_paths_compile_for_the_target(target, devices_count, devices):
    """attention="kernel" (Triton on the H100, splash on the v5e) lowers and compiles deviceless,
    on one device and in the mesh program; a video bucket so that tiles straddle frames."""
    devices(target, devices_count)
    cfg = TOWERS["qwen2.5-vl"]
    grid = np.array([[4, 8, 12]]) if devices_count == 4 else np.array([[2, 8, 12], [1, 8, 8]])
    ((bucket, rows),) = aot.buckets_for(cfg, [grid], devices=devices_count)
    compiled, report = aot.compile_bucket(
        aot.target_named(target), cfg, bucket, "bfloat16", devices_count, attention="kernel", patches=rows
    )
    kernel_call = "__gpu$xla.gpu.triton" if target == "h100" else "tpu_custom_call"
    assert kernel_call in compiled.as_text() and report.host_ops == ()
