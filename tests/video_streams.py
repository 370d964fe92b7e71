"""Helpers of the video streaming, bounds and container tests (test_video_stream.py,
test_video_bounds.py, test_video_containers.py): clips of any length, hostile container files, a
GIF that announces a huge frame, the service in-process and the CLI in-process. Not a test file.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fractions
import http.server
import io
import pathlib
import struct
import threading

import numpy as np
from PIL import Image


def write_frames(path, frames: int, width: int, height: int, fps: int = 30) -> str:
    """An H.264 clip (yuv420p, ultrafast) of `frames` moving frames: a gradient that drifts and a
    box that moves, each frame distinct."""
    import av

    y, x = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fractions.Fraction(fps, 1))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "23", "preset": "ultrafast"}
        for i in range(frames):
            img = np.empty((height, width, 3), np.uint8)
            img[..., 0] = (x * 255 // max(width - 1, 1) + 3 * i) % 256
            img[..., 1] = (y * 255 // max(height - 1, 1) + i) % 256
            img[..., 2] = (x + y + 5 * i) % 256
            bx = i * (width - width // 4) // max(frames - 1, 1)
            img[height // 3 : height // 3 + height // 4, bx : bx + width // 4] = (230, 30, 30)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return str(path)


def huge_gif(width: int, height: int, frames: int = 3) -> bytes:
    """A GIF whose header announces a width x height canvas while each frame is 1x1 pixel: a few
    hundred bytes that a decoder would expand to width * height * 4 bytes per frame."""
    buf = io.BytesIO()
    ims = [Image.new("P", (1, 1), i) for i in range(frames)]
    ims[0].save(buf, format="GIF", save_all=True, append_images=ims[1:], duration=100, loop=0)
    data = bytearray(buf.getvalue())
    data[6:10] = struct.pack("<HH", width, height)  # the logical screen descriptor
    return bytes(data)


def png(height: int, width: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def hostile_files(folder: pathlib.Path, url: str) -> dict[str, pathlib.Path]:
    """Files that some ffmpeg demuxer would read another file or URL through, each with a video
    suffix (so `encode` reads it as a video): an ffconcat list naming a picture that exists, one
    naming a picture that does not, an HLS playlist naming `url`, and an image-sequence pattern
    (`frame%03d.mp4`, a PNG, beside frame001.png ... that image2 with a path would read)."""
    secret = folder / "secret"
    secret.mkdir()
    (secret / "picture.png").write_bytes(png(48, 64, seed=1))
    out = {
        "concat": folder / "concat.mp4",
        "concat_missing": folder / "concat_missing.mp4",
        "hls": folder / "playlist.mp4",
        "sequence": folder / "frame%03d.mp4",
    }
    out["concat"].write_text("ffconcat version 1.0\nfile secret/picture.png\n")  # next to the list (ffmpeg's "safe")
    out["concat_missing"].write_text("ffconcat version 1.0\nfile secret/nothing.png\n")
    out["hls"].write_text(
        f"#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:2\n#EXT-X-MEDIA-SEQUENCE:0\n"
        f"#EXTINF:2.0,\n{url}/segment0.ts\n#EXTINF:2.0,\n{url}/segment1.ts\n#EXT-X-ENDLIST\n"
    )
    for i in range(1, 4):
        (folder / f"frame{i:03d}.png").write_bytes(png(48, 64, seed=i))
    out["sequence"].write_bytes(png(48, 64, seed=0))
    return out


@contextlib.contextmanager
def web_server():
    """(url, hits): an HTTP server on 127.0.0.1 answering every GET with a few bytes, and the list
    of paths it was asked for (what a test checks stays empty)."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"\x47\x00\x00\x00")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def post_items(settings, encoder, items: list[dict]) -> list:
    """Each item ({"video": bytes, ...} / {"image": bytes}) POSTed alone to the service of
    `settings` serving `encoder`, in-process: the responses, in order."""
    import httpx

    from qwen_vit_jax.serve.asgi import create_app

    async def go():
        app = create_app(settings, encoder=encoder)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as client:
                for _ in range(600):
                    if (await client.get("/readyz")).status_code == 200:
                        break
                    assert app.state.service.error is None, app.state.service.error
                    await asyncio.sleep(0.05)
                out = []
                for item in items:
                    x = {k: b64(v) if isinstance(v, bytes) else v for k, v in item.items()}
                    out.append(await client.post("/v1/embeddings", json={"input": [x]}))
                return out

    return asyncio.run(go())


def cli(capsys, *args) -> tuple[int, str, str]:
    """`qwen-vit-jax ARGS` in this process: (exit status, stdout, stderr)."""
    from qwen_vit_jax.tools import cli as tool

    rc = tool.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err
