"""Video containers read safely (PyAV): the one file or bytes given, in a container on an allow-list,
and the frames at sampled indices decoded in one pass.

    info = probe("clip.mp4")                  # frame count, rate, size, container: no frame decoded
    for position, frame in decode(data, indices, name="input[3]"):   # bytes too: nothing on disk
        ...

ffmpeg picks a demuxer by content, and some demuxers open other files or URLs: concat (`ffconcat`
lists), HLS and DASH playlists, image sequences (`img%03d.png`), devices. A video from a stranger
(a dataset, a request) must never make us read another file of the machine or fetch a URL, so:

  * the container is opened from a Python file object (a path opened by us, bytes in memory): no
    file name reaches ffmpeg, so no protocol (`concat:`, `http:`, `file:`) and no name pattern is
    ever parsed;
  * ffmpeg's `format_whitelist` keeps its content guessing to CONTAINERS, single-file containers
    that hold their own frames; anything else is refused before its demuxer reads a byte of
    header (`Unsupported`, naming the container when we recognise it);
  * a demuxer that asks to open another file or URL (mov's external data references, should a
    build enable them) gets an error from our `io_open`: nothing is opened.

Errors never tell whether another path exists: they name the input and the container, never what
it refers to. A frame over `max_pixels` is refused before it is decoded (the container's size is
checked by the caller; the decoder refuses a frame that grows mid-stream).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
from collections.abc import Iterator

import numpy as np

from qwen_vit_jax.errors import BadInput, TooLarge, Unsupported

# ffmpeg's demuxer names (each a comma list) of the containers we open: single files that carry
# their own frames and never reference another file or URL. mp4 / mov / 3gp, Matroska / WebM, AVI,
# MPEG transport and program streams, GIF, FLV and ASF (WMV): the suffixes encode reads as videos.
CONTAINERS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi", "mpegts", "mpeg", "gif", "flv", "asf")
_ALLOWED = ",".join(CONTAINERS)
# What refused content most often is, by its first bytes: to name it in the error, and to call a
# playlist or list that this ffmpeg build does not even recognise (HLS without its .m3u8 name) what
# it is. ffmpeg's allow-list decides what is opened, never this table.
_SIGNATURES = (
    (b"ffconcat", "concat"),
    (b"#EXTM3U", "hls"),
    (b"<MPD", "dash"),
    (b"<?xml", "xml"),
    (b"\x89PNG", "png image"),
    (b"\xff\xd8\xff", "jpeg image"),
    (b"BM", "bmp image"),
    (b"RIFF", "riff"),
)
_LISTS = ("concat", "hls", "dash", "xml")  # what names other files or URLs


class VideoError(BadInput):
    """A video that cannot be decoded as asked (corrupt, truncated, no video stream)."""


@dataclasses.dataclass(frozen=True)
class VideoInfo:
    """What the container says about a video stream (HF's `VideoMetadata` fields we need)."""

    total_frames: int
    fps: float | None  # stream.average_rate; None when the container has none
    width: int
    height: int
    container: str = ""  # ffmpeg's demuxer name, e.g. "mov,mp4,m4a,3gp,3g2,mj2"


def _av():
    try:
        import av
    except ImportError:
        raise ImportError(
            "decoding video files needs PyAV: pip install 'qwen_vit_jax[video]' (or pass decoded frames)"
        ) from None
    return av


def _reason(e) -> str:
    """FFmpeg's words for an error, without its errno ("[Errno 1094995529]") and any file name."""
    return getattr(e, "strerror", None) or type(e).__name__


def source_name(source) -> str:
    """What an error calls a video: a path as given, bytes "the video"."""
    return os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the video"


def named(name: str, text: str) -> str:
    """`text` about the video `name`: "NAME: text", or the text alone for name "" (a service's item,
    which its caller names)."""
    return f"{name}: {text}" if name else text


@contextlib.contextmanager
def _file(source):
    """The source as a binary file object: a path opened here, bytes in memory, a file object as it is
    (rewound: it is read once to probe and once to decode)."""
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"no such video file: {os.fspath(source)}")
        with open(source, "rb") as f:
            yield f
    elif isinstance(source, (bytes, bytearray, memoryview)):
        yield io.BytesIO(source)
    elif hasattr(source, "read") and hasattr(source, "seek"):
        source.seek(0)
        yield source
    else:
        raise TypeError(f"a video is a file path, bytes or a binary file object, got {type(source).__name__}")


def _no_other_files(url, flags, options):
    """PyAV's io_open: a demuxer asks for another file or URL. Refused, whatever it names."""
    raise PermissionError("a video may not open other files")


def _sniff(f) -> str | None:
    f.seek(0)
    head = f.read(64).lstrip()
    return next((name for sig, name in _SIGNATURES if head.startswith(sig)), None)


@contextlib.contextmanager
def open_video(source, name: str | None = None):
    """An opened PyAV container of `source` (a path, bytes or a binary file object) whose demuxer is
    on the allow-list (module docstring). Unsupported for any other container, VideoError for
    data ffmpeg cannot read or a container without a video stream."""
    av = _av()
    name = source_name(source) if name is None else name
    with _file(source) as f:
        try:
            container = av.open(f, "r", options={"format_whitelist": _ALLOWED}, io_open=_no_other_files)
        except av.FFmpegError as e:
            what = _sniff(f)
            if e.errno == errno.EINVAL or what in _LISTS:  # EINVAL: ffmpeg's "Format not on whitelist"
                said = what or "a format we do not read"
                raise Unsupported(named(name, f"not a supported video container ({said})"), what=what) from None
            why = f"{_reason(e)}; truncated, corrupt or not a video?"
            raise VideoError(named(name, f"cannot read as a video ({why})")) from None
        except PermissionError:
            raise Unsupported(named(name, "the container refers to other files"), what="reference") from None
        with container:
            if not container.streams.video:
                raise VideoError(named(name, "no video stream"))
            yield container


def probe(source, name: str | None = None) -> VideoInfo:
    """Frame count, rate and size of a video's first video stream, from its container (as HF's PyAV
    reader), the frames counted by demuxing (no decoding) where the container does not record them.
    No frame is decoded. VideoError / Unsupported as `open_video`."""
    name = source_name(source) if name is None else name
    av = _av()
    with open_video(source, name) as container:
        stream = container.streams.video[0]
        try:
            total = stream.frames
            if total <= 0:  # not recorded: count packets (no decoding)
                total = sum(1 for p in container.demux(stream) if p.size)
        except av.FFmpegError as e:
            why = f"{_reason(e)}; truncated or corrupt?"
            raise VideoError(named(name, f"cannot read as a video ({why})")) from None
        rate = stream.average_rate
        fps = float(rate) if rate else None
        return VideoInfo(int(total), fps, stream.width, stream.height, container.format.name)


def check_frame_pixels(info: VideoInfo, max_pixels: int | None, name: str, limit: str = "max_pixels") -> None:
    """TooLarge when the container announces frames over `max_pixels` pixels (None: no bound)."""
    if max_pixels is not None and info.width * info.height > max_pixels:
        raise TooLarge(
            named(name, f"its frames are {info.width}x{info.height} = {info.width * info.height:,} pixels; ")
            + f"at most {max_pixels:,} per frame",
            limit=limit,
        )


def decode(source, indices: np.ndarray, *, name: str, max_pixels: int | None = None) -> Iterator[tuple[int, object]]:
    """The frames at `indices` (non-decreasing; repeats allowed) of a video's first stream, decoded in
    one pass in order: (index, PyAV frame) per distinct index, decoding stopped after the last one.

    Frames are numbered in presentation order as HF's PyAV reader numbers them. VideoError when the
    video ends before the last index or decoding fails; a frame over `max_pixels` is refused by the
    decoder itself."""
    av = _av()
    want = set(indices.tolist())
    last, seen = int(indices[-1]), 0
    with open_video(source, name) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame / slice threads; frames come out in order all the same
        if max_pixels is not None:  # a frame that grows past the bound mid-stream: refused, not decoded
            stream.codec_context.options = {"max_pixels": str(max_pixels)}
        try:
            for i, frame in enumerate(container.decode(stream)):
                seen = i + 1
                if i in want:
                    yield i, frame
                if i >= last:
                    break
        except av.FFmpegError as e:
            raise VideoError(named(name, f"decoding failed after {seen} frames ({_reason(e)})")) from None
    if seen <= last:
        raise VideoError(named(name, f"truncated or corrupt: decoded {seen} frames, frame {last} was to be sampled"))
