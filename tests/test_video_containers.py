"""Only real video containers: a video from a stranger never makes us read another file of the
machine or fetch a URL. ffmpeg picks demuxers by content, and its concat lists, HLS playlists and
image sequences open what they name; we open containers from file objects with an allow-list
(preprocess/video_io.py). An ffconcat list naming a picture, an HLS playlist naming a URL of an HTTP
server this test runs on 127.0.0.1, and an image-sequence pattern are refused by the API, by
`encode` and by `serve`, nothing is fetched, and no error tells whether a named path exists."""

from __future__ import annotations

import pathlib
import re

import pytest
import video_streams as vs

from qwen_vit_jax.errors import Unsupported
from qwen_vit_jax.preprocess.video import preprocess_video

av = pytest.importorskip("av")

REFUSED = {"concat": "concat", "concat_missing": "concat", "hls": "hls", "sequence": "png image"}


@pytest.fixture()
def hostile(tmp_path):
    """(files by name, the HTTP server's hits): the hostile files, their HLS URL on a live server."""
    with vs.web_server() as (url, hits):
        yield vs.hostile_files(tmp_path, url), hits


def test_ffmpeg_alone_would_read_the_named_picture(hostile):
    """What the allow-list is for: PyAV given the path opens the list and decodes the picture it names."""
    files, _ = hostile
    with av.open(str(files["concat"])) as c:
        assert c.format.name == "concat" and (c.streams.video[0].width, c.streams.video[0].height) == (64, 48)


def test_the_api_refuses_them_by_name(hostile, tmp_path):
    files, hits = hostile
    messages = {}
    for name, path in files.items():
        for source in (str(path), path.read_bytes()):  # a path, and the same bytes
            with pytest.raises(Unsupported) as e:
                preprocess_video(source)
            assert e.value.what == REFUSED[name]
            assert str(e.value).endswith(f"not a supported video container ({REFUSED[name]})")
        messages[name] = str(e.value)
    assert messages["concat"] == messages["concat_missing"]  # whether the named picture exists: not told
    assert hits == []


def test_encode_refuses_them_and_goes_on(capsys, hostile, tiny_dirs, tmp_path):
    files, hits = hostile
    good = tmp_path / "good.png"
    good.write_bytes(vs.png(56, 84, seed=5))
    out = tmp_path / "emb.safetensors"
    rc, _, err = vs.cli(capsys, "encode", tiny_dirs[1], *files.values(), good, "-o", out, "--keep-going")
    assert rc == 1 and "Traceback" not in err, err
    for name, path in files.items():
        assert f"warning: skipped {path}: Unsupported: {path}: not a supported video container ({REFUSED[name]})" in err
    from qwen_vit_jax.data.embeddings import read_embeddings

    assert read_embeddings(out).names == [str(good)]
    assert "secret" not in err and "picture.png" not in err and "nothing.png" not in err
    assert hits == []


def test_serve_refuses_them(hostile, tiny_dirs, tiny_encoder):
    from qwen_vit_jax.serve.settings import Settings

    files, hits = hostile
    names = list(files)
    settings = Settings(checkpoint=str(tiny_dirs[1]), workers=0)
    answers = vs.post_items(settings, tiny_encoder, [{"video": files[n].read_bytes()} for n in names])
    for name, r in zip(names, answers):
        assert r.status_code in (400, 415), (name, r.status_code, r.text)
        message = r.json()["error"]["message"]
        assert message == f"input[0]: not a supported video container ({REFUSED[name]})", message
        assert not re.search(r"/tmp|secret|picture|nothing\.png", message), message
    assert hits == []


def test_real_containers_still_open(tmp_path):
    """The allow-list holds what encode reads as videos: mp4 / mov, WebM / Matroska, AVI, MPEG-TS,
    GIF (the test clips' containers and codecs)."""
    from benchmarks.workloads import clips as video_samples

    for name in ("h264_330x250_24fps_5s", "vp9_232x174_12.5fps_10s_no_count", "mjpeg_odd_213x157_23.976fps_2s"):
        path = video_samples.write_clip(tmp_path / (name + video_samples.CLIPS[name][2]), name)
        assert preprocess_video(path, num_frames=4)[1][0, 0] == 2
    ts = tmp_path / "clip.ts"
    with av.open(str(ts), "w", format="mpegts") as out:
        s = out.add_stream("mpeg2video", rate=25)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        import numpy as np

        for i in range(10):
            out.mux(s.encode(av.VideoFrame.from_ndarray(np.full((48, 64, 3), 20 * i, np.uint8), format="rgb24")))
        out.mux(s.encode())
    assert preprocess_video(str(ts), num_frames=4)[1][0, 0] == 2
    gif = pathlib.Path(tmp_path / "a.gif")
    from PIL import Image

    frames = [Image.new("RGB", (64, 48), (40 * i, 0, 0)) for i in range(4)]
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert preprocess_video(gif.read_bytes())[1][0].tolist() == [2, 4, 4]
