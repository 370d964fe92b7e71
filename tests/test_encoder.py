"""VisionEncoder behaviour that needs no HF reference: validation, buckets, transfers, costs."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from towers import SMALL_Q2, SMALL_Q3, SMALL_Q25

import qwen_vit_jax as qvj
from qwen_vit_jax.families import QWEN2_5_VL
from qwen_vit_jax.model.vit import abstract_model
from qwen_vit_jax.presets import QWEN2_5_VL_3B, QWEN2_VL_2B

TINY25, TINY2, TINY3 = SMALL_Q25, SMALL_Q2, SMALL_Q3  # tests/towers.py: depth 2, width 32


def random_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    flat = nnx.to_flat_state(nnx.state(abstract_model(cfg)))
    return {".".join(map(str, p)): rng.standard_normal(v.shape).astype(np.float32) * 0.1 for p, v in flat}


@pytest.fixture(scope="module", params=[TINY25, TINY2], ids=["qwen2.5", "qwen2"])
def enc(request):
    return qvj.VisionEncoder(request.param, random_params(request.param))


def pixels(cfg, grid, seed=0):
    n = int(np.prod(np.asarray(grid), axis=1).sum())
    return np.random.default_rng(seed).standard_normal((n, cfg.patch_dim)).astype(np.float32)


def test_encode_shape_and_dtype(enc):
    grid = [[1, 4, 6], [2, 2, 2]]
    out = enc.encode(pixels(enc.cfg, grid), grid)
    assert out.shape == ((24 + 8) // 4, enc.cfg.out_dim) and out.dtype == np.float32
    assert np.isfinite(out).all()


@pytest.mark.parametrize(
    "px_shape, grid, match",
    [
        ((16, 1176), [[1, 3, 4]], "multiples of spatial_merge_size"),
        ((16, 1176), [[0, 4, 4]], "row 0"),
        ((16, 1176), [[1, -4, 4]], "row 0"),
        ((16, 1176), [1, 4, 4], "grid_thw"),
        ((16, 1176), [[1, 4, 4, 1]], "grid_thw"),
        ((20, 1176), [[1, 4, 4]], "sum\\(t\\*h\\*w\\) = 16"),
        ((16, 1000), [[1, 4, 4]], "expected 1176"),
        ((16,), [[1, 4, 4]], "2-D"),
    ],
)
def test_bad_input_is_a_clear_value_error(enc, px_shape, grid, match):
    with pytest.raises(ValueError, match=match):
        enc.encode(np.zeros(px_shape, np.float32), grid)


def test_same_bucket_compiles_once(enc):
    a, b, c = [[1, 8, 10]], [[1, 10, 8]], [[1, 4, 20]]
    enc.encode(pixels(enc.cfg, a), a)
    count = enc.compile_count
    enc.encode(pixels(enc.cfg, b), b)  # same bucket
    enc.encode(pixels(enc.cfg, c, seed=1), c)
    assert enc.compile_count == count
    assert enc.warmup([a])[0] in enc.compile_seconds


def test_no_implicit_transfers(enc):
    """Pixels and plan go to the device by one explicit device_put; nothing implicit inside."""
    grid = [[1, 6, 6], [3, 4, 4]]
    px = pixels(enc.cfg, grid)
    enc.encode(px, grid)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        out = enc.encode(px, grid)
    assert out.shape[0] == (36 + 48) // 4


def test_unknown_dtype_rejected():
    with pytest.raises(ValueError, match="dtype"):
        qvj.VisionEncoder(TINY2, random_params(TINY2), dtype="float16")


def test_params_must_match_model():
    params = random_params(TINY2)
    params.pop("merger.fc2.bias")
    with pytest.raises(ValueError, match="merger.fc2.bias"):
        qvj.VisionEncoder(TINY2, params)
    params = random_params(TINY2)
    params["blocks.attn.qkv.kernel"] = params["blocks.attn.qkv.kernel"][:, :, :10]
    with pytest.raises(ValueError, match="blocks.attn.qkv.kernel"):
        qvj.VisionEncoder(TINY2, params)


def test_cost_report(enc):
    exact = enc.cost_report([[1, 16, 16]])  # 256 patches: a rung, nothing padded
    assert exact["buckets"][0]["patches"] == 256 and exact["padded_patches"] == 256
    assert 1.0 <= exact["flops_ratio"] < 1.5
    padded = enc.cost_report([[1, 16, 18]])  # 288 patches -> the 384 rung
    assert padded["padded_patches"] == 384
    assert padded["flops_ratio"] > exact["flops_ratio"]
    assert padded["ideal_flops"] > exact["ideal_flops"]


def test_temp_memory_grows_linearly(enc):
    """No [N, N] buffer: 4x the patches must cost about 4x the temp memory, not 16x."""
    temps = [enc.cost_report(g)["temp_bytes"] for g in ([[1, 32, 32]], [[1, 32, 64]], [[1, 64, 64]])]
    assert temps[1] < 2.5 * temps[0] and temps[2] < 2.5 * temps[1], temps


@pytest.mark.parametrize(
    "layers, runs, groups",
    [
        (QWEN2_5_VL_3B.full_attention_layers, [(False, 7), (True, 1)], 4),
        (QWEN2_VL_2B.full_attention_layers, [(True, 32)], 1),
        ((False, True, False, False, True), [(False, 1), (True, 1), (False, 2), (True, 1)], 1),
        ((True, False) * 3, [(True, 1), (False, 1)], 3),
    ],
)
def test_layer_schedule(layers, runs, groups):
    from qwen_vit_jax.model.vit import layer_schedule

    assert layer_schedule(layers) == (runs, groups)
    assert tuple(f for f, n in runs for _ in range(n)) * groups == layers


def test_forward_has_no_conditionals(enc):
    """The layer kinds are fixed at trace time: no conditional (on GPU a conditional reads its
    predicate back to the host) and no host callback in the compiled program."""
    bucket = enc.warmup([[[2, 8, 8], [1, 4, 6]]])[0]
    hlo = enc.programs.get(bucket).as_text()
    assert " conditional(" not in hlo and "callback" not in hlo.lower()


def test_persistent_compilation_cache(tmp_path, restore_compilation_cache):
    """An encoder with compilation_cache_dir stores its programs there; another encoder (here:
    the same process, as a restarted one would) loads them instead of compiling."""
    events = []

    def listen(name, **_):
        events.append(name)

    jax.monitoring.register_event_listener(listen)
    try:
        check_cache_roundtrip(tmp_path, events)
    finally:
        jax.monitoring.unregister_event_listener(listen)


def check_cache_roundtrip(tmp_path, events):
    cfg, grid = TINY2, [[1, 6, 10]]
    px = pixels(cfg, grid)
    cache = tmp_path / "xla"
    first = qvj.VisionEncoder(cfg, random_params(cfg), compilation_cache_dir=cache)
    out = first.encode(px, grid)
    assert first.compile_count == 1 and any(cache.iterdir())
    hits = events.count("/jax/compilation_cache/cache_hits")
    second = qvj.VisionEncoder(cfg, random_params(cfg), compilation_cache_dir=cache)
    np.testing.assert_array_equal(second.encode(px, grid), out)
    assert events.count("/jax/compilation_cache/cache_hits") == hits + 1
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        qvj.enable_compilation_cache(tmp_path / "file")


@pytest.mark.parametrize("tile_loops", [True, False])
@pytest.mark.parametrize("cfg", [TINY25, TINY2], ids=["qwen2.5", "qwen2"])
def test_compiled_flops_count_the_program_that_runs(cfg, tile_loops):
    """cost.dot_flops on the scanned forward (layer scans, tile loops: bodies times trip counts)
    equals the matmul FLOPs of the padded shapes written out by hand."""
    from qwen_vit_jax.model.numerics import Numerics
    from qwen_vit_jax.model.vit import VisionTransformer
    from qwen_vit_jax.plan import make_plans
    from qwen_vit_jax.runtime import cost
    from qwen_vit_jax.runtime.program import input_specs

    model = VisionTransformer(cfg, Numerics(tile_loops=tile_loops), rngs=nnx.Rngs(0))
    for grid in ([[1, 16, 16]], [[3, 8, 12], [1, 10, 14]]):
        (plan,) = make_plans(grid, cfg)
        b = plan.bucket
        traced = jax.jit(lambda px, p: model(px, p)).trace(*input_specs(cfg, b, "float32"))
        d, n = cfg.width, b.patches
        mlp = (3 if cfg.variant == QWEN2_5_VL else 2) * 2 * d * cfg.intermediate_size
        per_row = 2 * cfg.patch_dim * d + cfg.depth * (2 * d * 3 * d + 2 * d * d + mlp)
        merged = max(n // cfg.merge_unit, 64)  # the merger pads to 64 rows
        merger = merged * (2 * (cfg.merge_unit * d) ** 2 + 2 * cfg.merge_unit * d * cfg.out_dim)
        full = sum(cfg.full_attention_layers)
        attention = (
            full * 4 * d * b.tiles * b.block * b.key_rows + (cfg.depth - full) * 4 * d * b.windows * b.window_rows**2
        )
        assert cost.dot_flops(traced.jaxpr) == n * per_row + merger + attention


def test_dot_flops_refuses_loops_without_a_trip_count():
    from qwen_vit_jax.runtime import cost

    jaxpr = jax.make_jaxpr(lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ c[1]), (0, x)))(
        np.eye(4, dtype=np.float32)
    )
    with pytest.raises(ValueError, match="while"):
        cost.dot_flops(jaxpr)


def test_every_call_of_a_request_gives_the_same_bits(enc):
    """The default (tight_after=None): a grid encoded again runs the very same program, however
    often and after whatever else; cost_report agrees with what runs."""
    cfg = enc.cfg
    grid = [[1, 36, 30]]  # 1080 patches: the ladder's 1280 rung
    px = pixels(cfg, grid)
    first = enc.encode(px, grid)
    enc.encode(pixels(cfg, [[1, 8, 8]]), [[1, 8, 8]])  # something else in between
    count = enc.compile_count
    for _ in range(3):
        np.testing.assert_array_equal(enc.encode(px, grid), first)
        assert enc.cost_report(grid)["padded_patches"] == 1280
    assert enc.compile_count == count  # no tight program appeared
    assert 1080 not in {b.patches for b in enc.compile_seconds}


BATCH = [[1, 8, 8], [1, 12, 16], [1, 20, 14], [1, 16, 24], [1, 6, 10], [1, 16, 16]]


@pytest.mark.parametrize("cfg", [TINY25, TINY2, TINY3], ids=["qwen2.5", "qwen2", "qwen3"])
def test_batched_prepare_runs_a_batch_plan(cfg):
    """prepare(batched=True): the grid's rows as one batch in a batch plan (one tile per block,
    rows on batch_rows' ladder), each item's tokens (and deepstack features) within padding invariance of
    its own encode; an item alone is planned as encode plans it."""
    enc = qvj.VisionEncoder(cfg, random_params(cfg))
    pxs = [pixels(cfg, [g], seed=i) for i, g in enumerate(BATCH)]
    prepared = enc.prepare(np.concatenate(pxs), BATCH, batched=True)
    (bucket,) = prepared.buckets
    assert bucket.patches == 1536 and bucket.tiles == bucket.patches // bucket.block  # 1236 rows
    tokens, features = enc.run(prepared, return_deepstack=True)
    cuts = np.cumsum([h * w // cfg.merge_unit for _, h, w in BATCH])[:-1]
    for i, (px, g) in enumerate(zip(pxs, BATCH)):
        want, want_f = enc.encode(px, [g], return_deepstack=True)
        got = np.split(tokens, cuts)[i]
        assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want), i
        for f, w in zip(features, want_f):
            assert np.linalg.norm(np.split(f, cuts)[i] - w) <= 1e-6 * np.linalg.norm(w), i
    assert len(features) == len(cfg.deepstack_layers)
    assert enc.prepare(pxs[3], [BATCH[3]], batched=True).buckets == enc.prepare(pxs[3], [BATCH[3]]).buckets


def test_declared_grid_gets_a_tight_bucket_from_its_first_call():
    """warmup(grids, tight=True) declares sizes that recur: rows rounded to the grid's blocks, not the
    ladder's next rung, compiled by the warmup; every encode of the grid then runs that program (the
    same bits every call), within padding invariance of the ladder's result."""
    cfg = TINY25
    grid = [[1, 36, 30]]  # ladder 1280, tight 1080 = 3 blocks of 360
    px = pixels(cfg, grid)
    ladder = qvj.VisionEncoder(cfg, random_params(cfg))
    ref = ladder.encode(px, grid)
    enc = qvj.VisionEncoder(cfg, random_params(cfg))
    (bucket,) = enc.warmup([grid], tight=True)
    assert (bucket.patches, bucket.tiles) == (1080, 3) and enc.compile_count == 1
    first = enc.encode(px, grid)
    for _ in range(3):
        np.testing.assert_array_equal(enc.encode(px, grid), first)
    assert enc.compile_count == 1 and enc.cost_report(grid)["padded_patches"] == 1080
    assert np.linalg.norm(first - ref) <= 1e-6 * np.linalg.norm(ref)
    other = [[1, 30, 36]]  # not declared: the ladder
    assert enc.cost_report(other)["padded_patches"] == 1280
    with pytest.raises(ValueError, match="row 0"):
        enc.warmup([[[1, 3, 3]]], tight=True)


def test_tight_after_opts_out_of_the_guarantee():
    """tight_after=n: a grid encoded n times switches to its tight bucket by itself (one more
    program); its later calls differ from the first only within padding invariance; at most
    max_tight_buckets such buckets."""
    cfg = TINY25
    grid = [[1, 36, 30]]
    px = pixels(cfg, grid)
    enc = qvj.VisionEncoder(cfg, random_params(cfg), tight_after=2)
    assert enc.cost_report(grid)["padded_patches"] == 1280
    first = enc.encode(px, grid)
    assert enc.cost_report(grid)["buckets"][0]["patches"] == 1080
    outs = [enc.encode(px, grid) for _ in range(3)]
    assert enc.compile_count == 2
    for out in outs:
        np.testing.assert_array_equal(out, outs[0])
        assert np.linalg.norm(out - first) <= 1e-6 * np.linalg.norm(first)
    capped = qvj.VisionEncoder(cfg, random_params(cfg), tight_after=1, max_tight_buckets=0)
    assert capped.cost_report(grid)["padded_patches"] == 1280


def test_chunks_that_recur_within_a_request_get_tight_buckets(enc):
    """A long video cut into equal chunks: those chunks run in a tight bucket from the first encode
    (one program for all of them), the odd chunk on the ladder; the same embeddings as the ladder,
    and the same bits on every call (the request alone decides)."""
    cfg = enc.cfg
    policy = qvj.BucketPolicy(max_patches=256)
    grid = [[10, 6, 10]]  # frames of 60 rows: chunks of 4 (240 rows; ladder 256) x 2 + 2 frames
    px = pixels(cfg, grid, seed=3)
    fresh = qvj.VisionEncoder(cfg, random_params(cfg), policy=policy)
    assert [p.bucket.patches for p in qvj.make_plans(grid, cfg, policy)] == [256, 256, 128]  # the ladder's
    assert [b["patches"] for b in fresh.cost_report(grid)["buckets"]] == [240, 240, 128]
    out = fresh.encode(px, grid)
    ref = qvj.VisionEncoder(cfg, random_params(cfg)).encode(px, grid)  # one 768-row ladder chunk
    assert np.linalg.norm(out - ref) <= 1e-6 * np.linalg.norm(ref)
    assert fresh.compile_count == 2  # the tight chunks' program and the last chunk's rung
    np.testing.assert_array_equal(fresh.encode(px, grid), out)
    assert fresh.compile_count == 2


def test_tight_rows():
    tight = qvj.BucketPolicy(tight=True)
    assert [tight.padded_rows(n) for n in (1296, 1080, 12960, 64, 60, 65)] == [1320, 1080, 13056, 64, 64, 68]
    assert qvj.BucketPolicy().padded_rows(1296) == 1536
    assert [tight.padded_rows(n, one_frame=True) for n in (1296, 1080, 1300, 64)] == [1296, 1080, 1300, 64]
    for n in range(65, 5000, 7):
        rows = tight.padded_rows(n)
        assert rows >= n and rows % tight.block_size(rows) == 0 and tight.block_size(rows) % 4 == 0
        assert -(-rows // tight.block) == -(-n // tight.block)  # as many blocks as n needs
        rows = tight.padded_rows(n, one_frame=True)
        assert n <= rows < n + 4 * -(-n // tight.frame_block) * 2 and rows % tight.block_size(rows, True) == 0
    with pytest.raises(ValueError, match="tight"):
        qvj.BucketPolicy(tight=1)


def test_bf16_weight_stacks_held_as_bits_are_exact():
    """The encoder holds bf16 block stacks as uint16 bits (model.as_bits): the forward reads them
    back exactly, so its tokens equal the plain bf16 model's."""
    from qwen_vit_jax.model.vit import from_bits

    cfg = TINY25
    enc = qvj.VisionEncoder(cfg, random_params(cfg), dtype="bfloat16", tight_after=None)
    flat = dict(nnx.to_flat_state(enc.programs.state))
    assert flat[("blocks", "mlp", "up", "kernel")].dtype == np.uint16
    assert flat[("patch_embed", "kernel")].dtype == jax.numpy.bfloat16  # not stacked: as it is
    plain = jax.tree.map(from_bits, enc.programs.state)
    grid = [[1, 8, 12], [2, 4, 4]]
    px = pixels(cfg, grid)
    (plan,) = qvj.make_plans(grid, cfg)
    tokens, _ = jax.jit(enc.programs.forward)(plain, plan.take(px, jax.numpy.bfloat16), plan)  # (tokens, deepstack)
    ref = plan.unpad(np.asarray(tokens))
    np.testing.assert_array_equal(enc.encode(px, grid), ref)
