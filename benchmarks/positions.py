"""The language model's host inputs: ours, `lm_inputs` (positions, deltas and the splice's host
indices from one numba call), vs HF 5.x's Qwen2.5-VL `model.model.get_rope_index` +
`get_placeholder_mask`, per request.

  ours   qwen_vit_jax.prompt: lm_inputs(ckpt, input_ids, image_grid_thw=, video_grid_thw=,
         attention_mask=, cached=) (token types computed from the ids inside). The checkpoint's
         PromptConfig is read once (as in a server). A revision without lm_inputs (--against an
         older one) runs its rope_index + plan_splice instead.
  HF     get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw,
         attention_mask=) (mm_token_type_ids given: the processor computed them) and
         get_placeholder_mask(input_ids, inputs_embeds, image_features, video_features) (its
         count checks included), torch tensors on the CPU, no grad.
Neither side's time includes the device's masked_scatter / gather, nor the embedding width (the
index work does not depend on it: D = 16 here).

Cases (Qwen2.5-VL token ids; each image / video run wrapped in <|vision_start|> .. <|vision_end|>):
  1 image      a 100-token prompt with one 36x36-patch image (324 tokens)
  1 video      a [10, 36, 36] video (3,240 tokens) in a 100-token prompt
  10 videos    ten such videos (32,400 tokens)
  20-turn chat 20 turns of 80 text tokens and one 32x40-patch image (320 tokens) each: 8,040 tokens
  batch 64     64 prompts of 40-200 text tokens and one image of 8..24 x 8..24 patches, left-padded
  prefix cache the 20-turn chat where only the last turn is new: positions are computed for the
               whole prompt (those of the new tokens depend on everything before; HF has no other
               way), the splice's indices / placeholder masks for the last turn only (ours:
               lm_inputs(..., cached=the columns before it)).

Each side runs in its own process; HF twice (torch's default threads and one thread, with
OMP_WAIT_POLICY=ACTIVE), ratios against the faster. Processes alternate for --rounds rounds; times
are medians of the per-call timings of all rounds, each case timed after --warmup seconds of
untimed calls on both sides (a server's steady state: the first hundreds of calls of a fresh
process run slower while the interpreter specialises and the caches fill; the very first call is
recorded apart, as "first"). Targets (the lm-rotary issue): every case at
least 50x HF, the one-image prompt at most 20 us.
"""

from __future__ import annotations

import numpy as np

from benchmarks import common

IMAGE, VIDEO, VS, VE = 151655, 151656, 151652, 151653
WIDTH = 16
DEFAULTS = {"repeats": (200, 8), "rounds": (2, 1)}
AGAINST = "also time ours at this revision in the same rounds (before lm_inputs: its rope_index + plan_splice)"
CASES = ("1 image", "1 video", "10 videos", "20-turn chat", "batch 64", "prefix cache")


def hf_config() -> dict:
    """A whole Qwen2.5-VL config whose get_rope_index reads the released token ids and rules."""
    return {
        "model_type": "qwen2_5_vl",
        "image_token_id": IMAGE,
        "video_token_id": VIDEO,
        "vision_start_token_id": VS,
        "vision_end_token_id": VE,
        "text_config": {
            "hidden_size": WIDTH,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 152064,
            "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0},
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "num_heads": 1,
            "out_hidden_size": WIDTH,
            "fullatt_block_indexes": [0],
            "tokens_per_second": 2,
        },
    }


def _run(kind: int, grid) -> list[int]:
    return [VS] + [kind] * (int(np.prod(grid)) // 4) + [VE]


def _text(rng, n: int) -> list[int]:
    return rng.integers(0, 150000, n).tolist()


def make_case(name: str, seed: int = 0) -> dict:
    """input_ids [B, L] int64, attention_mask, image / video grids (None when none), and `new`: the
    first column of the new tokens (0: the whole prompt is new)."""
    rng = np.random.default_rng(seed)
    images, videos, rows, new = [], [], [], 0
    if name == "1 image":
        images = [[1, 36, 36]]
        rows = [_text(rng, 50) + _run(IMAGE, images[0]) + _text(rng, 50)]
    elif name in ("1 video", "10 videos"):
        videos = [[10, 36, 36]] * (1 if name == "1 video" else 10)
        row = _text(rng, 50)
        for g in videos:
            row += _run(VIDEO, g) + _text(rng, 5)
        rows = [row + _text(rng, 50)]
    elif name in ("20-turn chat", "prefix cache"):
        row = []
        for _ in range(20):
            images.append([1, 32, 40])
            new = len(row)
            row += _text(rng, 40) + _run(IMAGE, images[-1]) + _text(rng, 40)
        rows = [row]
        new = new if name == "prefix cache" else 0
    elif name == "batch 64":
        for _ in range(64):
            images.append([1, int(rng.integers(4, 13)) * 2, int(rng.integers(4, 13)) * 2])
            n = int(rng.integers(40, 201))
            rows.append(_text(rng, n // 2) + _run(IMAGE, images[-1]) + _text(rng, n - n // 2))
    length = max(len(r) for r in rows)
    ids = np.zeros((len(rows), length), np.int64)
    mask = np.zeros((len(rows), length), np.int64)
    for b, r in enumerate(rows):
        ids[b, length - len(r) :], mask[b, length - len(r) :] = r, 1
    grid = lambda g: np.array(g, np.int64).reshape(-1, 3) if g else None  # noqa: E731
    return {"ids": ids, "mask": mask, "images": grid(images), "videos": grid(videos), "new": new}


def _rows(ids, grids) -> int | None:
    return None if grids is None else int((np.prod(grids, axis=1) // 4).sum())


def _ours(lm_inputs, cfg, ids, mask, images, videos, new):
    return lm_inputs(cfg, ids, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask, cached=new)


def _ours_before(fns, cfg, ids, mask, images, videos, tail, rows, new):
    """A revision before lm_inputs: its rope_index and plan_splice, two calls."""
    rope_index, plan_splice = fns
    pos, deltas = rope_index(cfg, ids, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
    return pos[:, :, new:], deltas, plan_splice(cfg, tail, *rows)


def _hf(model, ids, types, images, videos, mask, tail, embeds, feats, new):
    pos, deltas = model.get_rope_index(ids, types, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
    masks = model.get_placeholder_mask(tail, embeds, image_features=feats[0], video_features=feats[1])
    return pos[:, :, new:], deltas, masks


def _warm(fn, args, seconds: float) -> None:
    """Untimed calls of fn(*args) for `seconds` (at least 3)."""
    import time

    end, n = time.perf_counter() + seconds, 0
    while n < 3 or time.perf_counter() < end:
        fn(*args)
        n += 1


def ours_worker(p: dict) -> dict:
    import time

    t0 = time.perf_counter()
    import qwen_vit_jax
    from qwen_vit_jax.prompt.config import config_from_dict

    try:
        from qwen_vit_jax.prompt.inputs import lm_inputs
    except ImportError:  # an older revision (--against): its two calls
        from qwen_vit_jax.prompt.positions import rope_index
        from qwen_vit_jax.prompt.splice import plan_splice

        lm_inputs = None
    cfg = config_from_dict(hf_config())
    out = {"import_s": time.perf_counter() - t0, "package": qwen_vit_jax.__file__, "fused": lm_inputs is not None}
    for name in p["cases"]:
        c = make_case(name)
        new = c["new"]
        if lm_inputs is not None:
            fn, args = _ours, (lm_inputs, cfg, c["ids"], c["mask"], c["images"], c["videos"], new)
        else:
            tail = c["ids"][:, new:]  # the tokens whose embeddings are spliced
            tail_images = c["images"][-1:] if new else c["images"]  # prefix cache: the last turn's image
            rows = (_rows(tail, tail_images), _rows(tail, c["videos"]))
            fn = _ours_before
            args = ((rope_index, plan_splice), cfg, c["ids"], c["mask"], c["images"], c["videos"], tail, rows, new)
        first = common.time_calls(fn, 1, *args)[0]  # numba's cache loaded, pages touched
        _warm(fn, args, p["warmup"])
        out[name] = {"first": first, "times": common.summary(common.time_calls(fn, p["repeats"][name], *args))}
    return out


def hf_model():
    """HF's Qwen2_5_VLModel of hf_config(): its get_rope_index and get_placeholder_mask."""
    import torch
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    torch.manual_seed(0)
    d = hf_config()
    ids = {k: v for k, v in d.items() if k.endswith("_token_id")}
    return Qwen2_5_VLModel(
        Qwen2_5_VLConfig(text_config=d["text_config"], vision_config=d["vision_config"], **ids)
    ).eval()


def token_types(ids):
    """What HF's processor returns beside the ids: 1 at image tokens, 2 at video tokens."""
    import torch

    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == IMAGE], types[ids == VIDEO] = 1, 2
    return types


def hf_worker(p: dict) -> dict:
    import torch

    model = hf_model()
    out = {"torch_threads": torch.get_num_threads()}
    with torch.no_grad():
        for name in p["cases"]:
            c = make_case(name)
            new = c["new"]
            ids, mask = torch.from_numpy(c["ids"]), torch.from_numpy(c["mask"])
            types = token_types(ids)
            images = None if c["images"] is None else torch.from_numpy(c["images"])
            videos = None if c["videos"] is None else torch.from_numpy(c["videos"])
            tail = ids[:, new:]
            embeds = torch.zeros((*tail.shape, WIDTH))
            tail_images = c["images"][-1:] if new else c["images"]
            img_feats = None if images is None else torch.zeros((_rows(tail, tail_images), WIDTH))
            vid_feats = None if videos is None else torch.zeros((_rows(tail, c["videos"]), WIDTH))

            args = (model, ids, types, images, videos, mask, tail, embeds, (img_feats, vid_feats), new)
            first = common.time_calls(_hf, 1, *args)[0]
            _warm(_hf, args, p["warmup"])
            out[name] = {"first": first, "times": common.summary(common.time_calls(_hf, p["repeats"][name], *args))}
    return out


def check_equal() -> None:
    """Ours equals HF on every case (positions, deltas, the placeholder masks our splice rows
    imply), in one process (imports torch and jax: run by --check, not by the timed workers)."""
    import torch

    from qwen_vit_jax.prompt.config import config_from_dict
    from qwen_vit_jax.prompt.inputs import lm_inputs

    model, cfg = hf_model(), config_from_dict(hf_config())
    for name in CASES:
        c = make_case(name)
        new = c["new"]
        ids = torch.from_numpy(c["ids"])
        types = token_types(ids)
        g = [None if x is None else torch.from_numpy(x) for x in (c["images"], c["videos"])]
        want, want_d = model.get_rope_index(ids, types, *g, attention_mask=torch.from_numpy(c["mask"]))
        got = lm_inputs(
            cfg, c["ids"], image_grid_thw=c["images"], video_grid_thw=c["videos"], attention_mask=c["mask"], cached=new
        )
        assert np.array_equal(got.position_ids, want.numpy()[:, :, new:]), name
        assert np.array_equal(got.rope_deltas, want_d.numpy()), name
        # HF's placeholder masks: where the splice takes a feature row, not the token's own
        text_rows = got.splice.rows.size
        assert np.array_equal(got.splice.rows >= text_rows, (types > 0).numpy()[:, new:]), name
    common.log("ours == HF on every case")


def add_args(p) -> None:
    p.add_argument("--warmup", type=float, help="seconds of untimed calls per case before timing (default 0.3)")
    p.add_argument("--check", action="store_true", help="first check ours == HF on every case")


def run(args) -> dict:
    if args.check:
        common.run_worker(__name__, "check", {})
    warmup = args.warmup if args.warmup is not None else (0.01 if args.quick else 0.3)
    # the big cases take HF up to seconds per call
    n = args.repeats
    reps = {c: max(3, n // (20 if c in ("10 videos", "batch 64") else 4 if c != "1 image" else 1)) for c in CASES}
    payload = {"cases": list(CASES), "repeats": reps, "warmup": warmup}
    sides = {"ours": ("ours", None), "HF": ("hf", common.torch_env()), "HF 1 thread": ("hf", common.torch_env(1))}
    if args.against:
        sides["REV"] = ("ours", common.rev_env(common.worktree(args.against)))
    runs = common.alternate(args.rounds, sides, lambda _, s: common.run_worker(__name__, s[0], payload, env=s[1]))
    records = []
    for name in CASES:
        c = make_case(name)
        rec = {"case": name, "shape": list(c["ids"].shape)}
        records.append(rec | {side: common.pooled(rs, name, "times")["median"] for side, rs in runs.items()})
    return {
        "rounds": args.rounds,
        "repeats": reps,
        "warmup_s": warmup,
        "checked": args.check,
        "torch_threads": runs["HF"][0]["torch_threads"],
        "cases": records,
        "against": common.rev_info(args.against) if args.against else None,
    }


def report(result: dict) -> str:
    d, fmt = result["data"], common.fmt_seconds
    heads = ["case", "tokens", f"HF {d['torch_threads']} thr", "HF 1 thr", "ours", "HF / ours"]
    if d.get("against"):
        rev = d["against"]["hash"][:7]
        heads += [rev, f"{rev} / ours"]
    rows = []
    for c in d["cases"]:
        hf = min(c["HF"], c["HF 1 thread"])
        row = [c["case"], " x ".join(map(str, c["shape"])), fmt(c["HF"]), fmt(c["HF 1 thread"]), fmt(c["ours"])]
        row.append(f"**{hf / c['ours']:.0f}x**")
        if d.get("against"):
            row += [fmt(c["REV"]), f"{c['REV'] / c['ours']:.2f}x"]
        rows.append(row)
    worst = min(min(c["HF"], c["HF 1 thread"]) / c["ours"] for c in d["cases"])
    one, met = d["cases"][0]["ours"], ("missed", "met")
    return (
        f"Medians of {d['rounds']} round(s), each case after {d['warmup_s']} s of untimed calls; ratios against the "
        f"faster HF run{'; ours == HF checked on every case first' if d.get('checked') else ''}.\n\n"
        + common.markdown_table(heads, rows)
        + f"\n\nTargets: every case >= 50x HF {met[worst >= 50]} (least {worst:.0f}x); the one-image prompt "
        f"<= 20 µs {met[one <= 20e-6]} ({fmt(one)})."
    )


def _check_worker(p: dict) -> dict:
    check_equal()
    return {}


WORKERS = {"ours": ours_worker, "hf": hf_worker, "check": _check_worker}
