"""VisionEncoder's named parts, each through its public API: the compiled programs (`enc.programs`),
the bucket choice (`enc.bucket_choice`, plan/choice.py), a request's program calls (`enc.prepare` /
`enc.run`), one `Preprocessing` value everywhere (the old keywords still work, with a
DeprecationWarning), and `encode_files`, which reports progress through a callback and prints nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sample_images import make_image

import qwen_vit_jax as qvj
from qwen_vit_jax import plan as planlib
from qwen_vit_jax.tools.demo import TINY

GRID = [[1, 8, 12], [2, 6, 8]]


def _pixels(grid, seed=0):
    n = int(np.prod(np.asarray(grid), axis=1).sum())
    return np.random.default_rng(seed).standard_normal((n, TINY.patch_dim)).astype(np.float32)


def test_prepare_then_run_is_encode(tiny_encoder):
    enc, px = tiny_encoder, _pixels(GRID)
    prepared = enc.prepare(px, GRID)  # host only: plans, checked and padded pixels
    assert prepared.buckets == [p.bucket for p in enc.bucket_choice.plans(GRID)]
    assert prepared.frames is None and len(prepared.steps) == len(prepared.buckets) and prepared.items is None
    # one device is a mesh of one: every input has a leading [1] axis
    assert [x.shape for x in prepared.pixels] == [(1, b.patches, TINY.patch_dim) for b in prepared.buckets]
    assert np.array_equal(enc.run(prepared), enc.encode(px, GRID))
    with pytest.raises(ValueError, match="rows but grid_thw implies"):
        enc.prepare(px[:-4], GRID)


def test_programs_compile_once_and_report_their_cost(tiny_encoder):
    programs = tiny_encoder.programs
    (bucket,) = tiny_encoder.prepare(_pixels(GRID), GRID).buckets
    program = programs.get(bucket)
    count = programs.compile_count
    assert programs.get(bucket) is program and programs.compile_count == count  # compiled once
    assert programs.flops(bucket) * len(programs.devices) == tiny_encoder.cost_report(GRID)["compiled_flops"]
    assert programs.memory(bucket).temp_size_in_bytes == tiny_encoder.cost_report(GRID)["temp_bytes"]
    tokens, features = program(programs.state, *tiny_encoder.prepare(_pixels(GRID), GRID).calls[0])
    assert tokens.shape == (1, bucket.patches // TINY.merge_unit, TINY.out_dim) and features == []
    assert programs.dtype == tiny_encoder.dtype == "float32" and programs.mesh.devices.size == 1


def test_bucket_choice_ladder_declared_and_tight_after():
    big = [[1, 36, 36]]  # 1296 rows: the ladder's 1536-row rung, or 1296 tight
    choice = planlib.BucketChoice(TINY)
    (ladder,) = [p.bucket for p in choice.plans(big)]
    assert ladder.patches == 1536 and not choice.is_declared(big)
    choice.declare(big)
    (tight,) = [p.bucket for p in choice.plans(big)]
    assert choice.is_declared(big) and tight.patches == 1296

    after = planlib.BucketChoice(TINY, tight_after=2)
    assert after.plans(big)[0].bucket == ladder  # the first encode: the ladder
    after.count(big)
    assert after.plans(big)[0].bucket.patches == 1296  # the second: its tight bucket
    capped = planlib.BucketChoice(TINY, tight_after=1, max_tight_buckets=0)
    assert capped.plans(big)[0].bucket == ladder  # no room for another tight bucket
    with pytest.raises(ValueError, match="tight_after must be an int >= 1"):
        planlib.BucketChoice(TINY, tight_after=0)


def test_one_preprocessing_value(tiny_dirs, tiny_encoder):
    enc = tiny_encoder
    p = enc.preprocessing
    assert isinstance(p, qvj.Preprocessing) and p.variant == enc.cfg.variant
    assert (p.image, p.video) == (enc.preprocess, enc.video_preprocess)
    assert p.image.max_pixels == 12845056  # the checkpoint's preprocessor_config.json, not HF's class default
    smaller = p.with_limits(max_pixels=56 * 56 * 4, fps=2.0, do_sample_frames=True)
    assert (smaller.image.max_pixels, smaller.video.max_pixels, smaller.video.fps) == (12544, 12544, 2.0)
    assert smaller.image.min_pixels == p.image.min_pixels
    with pytest.raises(ValueError, match="Preprocessing.image must be a PreprocessConfig"):
        qvj.Preprocessing(image=None, video=p.video, variant=p.variant)

    images = [make_image(56, 84), make_image(84, 84, seed=1)]
    with qvj.data.load(images, preprocessing=smaller) as items:
        new = list(items)
    with pytest.deprecated_call(match="config=, video_config=, variant= are deprecated"):
        old = qvj.data.load(images, config=smaller.image, video_config=smaller.video, variant=smaller.variant)
    with old:
        old = list(old)
    for a, b in zip(new, old):
        assert np.array_equal(a.grid, b.grid) and np.array_equal(a.patches.data, b.patches.data)

    with pytest.deprecated_call(match="preprocess= are deprecated"):
        legacy = qvj.VisionEncoder.from_pretrained(tiny_dirs[1], preprocess=smaller.image)
    assert legacy.preprocessing == dataclasses.replace(p, image=smaller.image)  # the video config: the checkpoint's
    given = qvj.VisionEncoder.from_pretrained(tiny_dirs[1], preprocessing=smaller)
    assert given.preprocessing == smaller
    with pytest.raises(ValueError, match="not both"):
        qvj.VisionEncoder(enc.cfg, {}, preprocessing=p, video_preprocess=p.video)


def test_encode_files_reports_through_a_callback(tiny_encoder, tmp_path, capsys):
    from qwen_vit_jax.data.embeddings import FORMAT, VERSION, read_embeddings
    from qwen_vit_jax.data.encode_files import Update, encode_files

    paths = []
    for i, (h, w) in enumerate([(56, 84), (84, 84)]):
        make_image(h, w, seed=i).save(tmp_path / f"im{i}.png")
        paths.append(str(tmp_path / f"im{i}.png"))
    (tmp_path / "bad.png").write_bytes(b"not an image")
    paths.insert(1, str(tmp_path / "bad.png"))
    prep = tiny_encoder.preprocessing
    meta = {"format": FORMAT, "version": VERSION, "checkpoint": "tiny", "dtype": "float32"}
    meta.update(preprocess=prep.image.to_dict(), video_preprocess=prep.video.to_dict())
    updates: list[Update] = []
    out = tmp_path / "emb.safetensors"
    r = encode_files(tiny_encoder, paths, out, meta, keep_going=True, progress=updates.append)
    assert capsys.readouterr() == ("", "")  # nothing printed: the caller shows what it wants
    assert r.names == [paths[0], paths[2]] and [name for name, _ in r.failed] == [paths[1]]
    assert updates[0] == Update(0, 3) and updates[-1].finished
    shown = [u for u in updates if u.note is None and not u.finished]
    assert shown[-1] == Update(2, 2) and max(u.done for u in updates) == 2  # the failed input: never done
    notes = [u.note for u in updates if u.note]
    assert len(notes) == 1 and notes[0].startswith(f"warning: skipped {paths[1]}: ")
    want = tiny_encoder.encode_images([make_image(56, 84), make_image(84, 84, seed=1)])
    got = read_embeddings(out)
    assert got.names == r.names and all(np.array_equal(got[i], w) for i, w in enumerate(want))

    with pytest.deprecated_call(match="image_cfg=, video_cfg= are deprecated"):
        encode_files(
            tiny_encoder, paths[:1], tmp_path / "old.safetensors", meta, image_cfg=prep.image, video_cfg=prep.video
        )
    assert np.array_equal(read_embeddings(tmp_path / "old.safetensors")[0], want[0])
