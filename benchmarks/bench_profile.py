"""Where a forward's time goes on the CPU: per-op-kind timings of the tower's own modules, and
experiments that do not change the package (dot shapes and modes, a zero-padded SwiGLU, XLA
flags, attention-core formulations).

Every piece is a jitted function of (weights, inputs) built from qwen_vit_jax.model /
attention with random weights (matrices stored in the operand dtype, as the encoder stores
them) on the bucket of one [[1, s, s]] image (default s = 36: 1296 patches in the 1536-row
bucket of the Qwen2.5-VL-3B tower). Times are medians of --repeats calls. GFLOP/s count the
bucket's rows (what the kernels compute), and "% peak" is against the same process's XLA dot
peak of the mode (float32 dots for float32 and for bf16 without native bf16 dots, bf16
operands with float32 accumulation otherwise) on [1536, 1280] x [1280, 5120]. The bf16 pieces
run what the encoder runs on this CPU: native bf16 dots only with avx512_bf16 / AMX.

Parts (--parts, comma-separated):
  pieces   one layer's pieces (norm, qkv, rotary, window / segment attention core, proj, the
           MLP's dots (SwiGLU: gate / up / down; Qwen2-VL / Qwen3-VL: fc1 / fc2) and its
           elementwise work, whole blocks), the real forward
           (VisionEncoder on the bench_forward checkpoint, if built) and the sum of pieces
  dots     XLA dot GFLOP/s on the tower's shapes, modes float32 / bf16 in f32 acc / bf16 -> bf16
  mlp_pad  the SwiGLU with its intermediate size zero-padded (3420 -> 3456 / 3584 / 4096):
           time and the difference from the unpadded output
  attn     window and segment attention cores: operand dtypes, batched vs per-head loops,
           windows grouped into larger slots; for a bucket whose tiles cover it whole (one image),
           the one-frame schedules side by side: tile loops, dense per head, dense batched
  flags    dots, the SwiGLU and a window block under XLA_FLAGS variants (one process each,
           alternating rounds; outputs compared with the default flags')
  gap      the real forward against its 32 layers run as standalone jitted blocks, alternately
  stack    stacked bf16 weights indexed in a loop: does XLA convert the whole stacks to float32
           first, and does storing them bit-cast to uint16 avoid it
  u16      the same on the real bf16 forward: the encoder's program (uint16 block stacks,
           model.as_bits) vs its forward with bf16 block stacks (bench_forward's checkpoint),
           bitwise compared

Each part runs in its own JAX process (XLA_FLAGS apply per process).

    python benchmarks/bench_profile.py [--parts pieces,dots,mlp_pad,attn,flags]
        [--dtypes float32,bfloat16] [--side 36] [--variant qwen2.5-vl-3b] [--tight] [--repeats 5]
        [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics

import common
import numpy as np

VARIANT = "qwen2.5-vl-3b"
PEAK_SHAPE = (1536, 1280, 5120)
FLAG_SETS = {  # name -> XLA_FLAGS added to the environment's
    "default": "",
    "ynn off (Eigen dots)": "--xla_cpu_experimental_ynn_fusion_type=",
    "ynn dot+eltwise fusions": "--xla_cpu_experimental_ynn_fusion_type=individual_dot,dot,eltwise",
    "onednn on": "--xla_cpu_use_onednn=true",
    "onednn dot fusion": "--xla_cpu_experimental_onednn_fusion_type=dot",
    "xnn dot fusion": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "vector width 512": "--xla_cpu_prefer_vector_width=512",
}


# ---- helpers that run inside a JAX worker ---------------------------------------------------
def _setup(p: dict):
    """(cfg, the image's Plan on the device, Numerics) for the worker's payload."""
    import jax

    from qwen_vit_jax import plan as planlib
    from qwen_vit_jax.model.numerics import Numerics, has_native_bf16
    from qwen_vit_jax.presets import PRESETS

    cfg = PRESETS[p.get("variant", VARIANT)]
    policy = planlib.BucketPolicy(tight=p.get("tight", False))  # tight: a declared size's bucket
    plan = jax.device_put(planlib.make_plans([[1, p["side"], p["side"]]], cfg, policy)[0])
    native = p.get("native_bf16", has_native_bf16(jax.devices()[0]))  # default: what the encoder runs here
    num = Numerics(p["dtype"], native_bf16=native, tile_loops=p.get("tile_loops", True))
    return cfg, plan, num


def _timed(fn, args, repeats: int) -> float:
    """Median seconds of fn(*args) (compiled and run once before)."""
    import jax

    jax.block_until_ready(fn(*args))
    return statistics.median(common.time_calls(lambda: jax.block_until_ready(fn(*args)), repeats))


def _peak_fn(mode: str):
    """(jitted dot, its args, FLOPs) of PEAK_SHAPE in one mode (float32 / bf16_f32acc / bf16_bf16)."""
    import jax
    import jax.numpy as jnp

    m, k, n = PEAK_SHAPE
    dtype, result, prec = {
        "float32": (jnp.float32, jnp.float32, jax.lax.Precision.HIGHEST),
        "bf16_f32acc": (jnp.bfloat16, jnp.float32, None),
        "bf16_bf16": (jnp.bfloat16, jnp.bfloat16, None),
    }[mode]
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
    return jax.jit(lambda x, y: jnp.dot(x, y, precision=prec, preferred_element_type=result)), (a, b), 2 * m * k * n


def _timed_vs_peak(fn, args, peak, repeats: int) -> tuple[float, float]:
    """(median seconds of fn(*args), median GFLOP/s of the peak dot), the two timed alternately
    call by call: on a shared machine whose speed drifts, their ratio is what holds."""
    import jax

    pf, pargs, pflops = peak
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(pf(*pargs))
    ts, tp = [], []
    for _ in range(repeats):
        tp += common.time_calls(lambda: jax.block_until_ready(pf(*pargs)), 1)
        ts += common.time_calls(lambda: jax.block_until_ready(fn(*args)), 1)
    return statistics.median(ts), pflops / statistics.median(tp) / 1e9


def _operand_state(module, num):
    """(graphdef, state) of an nnx module with every matrix ("kernel") in the operand dtype."""
    from flax import nnx

    graphdef, state = nnx.split(module)
    flat = [
        (path, var.replace(var[...].astype(num.operand_dtype) if path[-1] == "kernel" else var[...]))
        for path, var in nnx.to_flat_state(state)
    ]
    return graphdef, nnx.from_flat_state(flat)


def _dot_gflops(m: int, k: int, n: int, mode: str, repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    dtype, result, prec = {
        "float32": (jnp.float32, jnp.float32, jax.lax.Precision.HIGHEST),
        "bf16_f32acc": (jnp.bfloat16, jnp.float32, None),
        "bf16_bf16": (jnp.bfloat16, jnp.bfloat16, None),
    }[mode]
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, precision=prec, preferred_element_type=result))
    return 2 * m * k * n / _timed(f, (a, b), repeats) / 1e9


def _own_mode(num) -> str:
    return "bf16_f32acc" if num.dtype == "bfloat16" and num.native_bf16 else "float32"


def _mlp_pieces(blk, state, x, hid, n: int, d: int, i: int, depth: int, swiglu: bool) -> dict:
    """pieces_worker's MLP rows: its dots (SwiGLU, Qwen2.5-VL: gate, up, down; plain MLP, Qwen2-VL /
    Qwen3-VL: fc1, fc2), its elementwise work and the whole MLP."""
    import jax

    def dot(name: str, arg, din: int, dout: int):  # one [N, din] x [din, dout] matrix of the MLP
        fn = jax.jit(lambda st, a: getattr(blk(st).mlp, name)(a))
        return f"MLP {name} dot [N,{din}]x[{din},{dout}]", (fn, (state, arg), 2 * n * d * i, depth)

    ins, out = (("gate", "up"), "down") if swiglu else (("fc1",), "fc2")
    pieces = dict([*(dot(name, x, d, i) for name in ins), dot(out, hid, i, d)])
    if swiglu:
        act = (jax.jit(lambda st, a, b: blk(st).mlp.act(a) * b), (state, hid, hid), 0, depth)
        pieces["MLP act * up (elementwise)"] = act
    else:
        pieces["MLP act (elementwise)"] = (jax.jit(lambda st, a: blk(st).mlp.act(a)), (state, hid), 0, depth)
    whole = (jax.jit(lambda st, x: blk(st).mlp(x)), (state, x), (len(ins) + 1) * 2 * n * d * i, 0)
    pieces["SwiGLU whole" if swiglu else "MLP whole"] = whole
    return pieces


# ---- workers ---------------------------------------------------------------------------------
def pieces_worker(p: dict) -> dict:
    """One layer's pieces, whole blocks, and the real forward, for one Numerics."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qwen_vit_jax.model.attention import apply_rotary, segment_attention, window_attention
    from qwen_vit_jax.model.vit import Block, rotary_cos_sin

    cfg, plan, num = _setup(p)
    bucket, reps = plan.bucket, p["repeats"]
    n, d, i, h = bucket.patches, cfg.width, cfg.intermediate_size, cfg.num_heads
    graphdef, state = _operand_state(Block(cfg, num, rngs=nnx.Rngs(0)), num)
    x = jax.random.normal(jax.random.key(2), (n, d), jnp.float32)
    cos, sin = rotary_cos_sin(plan.pos_ids, cfg.head_dim, cfg.rope_theta)
    qkv = jax.random.normal(jax.random.key(3), (n, 3, h, d // h), jnp.float32)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    hid = jax.random.normal(jax.random.key(4), (n, i), jnp.float32)

    def blk(st):
        return nnx.merge(graphdef, st)

    win_slots, s = plan.window_tokens.shape
    seg_flops = 4 * d * bucket.tiles * bucket.block * bucket.key_rows  # every tile: [B, Dh] x [Dh, K] x 2 per head
    full = sum(cfg.full_attention_layers)  # blocks with full (per-frame) attention; the rest: windows
    windowed = {  # towers with window attention only (Qwen2.5-VL)
        "window attention core": (
            jax.jit(lambda q, k, v: window_attention(q, k, v, plan, num)),
            (q, k, v),
            4 * win_slots * s * s * d,
            cfg.depth - full,
        ),
        "block, window attention": (
            jax.jit(lambda st, x: blk(st)(x, cos, sin, plan, full=False)),
            (state, x),
            0,
            0,
        ),
    }
    pieces = {  # name -> (fn, args, FLOPs computed on the bucket, count per forward)
        f"norm ({'RMSNorm' if cfg.norm == 'rmsnorm' else 'LayerNorm'})": (
            jax.jit(lambda st, x: blk(st).norm1(x)),
            (state, x),
            0,
            2 * cfg.depth,
        ),
        f"qkv dot [N,{d}]x[{d},{3 * d}]": (
            jax.jit(lambda st, x: blk(st).attn.qkv(x)),
            (state, x),
            2 * n * d * 3 * d,
            cfg.depth,
        ),
        "rotary (q and k)": (
            jax.jit(
                lambda q, k: (apply_rotary(q, cos[:, None], sin[:, None]), apply_rotary(k, cos[:, None], sin[:, None]))
            ),
            (q, k),
            0,
            cfg.depth,
        ),
        "segment attention core": (
            jax.jit(lambda q, k, v: segment_attention(q, k, v, plan, num)),
            (q, k, v),
            seg_flops,
            full,
        ),
        f"proj dot [N,{d}]x[{d},{d}]": (
            jax.jit(lambda st, x: blk(st).attn.proj(x)),
            (state, x),
            2 * n * d * d,
            cfg.depth,
        ),
        **_mlp_pieces(blk, state, x, hid, n, d, i, cfg.depth, swiglu=cfg.mlp == "swiglu"),
        **(windowed if full < cfg.depth else {}),
        "block, full attention": (
            jax.jit(lambda st, x: blk(st)(x, cos, sin, plan, full=True)),
            (state, x),
            0,
            0,
        ),
    }
    mode = _own_mode(num)
    out = {"numerics": str(num), "bucket": str(bucket), "peak_mode": mode, "pieces": {}}
    peak = _peak_fn(mode)
    for name, (fn, args, flops, count) in pieces.items():
        sec, pk = _timed_vs_peak(fn, args, peak, reps)
        out["pieces"][name] = {
            "ms": 1e3 * sec,
            "gflops": flops / sec / 1e9 if flops else None,
            "count": count,
            "peak": pk,
        }
        common.log(f"{num.dtype} {name}: {1e3 * sec:.2f} ms (peak {pk:.0f})")
    out["peak"] = statistics.median(x["peak"] for x in out["pieces"].values())
    if p.get("ours"):
        import qwen_vit_jax as qvj

        enc = qvj.VisionEncoder.from_pretrained(p["ours"], dtype=p["dtype"])
        g = np.array([[1, p["side"], p["side"]]])
        px = common.random_pixels(g, cfg.patch_dim)
        enc.encode(px, g)
        sec, pk = _timed_vs_peak(enc.encode, (px, g), peak, reps)
        out["forward_ms"], out["forward_peak"] = 1e3 * sec, pk
        out["forward_gflops"] = common.forward_flops(cfg, g.tolist()) / sec / 1e9
        out["encoder_numerics"] = str(enc.num)
    return out


def gap_worker(p: dict) -> dict:
    """The real forward (encode) against its layers run as standalone jitted blocks (random
    weights, same shapes: 28 window + 4 full blocks per call), timed call by call alternately:
    what the scanned program loses or gains against its layers."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import qwen_vit_jax as qvj
    from qwen_vit_jax.model.vit import Block, rotary_cos_sin

    cfg, plan, num = _setup(p)
    graphdef, state = _operand_state(Block(cfg, num, rngs=nnx.Rngs(0)), num)
    x = jax.random.normal(jax.random.key(2), (plan.bucket.patches, cfg.width), jnp.float32)
    cos, sin = rotary_cos_sin(plan.pos_ids, cfg.head_dim, cfg.rope_theta)
    blocks = {
        full: jax.jit(lambda st, x, full=full: nnx.merge(graphdef, st)(x, cos, sin, plan, full=full))
        for full in (False, True)
    }
    kinds = cfg.full_attention_layers

    def layers():
        y = x
        for full in kinds:
            y = blocks[full](state, y)
        return jax.block_until_ready(y)

    enc = qvj.VisionEncoder.from_pretrained(p["ours"], dtype=p["dtype"])
    g = np.array([[1, p["side"], p["side"]]])
    px = common.random_pixels(g, cfg.patch_dim)
    enc.encode(px, g)
    layers()
    tf, tl = [], []
    for _ in range(p["repeats"]):
        tf += common.time_calls(enc.encode, 1, px, g)
        tl += common.time_calls(layers, 1)
    return {
        "numerics": str(enc.num),
        "forward_s": tf,
        "layers_s": tl,
        "ratio": statistics.median(f / l for f, l in zip(tf, tl)),
    }


def stack_worker(p: dict) -> dict:
    """A loop over `layers` SwiGLUs whose bf16 weights are stacked [L, ...] and indexed in place
    (lax.dynamic_index_in_dim, as model.VisionTransformer does), against the same loop over the
    same weights stored bit-cast to uint16 and bit-cast back to bf16 after the index (the same
    bits: exact). Reports whether XLA converts the whole bf16 stacks to float32 ahead of the loop
    (a `f32[L, ...] convert` in the compiled program) and the times, call by call alternately."""
    import jax
    import jax.numpy as jnp

    from qwen_vit_jax.model.numerics import Numerics

    cfg, plan, _ = _setup({**p, "dtype": "bfloat16"})
    num = Numerics("bfloat16")
    n, d, i, layers = plan.bucket.patches, cfg.width, cfg.intermediate_size, p["layers"]
    keys = jax.random.split(jax.random.key(0), 3)
    w = [
        (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
        for k, shape in zip(keys, [(layers, d, i), (layers, d, i), (layers, i, d)])
    ]
    x = jax.random.normal(jax.random.key(2), (n, d), jnp.float32)

    def run(ws, x, unpack):
        def body(j, x):
            g, u, dn = (unpack(jax.lax.dynamic_index_in_dim(a, j, keepdims=False)) for a in ws)
            h = jax.nn.silu(num.einsum("nd,di->ni", x, g)) * num.einsum("nd,di->ni", x, u)
            return x + num.einsum("ni,id->nd", h, dn)

        return jax.lax.fori_loop(0, layers, body, x)

    variants = {
        "bf16 stack": (jax.jit(lambda ws, x: run(ws, x, lambda a: a)), w),
        "uint16 bit-cast stack": (
            jax.jit(lambda ws, x: run(ws, x, lambda a: jax.lax.bitcast_convert_type(a, jnp.bfloat16))),
            [jax.lax.bitcast_convert_type(a, jnp.uint16) for a in w],
        ),
    }
    out, ys, times = {}, {}, {k: [] for k in variants}
    for name, (fn, ws) in variants.items():
        text = fn.lower(ws, x).compile().as_text()
        out[name] = {
            "f32_stack_converts": text.count(f"f32[{layers},{d},{i}]{{2,1,0}} convert(")
            + text.count(f"f32[{layers},{i},{d}]{{2,1,0}} convert(")
        }
        ys[name] = np.asarray(fn(ws, x))
    for _ in range(p["repeats"]):
        for name, (fn, ws) in variants.items():
            times[name] += common.time_calls(lambda fn=fn, ws=ws: jax.block_until_ready(fn(ws, x)), 1)
    for name in variants:
        out[name]["ms"] = 1e3 * statistics.median(times[name])
        out[name]["bitwise_equal_to_bf16_stack"] = bool(np.array_equal(ys[name], ys["bf16 stack"]))
    return {"layers": layers, "variants": out}


def u16_forward_worker(p: dict) -> dict:
    """The encoder's bf16 program (its block stacks held as uint16 bits, model.as_bits, each layer's
    slice bit-cast back to bf16 after the index) against the same forward (VisionTransformer.__call__'s
    layer schedule, the model's own modules and weights) with the block stacks as bf16 arrays:
    outputs compared bitwise, alternating calls."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import qwen_vit_jax as qvj
    from qwen_vit_jax.model.vit import from_bits, layer_schedule, rotary_cos_sin

    enc = qvj.VisionEncoder.from_pretrained(p["ours"], dtype="bfloat16")
    g = np.array([[1, p["side"], p["side"]]])
    prepared = enc.prepare(common.random_pixels(g, enc.cfg.patch_dim), g)
    stacked = jax.device_put(prepared.calls[0], enc.programs.inputs)  # [1, ...]: one device is a mesh of one
    px, plan = jax.tree.map(lambda a: a[0], stacked)  # that device's own inputs, for the plain jit below
    blocks_gd, bits = nnx.split(nnx.merge(enc.programs.graphdef, enc.programs.state).blocks)
    stacks = jax.tree.map(from_bits, bits)  # the whole bf16 stacks, as the encoder held them before as_bits

    def fwd(state, stacks, pixels, plan):
        model = nnx.merge(enc.programs.graphdef, state)
        cfg = model.cfg
        x = model.patch_embed(pixels)
        cos, sin = rotary_cos_sin(plan.pos_ids, cfg.head_dim, cfg.rope_theta)

        def layer_at(x, i, full):
            st = jax.tree.map(lambda a: from_bits(jax.lax.dynamic_index_in_dim(a, i, keepdims=False)), stacks)
            return nnx.merge(blocks_gd, st)(x, cos, sin, plan, full=full)

        runs, groups = layer_schedule(cfg.full_attention_layers)
        period = len(cfg.full_attention_layers) // groups

        def group(x, gi):
            start = gi * period
            for full, length in runs:
                if length == 1:
                    x = layer_at(x, start, full)
                else:
                    x = jax.lax.scan(
                        lambda x, i, full=full: (layer_at(x, i, full), None), x, start + jnp.arange(length)
                    )[0]
                start = start + length
            return x, None

        x, _ = jax.lax.scan(group, x, jnp.arange(groups))
        return model.merger(x)

    base = enc.programs.get(plan.bucket)
    new = jax.jit(fwd).lower(enc.programs.state, stacks, px, plan).compile()
    text = new.as_text()
    calls = {
        "encoder program": lambda: jax.block_until_ready(
            base(enc.programs.state, *stacked)[0][0]
        ),  # (tokens, deepstack)
        "bf16 stacks": lambda: jax.block_until_ready(new(enc.programs.state, stacks, px, plan)),
    }
    ys = {k: np.asarray(f()) for k, f in calls.items()}
    times = {k: [] for k in calls}
    for _ in range(p["repeats"]):
        for k, f in calls.items():
            times[k] += common.time_calls(f, 1)
    return {
        "ms": {k: 1e3 * statistics.median(t) for k, t in times.items()},
        "times": times,
        "bitwise_equal": bool(np.array_equal(ys["encoder program"], ys["bf16 stacks"])),
        "f32_stack_converts": {
            "encoder program": base.as_text().count("f32[32,"),
            "bf16 stacks": text.count("f32[32,"),
        },
    }


def dots_worker(p: dict) -> dict:
    """XLA GFLOP/s of [M, K] x [K, N] dots in three modes, and how far the two bf16 modes' results
    are from the float32 dot of the same bf16 operands (exact products; an error near bf16's
    2^-9 means the result or the accumulation was rounded to bf16)."""
    import jax
    import jax.numpy as jnp

    out = {}
    for m, k, n in p["shapes"]:
        r = out[f"{m}x{k}x{n}"] = {mode: _dot_gflops(m, k, n, mode, p["repeats"]) for mode in common.PEAK_MODES}
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
        b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(jnp.bfloat16)
        ref = np.asarray(jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest"))
        for mode, res in (("bf16_f32acc", jnp.float32), ("bf16_bf16", jnp.bfloat16)):
            y = np.asarray(jax.jit(lambda x, w, r=res: jnp.dot(x, w, preferred_element_type=r))(a, b), np.float32)
            r[f"{mode}_rel_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    return out


def mlp_pad_worker(p: dict) -> dict:
    """The SwiGLU with intermediate size I zero-padded to each of p["sizes"]: exact in exact
    arithmetic (padded gate / up columns give act(0) * 0 = 0, padded down rows multiply zeros)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qwen_vit_jax.model.vit import SwiGLU

    cfg, plan, num = _setup(p)
    n = plan.bucket.patches
    x = jax.random.normal(jax.random.key(2), (n, cfg.width), jnp.float32)
    base = SwiGLU(cfg, num, rngs=nnx.Rngs(0))
    ref_fn, out = None, {"numerics": str(num), "sizes": {}}
    peak = _peak_fn(_own_mode(num))
    for size in [cfg.intermediate_size, *p["sizes"]]:
        mlp = SwiGLU(dataclasses.replace(cfg, intermediate_size=size), num, rngs=nnx.Rngs(0))
        extra = size - cfg.intermediate_size
        for name in ("gate", "up"):  # [D, I] -> [D, I_pad], zero columns; bias zero-padded
            src = getattr(base, name)
            getattr(mlp, name).kernel.value = jnp.pad(src.kernel[...], ((0, 0), (0, extra)))
            getattr(mlp, name).bias.value = jnp.pad(src.bias[...], (0, extra))
        mlp.down.kernel.value = jnp.pad(base.down.kernel[...], ((0, extra), (0, 0)))  # [I_pad, D], zero rows
        mlp.down.bias.value = base.down.bias[...]
        graphdef, state = _operand_state(mlp, num)
        fn = jax.jit(lambda st, x, g=graphdef: nnx.merge(g, st)(x))
        y = np.asarray(fn(state, x))
        if ref_fn is None:
            ref_fn = y
        sec, pk = _timed_vs_peak(fn, (state, x), peak, p["repeats"])
        out["sizes"][size] = {
            "ms": 1e3 * sec,
            "peak": pk,
            "gflops_real": 3 * 2 * n * cfg.width * cfg.intermediate_size / sec / 1e9,
            "max_abs_diff": float(np.abs(y - ref_fn).max()),
            "bitwise_equal": bool(np.array_equal(y, ref_fn)),
            "rel_diff": float(np.linalg.norm(y - ref_fn) / np.linalg.norm(ref_fn)),
        }
        common.log(f"mlp I={size}: {out['sizes'][size]}")
    out["peak"] = statistics.median(x["peak"] for x in out["sizes"].values())
    return out


def _window_grouped(q, k, v, plan, num, group: int):
    """window_attention with `group` consecutive slots merged into one slot of group * S rows
    (the same-window mask keeps the result; more masked scores, larger dots)."""
    import dataclasses

    from qwen_vit_jax.model.attention import window_attention

    w, s = plan.window_tokens.shape
    pad = -w % group
    tokens = np.pad(np.asarray(plan.window_tokens), ((0, pad), (0, 0)), constant_values=-1).reshape(-1, group * s)
    ids = np.pad(np.asarray(plan.window_ids), ((0, pad), (0, 0)), constant_values=-1).reshape(-1, group * s)
    grouped = dataclasses.replace(plan, window_tokens=tokens, window_ids=ids)  # window_slot: w*S+j is unchanged
    return window_attention(q, k, v, grouped, num)


def _window_heads_loop(q, k, v, plan, num):
    """window_attention as a lax.map over head-major copies of q, k, v ([H, N, Dh]: the package's
    CPU schedule before 2026-12-01, which gathers each head's rows from [N, H, Dh] instead), each a
    batched-over-windows dot [W, S, Dh]."""
    import jax
    import jax.numpy as jnp

    from qwen_vit_jax.model.attention import NEG_INF

    tokens, ids, slot = plan.window_tokens, plan.window_ids, plan.window_slot
    w, s = tokens.shape
    rows = jnp.maximum(tokens, 0)
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] >= 0)  # [W, S, S]
    scale = q.shape[-1] ** -0.5

    def head(a):
        qh, kh, vh = a  # [N, Dh]
        sc = num.einsum("wqd,wkd->wqk", qh[rows] * scale, kh[rows])  # [W, S, S]
        pr = jax.nn.softmax(jnp.where(same, sc, NEG_INF), axis=-1)
        return num.einsum("wqk,wkd->wqd", pr, vh[rows]).reshape(w * s, -1)[slot]  # [N, Dh]

    out = jax.lax.map(head, (q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)))  # [H, N, Dh]
    return out.transpose(1, 0, 2)


def _one_frame_dense(q, k, v, plan, num, rotary, batched: bool):
    """Full attention of a bucket whose tiles cover it whole (one image: K = N, one tile per block)
    as one dense attention: per head an [N, Dh] x [Dh, N] dot, a softmax over same-frame keys and
    an [N, N] x [N, Dh] dot (lax.map over heads), or all heads in one batched dot ([H, N, N]
    scores). The package's CPU schedule instead runs NB tiles of [B, Dh] x [Dh, N] per head; the
    same arithmetic. q / k / v: [N, H, Dh] -> [N, H, Dh]."""
    import jax
    import jax.numpy as jnp

    from qwen_vit_jax.model.attention import NEG_INF, apply_rotary

    seg = plan.segment_ids  # [N], -1 on padding rows
    mask = (seg[:, None] == seg[None, :]) & (seg >= 0)[:, None]  # [N, N]
    scale = q.shape[-1] ** -0.5

    def softmax_v(s, vx):  # s [..., N, N] scores, vx [..., N, Dh]
        s = jnp.where(mask, s, NEG_INF)
        pr = jnp.where(mask, jnp.exp(s - s.max(axis=-1, keepdims=True)), 0.0)
        o = num.einsum("...qk,...kd->...qd", pr, vx)
        return o / jnp.maximum(pr.sum(axis=-1, keepdims=True), 1e-30)

    if batched:
        q, k = (apply_rotary(x, rotary[0][:, None], rotary[1][:, None]) for x in (q, k))
        s = num.einsum("qhd,khd->hqk", q * scale, k)  # [H, N, N]
        return softmax_v(s, v.transpose(1, 0, 2)).transpose(1, 0, 2)  # [H, N, Dh] -> [N, H, Dh]

    def head(i):  # [N, Dh]
        qx, kx = (apply_rotary(x[:, i], *rotary) for x in (q, k))
        return softmax_v(num.einsum("qd,kd->qk", qx * scale, kx), v[:, i])  # [N, N] scores

    return jax.lax.map(head, jnp.arange(q.shape[1])).transpose(1, 0, 2)  # [H, N, Dh] -> [N, H, Dh]


def attn_worker(p: dict) -> dict:
    """Window and segment attention cores, several formulations, against the current one."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from qwen_vit_jax import plan as planlib
    from qwen_vit_jax.model.attention import segment_attention, window_attention
    from qwen_vit_jax.model.vit import rotary_cos_sin

    cfg, plan, num = _setup(p)
    n, d, h, reps = plan.bucket.patches, cfg.width, cfg.num_heads, p["repeats"]
    q, k, v = (jax.random.normal(jax.random.key(j), (n, h, d // h), jnp.float32) for j in range(3))
    f32 = dataclasses.replace(num, native_bf16=False)
    w, s = plan.window_tokens.shape
    real = plan.n_patches
    variants = (
        {}
        if not cfg.windowed
        else {
            "window: current": (lambda q, k, v: window_attention(q, k, v, plan, num), 4 * w * s * s * d),
            "window: f32 operands": (lambda q, k, v: window_attention(q, k, v, plan, f32), 4 * w * s * s * d),
            "window: heads loop over [H, N, Dh] copies": (
                lambda q, k, v: _window_heads_loop(q, k, v, plan, num),
                4 * w * s * s * d,
            ),
            "window: all heads batched": (
                lambda q, k, v: window_attention(q, k, v, plan, dataclasses.replace(num, tile_loops=False)),
                4 * w * s * s * d,
            ),
        }
    )
    for g in (2, 4) if cfg.windowed else ():
        wg = -(-w // g)
        variants[f"window: {g} slots grouped"] = (
            lambda q, k, v, g=g: _window_grouped(q, k, v, plan, num, g),
            4 * wg * (g * s) ** 2 * d,
        )
    seg = 4 * d * plan.bucket.tiles * plan.bucket.block * plan.bucket.key_rows
    for name, nm in (
        ("current (tile loops)", num),
        ("batched", dataclasses.replace(num, tile_loops=False)),
        ("tile loops, f32 operands", dataclasses.replace(f32, tile_loops=True)),
    ):
        variants[f"segment: {name}"] = (
            lambda q, k, v, nm=nm: segment_attention(q, k, v, plan, nm),
            seg,
        )
    b = plan.bucket
    if b.key_rows == b.patches and b.tiles == b.patches // b.block:  # tiles cover the bucket: one frame
        rot = rotary_cos_sin(plan.pos_ids, cfg.head_dim, cfg.rope_theta)  # rotary inside, as the model runs
        variants["segment: tile loops, rotary"] = (
            lambda q, k, v: segment_attention(q, k, v, plan, num, rot),
            seg,
        )
        for name, batched in (("dense per head", False), ("dense batched", True)):
            variants[f"segment: {name}, rotary"] = (
                lambda q, k, v, batched=batched: _one_frame_dense(q, k, v, plan, num, rot, batched),
                seg,
            )
    for rows in (128, 256):  # the image's bucket cut into smaller query blocks than frame_block's
        small = jax.device_put(
            planlib.make_plans(
                [[1, p["side"], p["side"]]], cfg, planlib.BucketPolicy(frame_block=rows, tight=p["tight"])
            )[0]
        )
        variants[f"segment: {small.bucket.block}-row blocks"] = (
            lambda q, k, v, small=small: segment_attention(q, k, v, small, num),
            4 * d * small.bucket.tiles * small.bucket.block * small.bucket.key_rows,
        )
    out = {
        "numerics": str(num),
        "bucket": str(plan.bucket),
        "window_slots": [w, s],
        "tiles": plan.bucket.tiles,
        "variants": {},
    }
    refs, peak = {}, _peak_fn(_own_mode(num))
    for name, (fn, flops) in variants.items():
        fn = jax.jit(fn)
        y = np.asarray(fn(q, k, v))[:real]
        kind = name.split(":")[0]
        refs.setdefault(kind + (", rotary" if "rotary" in name else ""), y)
        sec, pk = _timed_vs_peak(fn, (q, k, v), peak, reps)
        out["variants"][name] = {
            "ms": 1e3 * sec,
            "gflops": flops / sec / 1e9,
            "peak": pk,
            "max_abs_diff_vs_current": float(np.abs(y - refs[kind + (", rotary" if "rotary" in name else "")]).max()),
        }
        common.log(f"{num.dtype} {name}: {1e3 * sec:.2f} ms")
    out["peak"] = statistics.median(x["peak"] for x in out["variants"].values())
    return out


def flags_worker(p: dict) -> dict:
    """Under this process's XLA_FLAGS: the peak-shape dots, and per dtype the SwiGLU and a whole
    window-attention block (same seeds in every process: same weights and inputs), their
    outputs saved to p["save"]/NAME-DTYPE-{mlp,block}.npy for the parent to compare."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qwen_vit_jax.model.vit import Block, rotary_cos_sin

    res = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "dots": dots_worker({**p, "shapes": [PEAK_SHAPE]})}

    def one(dtype):
        cfg, plan, num = _setup({**p, "dtype": dtype})
        graphdef, state = _operand_state(Block(cfg, num, rngs=nnx.Rngs(0)), num)
        x = jax.random.normal(jax.random.key(2), (plan.bucket.patches, cfg.width), jnp.float32)
        cos, sin = rotary_cos_sin(plan.pos_ids, cfg.head_dim, cfg.rope_theta)
        fns = {
            "mlp": jax.jit(lambda st, x: nnx.merge(graphdef, st).mlp(x)),
            "block": jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, cos, sin, plan, full=False)),
        }
        for name, fn in fns.items():
            np.save(f"{p['save']}/{p['name']}-{dtype}-{name}.npy", np.asarray(fn(state, x)))
            res[f"{name}_{dtype}_ms"] = 1e3 * _timed(fn, (state, x), p["repeats"])

    for dtype in p["dtypes"]:
        one(dtype)
    return res


# ---- parent ----------------------------------------------------------------------------------
def flags_part(args, base: dict, dtypes: list[str]) -> dict:
    """Each flag set in its own process, --flag-rounds rounds in alternating order; medians over
    rounds; outputs compared with the "default" process's (same weights and inputs)."""
    import tempfile

    names = args.flag_sets.split(",")
    if "default" not in names:
        names.insert(0, "default")
    save = tempfile.mkdtemp(prefix="qvj-flags-")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rnd in range(args.flag_rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FLAG_SETS[name]}".strip())
            try:
                runs[name].append(
                    common.run_worker(
                        __file__,
                        "flags",
                        {**base, "dtypes": dtypes, "save": save, "name": f"{names.index(name)}-{rnd}"},
                        env=env,
                    )
                )
            except RuntimeError as e:
                runs[name].append({"error": str(e)})
    out, rows = {}, []
    keys = [f"{what}_{dt}_ms" for dt in dtypes for what in ("mlp", "block")]
    for name in names:
        ok = [r for r in runs[name] if "error" not in r]
        if not ok:
            out[name] = {"error": runs[name][0]["error"]}
            rows.append([name, f"`{FLAG_SETS[name]}`", "failed", *[""] * (2 + len(keys) + len(dtypes))])
            continue
        pk = {m: statistics.median(r["dots"]["x".join(map(str, PEAK_SHAPE))][m] for r in ok) for m in common.PEAK_MODES}
        ms = {k: statistics.median(r[k] for r in ok) for k in keys}
        diff = {}
        for dt in dtypes:  # largest relative difference from the default, over rounds and pieces
            ref = {w: np.load(f"{save}/0-0-{dt}-{w}.npy") for w in ("mlp", "block")}
            diff[dt] = max(
                float(
                    np.linalg.norm(np.load(f"{save}/{names.index(name)}-{rnd}-{dt}-{w}.npy") - ref[w])
                    / np.linalg.norm(ref[w])
                )
                for rnd, r in enumerate(runs[name])
                if "error" not in r
                for w in ("mlp", "block")
            )
        out[name] = {"peak": pk, "ms": ms, "rel_diff_vs_default": diff, "rounds": len(ok)}
        rows.append(
            [
                name,
                f"`{FLAG_SETS[name]}`" if FLAG_SETS[name] else "-",
                *(f"{pk[m]:.0f}" for m in common.PEAK_MODES),
                *(f"{ms[k]:.0f}" for k in keys),
                *(f"{diff[dt]:.1e}" for dt in dtypes),
            ]
        )
    print(
        f"### XLA flags ({args.flag_rounds} alternating rounds, medians): dot GFLOP/s on "
        f"[1536,1280]x[1280,5120]; SwiGLU and window-attention block ms (1536 rows); rel diff vs default\n"
    )
    print(
        common.markdown_table(
            ["flags", "XLA_FLAGS", *common.PEAK_MODES, *keys, *(f"rel diff {dt}" for dt in dtypes)], rows
        )
        + "\n"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="pieces,dots,mlp_pad,attn,flags")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--side", type=int, default=36)
    ap.add_argument("--variant", default=VARIANT, help="a preset name (qvj.PRESETS)")
    ap.add_argument("--tight", action="store_true", help="the image's tight bucket (a declared size), not its rung")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--flag-sets", default=",".join(FLAG_SETS), help="names from FLAG_SETS")
    ap.add_argument("--flag-rounds", type=int, default=2, help="alternating rounds of the flag-set processes")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/profile.json)")
    args = ap.parse_args()
    parts, dtypes = args.parts.split(","), args.dtypes.split(",")
    base = {"side": args.side, "repeats": args.repeats, "variant": args.variant, "tight": args.tight}
    ckpt = common.CACHE / f"{args.variant}-seed0" / "ours"
    res: dict = {}
    print(common.machine_line() + "\n")

    if "pieces" in parts:
        res["pieces"] = {}
        for dtype in dtypes:
            r = res["pieces"][dtype] = common.run_worker(
                __file__, "pieces", {**base, "dtype": dtype, "ours": str(ckpt) if ckpt.is_dir() else None}
            )
            rows, total = [], 0.0
            for name, x in r["pieces"].items():
                total += x["ms"] * x["count"]
                rows.append(
                    [
                        name,
                        f"{x['ms']:.2f}",
                        x["count"] or "-",
                        f"{x['ms'] * x['count']:.0f}" if x["count"] else "-",
                        f"{x['gflops']:.0f}" if x["gflops"] else "-",
                        f"{100 * x['gflops'] / x['peak']:.0f}%" if x["gflops"] else "-",
                        f"{x['peak']:.0f}",
                    ]
                )
            print(
                f"### pieces, {r['numerics']}, {r['bucket']}; peak mode {r['peak_mode']}, median "
                f"{r['peak']:.0f} GFLOP/s\n"
            )
            print(
                common.markdown_table(
                    ["piece", "ms", "per forward", "ms per forward", "GFLOP/s", "% peak", "peak (interleaved)"], rows
                )
            )
            fwd = (
                (
                    f"{r['forward_ms']:.0f} ms, {r['forward_gflops']:.0f} GFLOP/s real rows = "
                    f"{100 * r['forward_gflops'] / r['forward_peak']:.0f}% of the interleaved peak "
                    f"{r['forward_peak']:.0f}"
                )
                if r.get("forward_ms")
                else "-"
            )
            print(
                f"\nsum of pieces x count: {total:.0f} ms; real forward (encode): {fwd}; "
                f"uptime load {os.getloadavg()[0]:.2f}\n"
            )
    if "dots" in parts:
        n = 1536
        shapes = [[n, 1280, c] for c in (1280, 3840, 3420, 3456, 3584, 4096, 5120)]
        shapes += [[n, c, 1280] for c in (3420, 3456, 3584, 4096)] + [[n, 1176, 1280], [n // 4, 5120, 5120]]
        res["dots"] = common.run_worker(__file__, "dots", {**base, "shapes": shapes})
        print("### XLA dots, GFLOP/s\n")
        print(
            common.markdown_table(
                ["[M,K]x[K,N]", *common.PEAK_MODES, "bf16_f32acc rel err", "bf16_bf16 rel err"],
                [
                    [
                        s,
                        *(f"{v[m]:.0f}" for m in common.PEAK_MODES),
                        f"{v['bf16_f32acc_rel_err']:.1e}",
                        f"{v['bf16_bf16_rel_err']:.1e}",
                    ]
                    for s, v in res["dots"].items()
                ],
            )
            + "\n"
        )
    if "mlp_pad" in parts:
        res["mlp_pad"] = {}
        for dtype in dtypes:
            r = res["mlp_pad"][dtype] = common.run_worker(
                __file__, "mlp_pad", {**base, "dtype": dtype, "sizes": [3456, 3584, 4096]}
            )
            print(f"### SwiGLU zero-padded, {r['numerics']}; peak {r['peak']:.0f} GFLOP/s\n")
            headers = ["I", "ms", "real GFLOP/s", "% peak", "bitwise equal", "max abs diff", "rel diff"]
            print(
                common.markdown_table(
                    headers,
                    [
                        [
                            s,
                            f"{x['ms']:.2f}",
                            f"{x['gflops_real']:.0f}",
                            f"{100 * x['gflops_real'] / x['peak']:.0f}%",
                            x["bitwise_equal"],
                            f"{x['max_abs_diff']:.1e}",
                            f"{x['rel_diff']:.1e}",
                        ]
                        for s, x in r["sizes"].items()
                    ],
                )
                + "\n"
            )
    if "attn" in parts:
        res["attn"] = {}
        for dtype in dtypes:
            r = res["attn"][dtype] = common.run_worker(__file__, "attn", {**base, "dtype": dtype})
            print(
                f"### attention cores, {r['numerics']}, {r['bucket']}, window slots {r['window_slots']}, "
                f"{r['tiles']} tiles; peak {r['peak']:.0f} GFLOP/s\n"
            )
            print(
                common.markdown_table(
                    ["variant", "ms", "GFLOP/s (computed)", "% peak", "max abs diff vs current"],
                    [
                        [
                            name,
                            f"{x['ms']:.2f}",
                            f"{x['gflops']:.0f}",
                            f"{100 * x['gflops'] / x['peak']:.0f}%",
                            f"{x['max_abs_diff_vs_current']:.1e}",
                        ]
                        for name, x in r["variants"].items()
                    ],
                )
                + "\n"
            )
    if "flags" in parts:
        res["flags"] = flags_part(args, base, dtypes)
    if "stack" in parts:
        r = res["stack"] = common.run_worker(__file__, "stack", {**base, "layers": 8})
        print(f"### {r['layers']} stacked bf16 SwiGLUs in a fori_loop, weights indexed in place (alternating calls)\n")
        print(
            common.markdown_table(
                ["weights stored as", "f32 [L,...] stack converts", "ms", "bitwise equal"],
                [
                    [name, x["f32_stack_converts"], f"{x['ms']:.0f}", x["bitwise_equal_to_bf16_stack"]]
                    for name, x in r["variants"].items()
                ],
            )
            + "\n"
        )
    if "u16" in parts and ckpt.is_dir():
        r = res["u16"] = common.run_worker(__file__, "u16", {**base, "ours": str(ckpt)})
        print(
            f"### bf16 forward, encoder program (uint16 weight stacks) vs bf16 weight stacks (alternating "
            f"calls): {r['ms']['encoder program']:.0f} ms vs {r['ms']['bf16 stacks']:.0f} ms, bitwise equal "
            f"{r['bitwise_equal']}; 'f32[32,' in the compiled text: {r['f32_stack_converts']}; "
            f"load {os.getloadavg()[0]:.2f}\n"
        )
    if "gap" in parts and ckpt.is_dir():
        res["gap"] = {}
        for dtype in dtypes:
            r = res["gap"][dtype] = common.run_worker(__file__, "gap", {**base, "dtype": dtype, "ours": str(ckpt)})
            print(
                f"### forward vs its layers as standalone blocks, {r['numerics']} (alternating calls): "
                f"forward {statistics.median(r['forward_s']):.2f} s, 32 blocks "
                f"{statistics.median(r['layers_s']):.2f} s, forward / blocks per pair median {r['ratio']:.2f}; "
                f"load {os.getloadavg()[0]:.2f}\n"
            )
    common.write_json(args.out or common.default_out("profile", False), {"bench": "profile", **base, **res})


if __name__ == "__main__" and not common.worker_main(
    {
        "pieces": pieces_worker,
        "dots": dots_worker,
        "mlp_pad": mlp_pad_worker,
        "attn": attn_worker,
        "flags": flags_worker,
        "gap": gap_worker,
        "stack": stack_worker,
        "u16": u16_forward_worker,
    }
):
    main()
