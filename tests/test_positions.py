"""The language model's inputs, positions part: `prompt_config`, `token_types`, `rope_index` and
`decode_positions` against HF's own code (installed transformers) for every family we load.

HF's `get_rope_index` is called on a stand-in instance that holds HF's real config object of the
family (built from the same config.json dict prompt_config reads): it needs no weights."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from prompt_configs import FAMILIES, GLM, config_dict

from qwen_vit_jax.families import OMNI
from qwen_vit_jax.prompt import config as pc
from qwen_vit_jax.prompt import positions as pos
from qwen_vit_jax.prompt.config import PromptConfig, prompt_config
from qwen_vit_jax.prompt.positions import token_types


def write_config(tmp_path, family: str, **kw):
    path = tmp_path / family
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config_dict(family, **kw)))
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_config_reads_every_family(family, tmp_path):
    cfg = prompt_config(write_config(tmp_path, family))
    assert cfg.family == family and cfg.rules == pc.RULES[family]
    assert cfg.image_token_id == 90 and cfg.spatial_merge_size == 2
    assert cfg.video_token_id == (None if family == "paddleocr_vl" else 91)
    assert cfg.deepstack == (family in ("qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe"))
    if family in OMNI:
        assert (cfg.audio_token_id, cfg.audio_start_token_id, cfg.position_id_per_seconds) == (94, 95, 13)
    else:
        assert cfg.audio_token_id is None
    if family in GLM:
        assert (cfg.video_start_token_id, cfg.video_end_token_id) == (97, 98)
    if family == "qwen2_5_vl":
        assert cfg.tokens_per_second == 2


def test_prompt_config_is_read_once(tmp_path):
    path = write_config(tmp_path, "qwen2_5_vl")
    first = prompt_config(str(path))
    (path / "config.json").unlink()  # a second call reads no file
    assert prompt_config(str(path)) is first
    assert prompt_config(first) is first


def test_prompt_config_errors(tmp_path):
    d = config_dict("qwen3_omni_moe")
    del d["thinker_config"]["vision_start_token_id"]
    (tmp_path / "omni.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="vision_start_token_id"):
        prompt_config(tmp_path / "omni.json")
    (tmp_path / "llama.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="'llama' is not a vision-language model"):
        prompt_config(tmp_path / "llama.json")
    with pytest.raises(FileNotFoundError):
        prompt_config(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown family"):
        PromptConfig(family="llama", image_token_id=1, video_token_id=2, vision_start_token_id=3, vision_end_token_id=4)


def _hf_types(family: str, cfg: PromptConfig, ids: np.ndarray) -> np.ndarray:
    """HF's processor's mm_token_type_ids of `ids` (its create_mm_token_type_ids on a stand-in)."""
    from transformers.processing_utils import ProcessorMixin

    if family in GLM:
        from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

        me = types.SimpleNamespace(
            image_token_id=cfg.image_token_id,
            video_start_id=cfg.video_start_token_id,
            video_end_id=cfg.video_end_token_id,
        )
        return np.array(Glm4vProcessor.create_mm_token_type_ids(me, ids.tolist()))
    me = types.SimpleNamespace(
        image_token_ids=[cfg.image_token_id], video_token_ids=[cfg.video_token_id], audio_token_ids=[cfg.audio_token_id]
    )
    return np.array(ProcessorMixin.create_mm_token_type_ids(me, ids.tolist()))


@pytest.mark.parametrize("family", FAMILIES)
def test_token_types_equal_hf_processor(family, tmp_path):
    cfg = prompt_config(write_config(tmp_path, family))
    rng = np.random.default_rng(0)
    ids = rng.integers(85, 100, size=(4, 64))
    np.testing.assert_array_equal(token_types(cfg, ids), _hf_types(family, cfg, ids))


# ---- HF's get_rope_index on a stand-in ------------------------------------------------------------
def _hf_model_class(family: str):
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    owner = "PreTrainedModelForConditionalGeneration" if family in OMNI else "Model"
    (cls,) = (
        c
        for name, c in vars(mod).items()
        if isinstance(c, type) and name.endswith(owner) and "get_rope_index" in vars(c) and "Talker" not in name
    )
    return cls


def hf_stand_in(family: str, d: dict):
    """An object HF's get_rope_index runs on: HF's own config object of `d`, the helper methods."""
    from qwen_vit_jax.tools.hf_reference import _hf_classes

    hf_cfg = _hf_classes(family)[0].from_dict(d)
    if family in OMNI:
        hf_cfg = hf_cfg.thinker_config
    cls = _hf_model_class(family)
    me = types.SimpleNamespace(config=hf_cfg, spatial_merge_size=hf_cfg.vision_config.spatial_merge_size)
    for name in ("get_vision_position_ids", "get_llm_pos_ids_for_vision", "get_chunked_index"):
        if hasattr(cls, name):
            setattr(me, name, types.MethodType(getattr(cls, name), me))
    return cls, me


def hf_rope_index(family, stand_in, ids, mask, types_, images, videos, spgt, audio_seqlens, aiv):
    import torch

    cls, me = stand_in

    def t(x, dtype=torch.long):
        return None if x is None else torch.as_tensor(np.asarray(x), dtype=dtype)

    with torch.no_grad():
        if family in OMNI:
            pos, deltas = cls.get_rope_index(
                me, t(ids), t(images), t(videos), t(mask), aiv, t(audio_seqlens), t(spgt, torch.float32)
            )
        else:
            kw = {"second_per_grid_ts": t(spgt, torch.float32)} if family == "qwen2_5_vl" else {}
            pos, deltas = cls.get_rope_index(
                me,
                t(ids),
                mm_token_type_ids=t(types_, torch.int32),
                image_grid_thw=t(images),
                video_grid_thw=t(videos),
                attention_mask=t(mask),
                **kw,
            )
    return pos.numpy(), deltas.numpy()


# ---- random prompts, laid out as each family's processor lays them out ----------------------------
def _text(rng, lo=0, hi=4):
    return list(rng.integers(1, 80, int(rng.integers(lo, hi + 1))))


def _grid(rng, t_max=1):
    return [int(rng.integers(1, t_max + 1)), 2 * int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4))]


def _aiv_layout(family, cfg, thw, s, n_audio):
    """The video / audio token order of a video with its audio track (the Omni processors')."""
    hw = thw[1] * thw[2] // 4
    tv = [
        np.float32(np.float32(np.float32(k) * np.float32(s)) * np.float32(cfg.position_id_per_seconds))
        for k in range(thw[0])
    ]
    # Qwen3-Omni keeps a frame's time as a float (fractional times are legal); Qwen2.5-Omni truncates
    vt = [tv[i // hw] if family == "qwen3_omni_moe" else int(tv[i // hw]) for i in range(thw[0] * hw)]
    v, a = cfg.video_token_id, cfg.audio_token_id
    if family == "qwen3_omni_moe":
        out, i, j = [], 0, 0
        while i < len(vt) and j < n_audio:
            if vt[i] <= j:
                out.append(v)
                i += 1
            else:
                out.append(a)
                j += 1
        return out + [v] * (len(vt) - i) + [a] * (n_audio - j)

    def chunks(vals):
        tpc = int(cfg.position_id_per_seconds * cfg.seconds_per_chunk)
        ends, c = [], 1
        for i, x in enumerate(vals):
            if x >= c * tpc:
                ends.append(i)
                c += 1
        sizes = np.diff([0, *ends, len(vals)])
        return list(sizes)

    vs, as_ = chunks(vt), chunks(list(range(n_audio)))
    out = []
    for j in range(max(len(vs), len(as_))):
        out += [v] * (vs[j] if j < len(vs) else 0) + [a] * (as_[j] if j < len(as_) else 0)
    return out


def random_row(family, cfg, rng, n_items, aiv=False):
    """One prompt: (ids, image grids, video grids, seconds per grid, audio seqlens)."""
    ids, images, videos, spgt, audios = _text(rng), [], [], [], []
    kinds = ["image"] + ([] if family == "paddleocr_vl" else ["video"]) + (["audio"] if family in OMNI else [])
    vs, ve, im, vi = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id
    for _ in range(n_items):
        kind = kinds[int(rng.integers(len(kinds)))]
        if kind == "image":
            g = _grid(rng)
            images.append(g)
            start, end = (cfg.image_start_token_id, cfg.image_end_token_id) if family in GLM else (vs, ve)
            ids += [start] + [im] * (g[1] * g[2] // 4) + [end]
        elif kind == "audio":
            n = int(rng.integers(3, 60))
            audios.append(n)
            ids += (
                [cfg.audio_start_token_id]
                + [cfg.audio_token_id] * int(pos.audio_tokens(cfg, [n])[0])
                + [cfg.audio_end_token_id]
            )
        else:
            g = _grid(rng, t_max=3)
            videos.append(g)
            s = float(rng.choice([0.5, 1.0, 1 / 3, 2 / 3, 1.5, 2.0]))  # 13 positions a second: fractional times
            spgt.append(s)
            hw = g[1] * g[2] // 4
            if aiv:
                n = int(rng.integers(3, 120))
                audios.append(n)
                layout = _aiv_layout(family, cfg, g, s, int(pos.audio_tokens(cfg, [n])[0]))
                ids += [vs, cfg.audio_start_token_id] + layout + [cfg.audio_end_token_id, ve]
            elif family in GLM:  # per frame: <image_start> tokens <image_end> then its timestamp text
                ids.append(cfg.video_start_token_id)
                for _ in range(g[0]):
                    ids += [cfg.image_start_token_id] + [im] * hw + [cfg.image_end_token_id] + _text(rng, 1, 2)
                ids.append(cfg.video_end_token_id)
            elif cfg.rules.split_frames:  # per frame: timestamp text, <vision_start> tokens <vision_end>
                for _ in range(g[0]):
                    ids += _text(rng, 1, 3) + [vs] + [vi] * hw + [ve]
            else:
                ids += [vs] + [vi] * (g[0] * hw) + [ve]
        ids += _text(rng)
    if not ids:
        ids = _text(rng, 1, 3)
    return ids, images, videos, spgt, audios


def random_batch(family, cfg, seed, rows=3, aiv=False):
    rng = np.random.default_rng(seed)
    got = [random_row(family, cfg, rng, int(rng.integers(0, 4)), aiv) for _ in range(rows)]
    width = max(len(r[0]) for r in got) + int(rng.integers(0, 3))
    left = bool(rng.integers(2))
    ids = np.zeros((rows, width), np.int64)
    mask = np.zeros((rows, width), np.int64)
    for b, r in enumerate(got):
        n = len(r[0])
        sl = slice(width - n, width) if left else slice(0, n)
        ids[b, sl], mask[b, sl] = r[0], 1
    cat = lambda i: sum((r[i] for r in got), [])  # noqa: E731
    images, videos = cat(1), cat(2)
    return dict(
        ids=ids,
        mask=mask,
        images=np.array(images, np.int64).reshape(-1, 3) if images else None,
        videos=np.array(videos, np.int64).reshape(-1, 3) if videos else None,
        spgt=np.array(cat(3), np.float32) if videos else None,
        audios=np.array(cat(4), np.int64) if cat(4) else None,
    )


def _ours(cfg, batch, aiv=False, types_=None):
    return pos.rope_index(
        cfg,
        batch["ids"],
        mm_token_type_ids=types_,
        image_grid_thw=batch["images"],
        video_grid_thw=batch["videos"],
        second_per_grid_ts=batch["spgt"],
        attention_mask=batch["mask"],
        audio_seqlens=batch["audios"],
        use_audio_in_video=aiv,
    )


@pytest.fixture(scope="module")
def family_setup(tmp_path_factory):
    out = {}

    def get(family):
        if family not in out:
            d = config_dict(family)
            path = tmp_path_factory.mktemp(family) / "config.json"
            path.write_text(json.dumps(d))
            out[family] = prompt_config(path), hf_stand_in(family, d)
        return out[family]

    return get


def _compare(family, cfg, stand_in, batch, aiv=False):
    types_ = token_types(cfg, batch["ids"])
    p, dl = _ours(cfg, batch, aiv)
    hp, hd = hf_rope_index(
        family,
        stand_in,
        batch["ids"],
        batch["mask"],
        types_,
        batch["images"],
        batch["videos"],
        batch["spgt"],
        batch["audios"],
        aiv,
    )
    # HF's dtype: float32 for Qwen3-Omni, int64 for every other family
    assert p.dtype == hp.dtype == dl.dtype == hd.dtype == pos.position_dtype(cfg), (p.dtype, hp.dtype, hd.dtype)
    assert p.shape == (3, *batch["ids"].shape) and dl.shape == (len(p[0]), 1)
    np.testing.assert_array_equal(p, hp)
    np.testing.assert_array_equal(dl, hd)
    if family not in OMNI:  # the same with the processor's types passed in
        p2, d2 = _ours(cfg, batch, aiv, types_=types_)
        np.testing.assert_array_equal(p2, hp)
        np.testing.assert_array_equal(d2, hd)


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_index_equals_hf(family, family_setup):
    cfg, stand_in = family_setup(family)
    for seed in range(25):
        batch = random_batch(family, cfg, seed)
        if family == "qwen2_5_vl" and seed % 2:
            batch["spgt"] = None  # HF's default: 1 second per grid
        _compare(family, cfg, stand_in, batch)


@pytest.mark.parametrize("family", OMNI)
def test_rope_index_audio_in_video_equals_hf(family, family_setup):
    cfg, stand_in = family_setup(family)
    for seed in range(25):
        batch = random_batch(family, cfg, 1000 + seed, aiv=True)
        _compare(family, cfg, stand_in, batch, aiv=True)


@pytest.mark.parametrize("family", OMNI)
def test_omni_text_only_branch_equals_hf(family, family_setup):
    """No image and no video grid: HF's thinkers take their text-only branch (padding 1)."""
    cfg, stand_in = family_setup(family)
    rng = np.random.default_rng(5)
    ids = rng.integers(1, 80, (3, 9))
    mask = np.ones((3, 9), np.int64)
    mask[0, :4] = 0  # left padding
    mask[1, :8] = 0  # one real token: HF's delta quirk (its padding 1 is the row's largest position)
    mask[2, :] = 0  # none: HF writes 1 everywhere, delta 2
    p, d = pos.rope_index(cfg, ids, attention_mask=mask)
    hp, hd = hf_rope_index(family, stand_in, ids, mask, None, None, None, None, None, False)
    assert p.dtype == d.dtype == hp.dtype == hd.dtype == pos.position_dtype(cfg)
    np.testing.assert_array_equal(p, hp)
    np.testing.assert_array_equal(d, hd)


def test_qwen3_omni_fractional_times_equal_hf(family_setup):
    """HF's Qwen3-Omni keeps k * s * position_id_per_seconds as float32 (13 * 0.5 = 6.5, 13 / 3
    rounded): positions and deltas float32, equal element for element, the text after a video
    continuing from a fractional position; a left-padded row and the text-only branch too."""
    family = "qwen3_omni_moe"
    cfg, stand_in = family_setup(family)
    vs, ve, v = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.video_token_id
    ids = np.array([[1, vs, v, v, v, ve, 3, 4], [0, 0, vs, v, v, ve, 5, 6]])
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    grids = [[3, 2, 2], [2, 2, 2]]
    for s in ([0.5, 1 / 3], [1 / 3, 2 / 3], [1.0, 2.0]):
        hp, hd = hf_rope_index(family, stand_in, ids, mask, None, None, grids, s, None, False)
        p, d = pos.rope_index(cfg, ids, video_grid_thw=grids, second_per_grid_ts=s, attention_mask=mask)
        assert p.dtype == d.dtype == hp.dtype == hd.dtype == np.float32
        np.testing.assert_array_equal(p, hp)
        np.testing.assert_array_equal(d, hd)
        if s[0] == 0.5:  # frame 1 of video 0: 1 * 0.5 s * 13 positions a second after its start at 2
            assert p[0, 0, 3] == 2 + 6.5 and p[0, 0, 5] == 2 + 13 + 1  # <vision_end> right after frame 2
        if s[0] == 1 / 3:  # 2 * f32(1 / 3) * 13 is not a whole number: nor is the text after it
            assert p[0, 0, 6] != np.floor(p[0, 0, 6])
    p, d = pos.rope_index(cfg, ids, attention_mask=mask)  # no grids: HF's text-only branch, float32 too
    hp, hd = hf_rope_index(family, stand_in, ids, mask, None, None, None, None, None, False)
    assert p.dtype == d.dtype == hp.dtype == hd.dtype == np.float32
    np.testing.assert_array_equal(p, hp)
    np.testing.assert_array_equal(d, hd)


# ---- decode positions vs HF's compute_3d_position_ids with a cache ---------------------------------
def hf_decode(deltas, start, length, mask):
    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    me = types.SimpleNamespace(rope_deltas=torch.as_tensor(deltas))
    cache = types.SimpleNamespace(get_seq_length=lambda: start)
    b = len(deltas) if mask is None else len(mask)
    out = Qwen2_5_VLModel.compute_3d_position_ids(
        me,
        input_ids=None,
        image_grid_thw=None,
        video_grid_thw=None,
        inputs_embeds=torch.zeros(b, length, 1),
        attention_mask=None if mask is None else torch.as_tensor(mask),
        cache=cache,
    )
    return out.numpy()


def test_decode_positions_equal_hf():
    rng = np.random.default_rng(0)
    deltas = np.array([[-3], [0], [7]], np.int64)
    for start, length in ((0, 5), (12, 1), (30, 4)):
        np.testing.assert_array_equal(
            pos.decode_positions(deltas, start, length), hf_decode(deltas, start, length, None)
        )
        mask = np.ones((3, start + length), np.int64)
        mask[0, : rng.integers(0, start + 1)] = 0  # left padding
        mask[2, start + length - 1] = 0 if length > 1 else 1  # a padded new token: HF writes 0 + delta there
        ours = pos.decode_positions(deltas, start, length, mask)
        np.testing.assert_array_equal(ours, hf_decode(deltas, start, length, mask)[:, :, start:])
        beams = np.repeat(mask, 2, axis=0)  # two beams per row: each row's delta repeated
        np.testing.assert_array_equal(
            pos.decode_positions(deltas, start, length, beams), hf_decode(deltas, start, length, beams)[:, :, start:]
        )
    assert pos.decode_positions(deltas[:, 0], 4, 2).shape == (3, 3, 2)
    # Qwen3-Omni's float32 deltas (fractional): HF's int64 positions + float32 deltas, in float32
    fdeltas = np.array([[-3.5], [0.0], [7.333333]], np.float32)
    for start, length in ((0, 5), (30, 4)):
        mask = np.ones((3, start + length), np.int64)
        mask[0, : min(3, start)] = 0
        for m in (None, mask):
            ours = pos.decode_positions(fdeltas, start, length, m)
            ref = hf_decode(fdeltas, start, length, m)
            ref = ref if m is None else ref[:, :, start:]
            assert ours.dtype == ref.dtype == np.float32
            np.testing.assert_array_equal(ours, ref)
    with pytest.raises(ValueError, match=r"whole mask, \[B, start \+ length\]"):
        pos.decode_positions(deltas, 4, 2, np.ones((3, 2)))
    with pytest.raises(ValueError, match="not a multiple"):
        pos.decode_positions(deltas, 4, 2, np.ones((4, 6), np.int64))


def test_decode_continues_the_prompt(family_setup):
    """A prompt's positions, then the decoded tokens': HF's generate() pieces, ours, agree end to end."""
    cfg, _ = family_setup("qwen2_5_vl")
    batch = random_batch("qwen2_5_vl", cfg, 3)
    p, d = _ours(cfg, batch)
    mask = np.concatenate([batch["mask"], np.ones((3, 2), np.int64)], axis=1)
    nxt = pos.decode_positions(d, batch["ids"].shape[1], 2, mask)
    assert (nxt[:, :, 0] == p.max(axis=(0, 2))[None] + 1).all()  # right after the prompt's largest position


# ---- bad input: a ValueError naming the row and the item --------------------------------------------
def _image_prompt(cfg, n_tokens, images=1):
    row = [1, 2]
    for _ in range(images):
        row += [cfg.vision_start_token_id] + [cfg.image_token_id] * n_tokens + [cfg.vision_end_token_id, 3]
    return np.array([row])


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n=3), r"row 0: image 0 has a run of 3 placeholder tokens, its grid gives 4"),
        (dict(images=2), r"row 0: image run 1 has no image_grid_thw entry left"),
        (
            dict(grids=[[1, 4, 4], [1, 2, 2]]),
            r"image_grid_thw: 2 entries, the prompt has image runs for 1 \(image_grid_thw\[1:\] left over\)",
        ),
        # grids are checked by plan.as_grid (the tower's own check), the argument named
        (dict(grids=[[1, 3, 4]]), r"image_grid_thw: grid_thw row 0 = \[1, 3, 4\]: h and w must be multiples of"),
        (dict(grids=[[0, 4, 4]]), r"image_grid_thw: grid_thw row 0 = \[0, 4, 4\]: t must be positive"),
        (dict(grids=[[1.0, 4, 4]]), r"image_grid_thw: grid_thw must hold integers"),
        (dict(mask=np.ones((1, 5))), r"attention_mask has shape \(1, 5\), input_ids \(1, 9\)"),
        (dict(mask=np.full((1, 9), 2)), r"attention_mask row 0, column 0: 2"),
        (dict(mask=np.zeros((1, 9), np.int64)), r"row 0: no unmasked token"),
        (dict(spgt=[1.0, 2.0]), r"second_per_grid_ts has 2 entries for 0 videos"),
        (dict(types=np.full((1, 9), 7)), r"row 0, column 0: mm_token_type_ids value 7"),
        (dict(types=np.zeros((2, 9), np.int64)), r"mm_token_type_ids must be integers of the shape"),
    ],
)
def test_rope_index_errors(kw, match, family_setup):
    cfg, _ = family_setup("qwen2_5_vl")
    ids = _image_prompt(cfg, kw.get("n", 4), kw.get("images", 1))
    with pytest.raises(ValueError, match=match):
        pos.rope_index(
            cfg,
            ids,
            image_grid_thw=kw.get("grids", [[1, 4, 4]]),
            attention_mask=kw.get("mask"),
            second_per_grid_ts=kw.get("spgt"),
            mm_token_type_ids=kw.get("types"),
        )


def test_rope_index_errors_videos_and_audio(family_setup):
    cfg, _ = family_setup("qwen3_vl")
    vs, ve, v = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.video_token_id
    one_frame = np.array([[1, vs, v, ve, 2]])
    with pytest.raises(ValueError, match="video 0: the prompt has runs for 1 of its 2 frames"):
        pos.rope_index(cfg, one_frame, video_grid_thw=[[2, 2, 2]])
    two_frames_joined = np.array([[1, vs, v, v, ve, 2]])  # frames split by text in Qwen3-VL's prompts
    with pytest.raises(ValueError, match="row 0: video 0 frame 0 has a run of 2 placeholder tokens, its grid gives 1"):
        pos.rope_index(cfg, two_frames_joined, video_grid_thw=[[2, 2, 2]])
    omni, _ = family_setup("qwen2_5_omni")
    a, as_, ae = omni.audio_token_id, omni.audio_start_token_id, omni.audio_end_token_id
    ids = np.array([[1, as_] + [a] * 3 + [ae]])
    with pytest.raises(ValueError, match="row 0: audio 0 has 3 placeholder tokens, its audio_seqlens entry gives 2"):
        pos.rope_index(omni, ids, image_grid_thw=np.zeros((0, 3), np.int64), audio_seqlens=[7])
    with pytest.raises(ValueError, match="second_per_grid_ts is required"):
        pos.rope_index(omni, ids, video_grid_thw=[[1, 2, 2]])
    plain = np.array([[1, omni.vision_start_token_id, omni.video_token_id, omni.vision_end_token_id]])
    with pytest.raises(ValueError, match="use_audio_in_video must follow <vision_start><audio_start>"):
        pos.rope_index(
            omni,
            plain,
            video_grid_thw=[[1, 2, 2]],
            second_per_grid_ts=[1.0],
            audio_seqlens=[7],
            use_audio_in_video=True,
        )
    with pytest.raises(ValueError, match="qwen3_vl has no audio"):
        pos.rope_index(cfg, one_frame, video_grid_thw=[[1, 2, 2]], use_audio_in_video=True)


# ---- the sources prompt_config takes ---------------------------------------------------------------
def test_prompt_config_sources(tmp_path, monkeypatch):
    """An HF dir, its config.json, the directory convert_checkpoint writes (it keeps hf_config.json), a
    hub id in the local cache: the same PromptConfig."""
    import os
    import shutil

    from qwen_vit_jax.tools.demo import TINY, write_random_hf_checkpoint
    from qwen_vit_jax.weights.convert import HF_CONFIG_FILE, convert_checkpoint

    hf = write_random_hf_checkpoint(TINY, tmp_path / "hf")
    out = convert_checkpoint(hf, tmp_path / "ckpt")
    assert (out / HF_CONFIG_FILE).read_bytes() == (hf / "config.json").read_bytes()
    commit = "0" * 40
    snap = tmp_path / "cache" / "models--Org--Tiny-VL" / "snapshots" / commit
    shutil.copytree(hf, snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    want = pc.config_from_dict(json.loads((hf / "config.json").read_text()))
    assert want.family == "qwen2_5_vl" and want.image_token_id == 151655
    for source in (hf, hf / "config.json", str(out), "Org/Tiny-VL", json.loads((hf / "config.json").read_text())):
        assert prompt_config(source) == want, source
    os.remove(out / HF_CONFIG_FILE)
    with pytest.raises(ValueError, match="without hf_config.json"):
        prompt_config(os.path.relpath(out))  # another spelling: not cached


# ---- lm_inputs: the same kernel call, positions and splice together -----------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_lm_inputs_equals_rope_index_and_plan_splice(family, family_setup):
    """One call gives rope_index's positions and deltas and plan_splice's plan (its counts: the
    tokens of each kind whose grids / lengths are given); with `cached`, the new columns' share."""
    from qwen_vit_jax.prompt.inputs import lm_inputs
    from qwen_vit_jax.prompt.splice import plan_splice

    cfg, _ = family_setup(family)
    for seed in range(6):
        batch = random_batch(family, cfg, 300 + seed)
        kw = dict(
            image_grid_thw=batch["images"],
            video_grid_thw=batch["videos"],
            second_per_grid_ts=batch["spgt"],
            attention_mask=batch["mask"],
            audio_seqlens=batch["audios"],
        )
        p, d = pos.rope_index(cfg, batch["ids"], **kw)
        types_ = token_types(cfg, batch["ids"])
        for cached in (0, batch["ids"].shape[1] // 2):
            got = lm_inputs(cfg, batch["ids"], **kw, cached=cached)
            np.testing.assert_array_equal(got.position_ids, p[:, :, cached:])
            np.testing.assert_array_equal(got.rope_deltas, d)
            assert got.position_ids.dtype == got.rope_deltas.dtype == pos.position_dtype(cfg)
            tail = types_[:, cached:]
            counts = [None if kw[k] is None else int((tail == t).sum()) for k, t in
                      (("image_grid_thw", 1), ("video_grid_thw", 2), ("audio_seqlens", 3))]  # fmt: skip
            # the types of the whole rows (GLM's depend on the video tags before the cut)
            want = plan_splice(cfg, batch["ids"][:, cached:], *counts, mm_token_type_ids=tail)
            plan = got.splice
            assert (plan.image_rows, plan.video_rows, plan.audio_rows) == tuple(counts)
            np.testing.assert_array_equal(plan.rows, want.rows)
            if cfg.deepstack:
                np.testing.assert_array_equal(plan.visual_pos_masks, want.visual_pos_masks)
                np.testing.assert_array_equal(plan.deepstack_rows, want.deepstack_rows)
            else:
                assert plan.visual_pos_masks is None and plan.deepstack_rows is None
        # int32 arrays take the general way in; the processors' int64 ones (above) the short one
        slow = lm_inputs(cfg, batch["ids"].astype(np.int32), **dict(kw, attention_mask=batch["mask"].astype(np.int32)))
        fast = lm_inputs(cfg, batch["ids"], **kw)
        for a, b in zip(
            (slow.position_ids, slow.rope_deltas, slow.splice.rows),
            (fast.position_ids, fast.rope_deltas, fast.splice.rows),
        ):
            np.testing.assert_array_equal(a, b)
        assert (slow.splice.image_rows, slow.splice.video_rows) == (fast.splice.image_rows, fast.splice.video_rows)


def test_lm_inputs_errors(family_setup):
    from qwen_vit_jax.prompt.inputs import lm_inputs

    cfg, _ = family_setup("qwen2_5_vl")
    ids = _image_prompt(cfg, 4)
    with pytest.raises(ValueError, match="cached must be between 0 and the prompt's 9 columns, got 10"):
        lm_inputs(cfg, ids, image_grid_thw=[[1, 4, 4]], cached=10)
    padded = np.concatenate([np.full((1, 2), cfg.image_token_id), ids], axis=1)  # placeholders in the padding
    mask = np.concatenate([np.zeros((1, 2), np.int64), np.ones_like(ids)], axis=1)
    with pytest.raises(ValueError, match="input_ids hold 6 image tokens, the image embeddings have 4 rows"):
        lm_inputs(cfg, padded, image_grid_thw=[[1, 4, 4]], attention_mask=mask)  # HF's count check
