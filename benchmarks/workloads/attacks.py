"""What a hostile client does to `qwen-vit-jax serve` on 127.0.0.1: sockets that never send a request
head (silent, or trickling one byte at a time: slowloris), bodies that stall, a 49-megapixel image;
and at the edges: an ICO holding a huge frame, headers claiming huge sizes, a request head that
never ends, clients that do not read their answers, pipelined requests.

Shared by tests/test_serve_hostile.py, tests/test_serve_edges.py (small scale) and the hostile suite
(measured).
Every socket is bounded in count and time and goes to 127.0.0.1.
"""

from __future__ import annotations

import io
import selectors
import socket
import threading
import time
import zlib

# A request head that never ends: one more header byte at a time (slowloris).
SLOW_HEAD = b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


class Sockets:
    """`silent` sockets that connect and send nothing, `slow` ones that trickle a request head (one
    byte every `every` s, never the end of it), and `stalled` ones that send a whole head announcing a
    body of `body_bytes` (with `headers`), 16 bytes of it, then nothing; all from `source` (another
    loopback address, 127.0.0.2: another client) when given. A thread watches them all:
    `closed[i]` is (seconds from its connect to the server's close, the first bytes the server sent).
    Index order: silent, then slow, then stalled. Use as a context manager; `close()` closes the rest."""

    def __init__(
        self,
        port: int,
        silent: int = 0,
        slow: int = 0,
        stalled: int = 0,
        every: float = 0.25,
        headers: dict | None = None,
        body_bytes: int = 100_000,
        source: str | None = None,
    ):
        self.kinds = ["silent"] * silent + ["slow"] * slow + ["stalled"] * stalled
        self.every = every
        self.socks: list[socket.socket] = []
        self.opened: list[float] = []
        self.closed: dict[int, tuple[float, bytes]] = {}
        self._got: dict[int, bytes] = {}
        self._stop = threading.Event()
        head = "POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._stalled = (head + f"Content-Length: {body_bytes}\r\n\r\n").encode() + b'{"input": [{"im'
        for kind in self.kinds:
            s = socket.create_connection(
                ("127.0.0.1", port), timeout=10, source_address=(source, 0) if source else None
            )
            s.setblocking(False)
            if kind == "stalled":
                s.sendall(self._stalled)
            self.socks.append(s)
            self.opened.append(time.monotonic())
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def __enter__(self) -> Sockets:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch(self) -> None:
        sel = selectors.DefaultSelector()
        for i, s in enumerate(self.socks):
            sel.register(s, selectors.EVENT_READ, i)
        sent = [0] * len(self.socks)
        next_byte = time.monotonic()
        while not self._stop.is_set() and len(self.closed) < len(self.socks):
            for key, _ in sel.select(timeout=0.05):
                i = key.data
                try:
                    data = key.fileobj.recv(4096)
                except (ConnectionError, OSError):
                    data = b""
                if data:
                    self._got[i] = self._got.get(i, b"") + data
                    continue
                self.closed[i] = (time.monotonic() - self.opened[i], self._got.get(i, b"")[:64])
                sel.unregister(key.fileobj)
            if time.monotonic() >= next_byte:  # the slow ones: one more byte of their head
                next_byte += self.every
                for i, (kind, s) in enumerate(zip(self.kinds, self.socks)):
                    if kind == "slow" and i not in self.closed:
                        chunk = SLOW_HEAD[sent[i] : sent[i] + 1] or b"a"
                        try:
                            s.send(chunk)
                            sent[i] += 1
                        except (BlockingIOError, OSError):
                            pass
        sel.close()

    def wait_closed(self, timeout: float) -> bool:
        """Whether the server closed every socket within `timeout` s from now."""
        deadline = time.monotonic() + timeout
        while len(self.closed) < len(self.socks) and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.closed) == len(self.socks)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            s.close()


def big_png(side: int = 7000) -> bytes:
    """A side x side PNG (49 MP at 7000: under the default 50 MP cap), mostly flat (a few hundred KB),
    with a gradient block so it is a picture."""
    import numpy as np
    from PIL import Image

    im = Image.new("RGB", (side, side), (90, 140, 200))
    y, x = np.mgrid[0:256, 0:256]
    im.paste(Image.fromarray(np.stack([x, y, (x + y) // 2], -1).astype(np.uint8)), (side // 3, side // 3))
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


# ---- the edges: crafted images, oversized heads, clients that do not read, pipelining ------------
def ico_holding(side: int = 3000) -> bytes:
    """An ICO whose directory lists one 16x16 frame that is in fact a side x side PNG (Pillow loads
    it whole when it opens the file). Flat, so the file is small."""
    import struct

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (40, 90, 160)).save(buf, "PNG", compress_level=1)
    png = buf.getvalue()
    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, len(png), 22) + png


def claiming(fmt: str, width: int, height: int) -> bytes:
    """A tiny image in Pillow format `fmt` (PNG, JPEG, GIF, BMP, TIFF, PPM, WEBP) whose header claims
    width x height: what a decompression bomb's header says. The size fields are patched in place."""
    import struct

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    b = bytearray(buf.getvalue())
    if fmt == "PNG":
        i = b.index(b"IHDR")
        b[i + 4 : i + 12] = struct.pack(">II", width, height)
        b[i + 17 : i + 21] = struct.pack(">I", zlib.crc32(bytes(b[i : i + 17])))
    elif fmt == "JPEG":
        i = b.index(b"\xff\xc0")  # SOF0: length, precision, height, width
        b[i + 5 : i + 9] = struct.pack(">HH", height, width)
    elif fmt == "GIF":
        b[6:10] = struct.pack("<HH", width, height)  # the logical screen
        i = b.index(b"\x2c")  # the image descriptor: left, top, width, height
        b[i + 5 : i + 9] = struct.pack("<HH", width, height)
    elif fmt == "BMP":
        b[18:26] = struct.pack("<ii", width, height)
    elif fmt == "PPM":
        b = bytearray(f"P6\n{width} {height}\n255\n".encode()) + b"\0" * 64
    elif fmt == "TIFF":
        (ifd,) = struct.unpack("<I", b[4:8])
        (n,) = struct.unpack("<H", b[ifd : ifd + 2])
        for k in range(n):
            e = ifd + 2 + 12 * k
            tag, kind = struct.unpack("<HH", b[e : e + 4])
            if tag in (256, 257):  # ImageWidth, ImageLength (SHORT or LONG)
                v = width if tag == 256 else height
                b[e + 8 : e + 12] = struct.pack("<I", v) if kind == 4 else struct.pack("<HH", v, 0)
    elif fmt == "WEBP":  # VP8L (lossless): after its signature byte, 14 bits each of width - 1, height - 1
        bits = int.from_bytes(b[21:25], "little") & ~((1 << 28) - 1)
        b[21:25] = (bits | (width - 1) | (height - 1) << 14).to_bytes(4, "little")
    else:
        raise ValueError(fmt)
    return bytes(b)


def exchange(port: int, data: bytes, timeout: float = 10.0, rcvbuf: int | None = None) -> tuple[bytes, float]:
    """Send `data` on a fresh connection, then read until the server closes it (or `timeout`):
    (what came back, seconds from the send to the close)."""
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port))
    t0, got = time.monotonic(), b""
    try:
        s.sendall(data)
        while chunk := s.recv(65536):
            got += chunk
    except (TimeoutError, ConnectionError, OSError):
        pass
    finally:
        s.close()
    return got, time.monotonic() - t0


def big_head(port: int, nbytes: int, timeout: float = 10.0) -> tuple[bytes, float]:
    """A request head with one header of `nbytes` bytes, sent in 16 KiB pieces and never ended:
    (the server's first bytes, seconds until it closed the connection)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    t0, got = time.monotonic(), b""
    try:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        for k in range(0, nbytes, 16384):
            s.sendall(b"a" * min(16384, nbytes - k))
        while chunk := s.recv(4096):
            got += chunk
    except (TimeoutError, ConnectionError, OSError):
        pass
    finally:
        s.close()
    return got[:64], time.monotonic() - t0


def http_request(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    """One HTTP/1.1 request's bytes (keep-alive), for pipelining and raw sockets."""
    h = {"Host": "127.0.0.1", **({"Content-Type": "application/json"} if body else {}), **(headers or {})}
    if body or method == "POST":
        h["Content-Length"] = str(len(body))
    return (
        f"{method} {path} HTTP/1.1\r\n".encode()
        + "".join(f"{k}: {v}\r\n" for k, v in h.items()).encode()
        + (b"\r\n" + body)
    )


class NonReaders:
    """`n` connections that each send `request` and never read the answer (a receive buffer of 4 KiB:
    what the server cannot hand the kernel stays in its own memory). `close()` ends them."""

    def __init__(self, port: int, request: bytes, n: int):
        self.socks = []
        for _ in range(n):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(request)
            self.socks.append(s)

    def __enter__(self) -> NonReaders:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for s in self.socks:
            s.close()


# ---- the edge cases' clients (the hostile suite) ------------------------------------------------
class Prober:
    """A real client on a thread: a fresh 112x112 JPEG once a second on a fresh connection (30 s
    timeout), its (status, seconds) recorded; `stop()` -> a summary."""

    def __init__(self, url: str, seed: int):
        self.url, self.seed, self.results, self._stop = url, seed, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import httpx

        from benchmarks.workloads import traffic

        k = 0
        while not self._stop.is_set():
            body = traffic.body([traffic.jpeg(112, 112, seed=self.seed * 1000 + k)])
            k += 1
            t0 = time.monotonic()
            try:
                status = httpx.post(self.url + traffic.ROUTE, content=body, timeout=30).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            self.results.append((status, time.monotonic() - t0))
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - t0)))

    def stop(self) -> dict:
        from benchmarks.workloads import traffic

        self._stop.set()
        self._thread.join(60)
        ok = sorted(t for s, t in self.results if s == 200)
        statuses = {str(s): sum(1 for x, _ in self.results if x == s) for s in {s for s, _ in self.results}}
        return {"statuses": statuses, "median_s": traffic.percentile(ok, 50), "max_s": max(ok) if ok else None}


def flood_heads(port: int, n: int, seconds: float) -> dict:
    """`n` connections each streaming one request header as fast as they can for `seconds` (a
    connection the server closes is reopened): bytes sent, the server's answers' first bytes."""
    import socket

    stop, sent, answers = time.monotonic() + seconds, [0] * n, {}

    def one(i: int) -> None:
        while time.monotonic() < stop:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=2)
            except OSError:
                time.sleep(0.1)
                continue
            try:
                s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
                while time.monotonic() < stop:
                    sent[i] += s.send(b"a" * 65536)
            except OSError:
                pass
            try:
                s.settimeout(0.5)
                first = s.recv(16)[:12].decode("latin-1") or "closed"
            except OSError:
                first = "reset"
            answers[first] = answers.get(first, 0) + 1
            s.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return {"sent_mb": sum(sent) / 1e6, "answers": answers}


def non_readers(port: int, n: int, seconds: float) -> dict:
    """`n` clients asking for 64 identical 1792x1792 images in float JSON and never reading: for
    `seconds` or until the server has closed them all. -> when each was closed."""
    import io
    import socket

    import numpy as np
    from PIL import Image

    from benchmarks.workloads import traffic

    y, x = np.mgrid[0:1792, 0:1792]
    im = np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(im).save(buf, "PNG")
    request = http_request("POST", traffic.ROUTE, traffic.body([buf.getvalue()] * 64))
    t0 = time.monotonic()
    with NonReaders(port, request, n) as clients:
        closed = {}
        while len(closed) < n and time.monotonic() - t0 < seconds:
            for i, s in enumerate(clients.socks):
                # the kernel's TCP state (tcp_info's first byte): 1 established; a reset (7) or the
                # server's end of the stream (8) is the server's close, whatever is left unread
                if i not in closed and s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != 1:
                    closed[i] = time.monotonic() - t0
            time.sleep(0.25)
    return {"closed_after_s": sorted(closed.values()), "body_mb": len(request) / 1e6}


def huge_user(url: str) -> dict:
    """A body whose "user" holds 10 million empty lists (30 MB): its status and seconds."""
    import httpx

    from benchmarks.workloads import traffic

    body = traffic.body([traffic.jpeg(56, 56, seed=5)])[:-1] + b', "user": [' + b"[]," * 9_999_999 + b"[]]}"
    t0 = time.monotonic()
    try:
        status = httpx.post(url + traffic.ROUTE, content=body, timeout=120).status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return {"status": status, "seconds": time.monotonic() - t0, "body_mb": len(body) / 1e6}


def stalled_bodies(port: int, n: int, seconds: float) -> dict:
    """`n` bodies stalled after 16 bytes from 127.0.0.2, kept at n for `seconds`: the first bytes
    the server answered them with."""
    groups = [Sockets(port, stalled=n, source="127.0.0.2")]
    t0, reopened = time.monotonic(), 0
    try:
        while time.monotonic() - t0 < seconds:
            gone = sum(len(g.closed) for g in groups)
            if gone > reopened:
                groups.append(Sockets(port, stalled=gone - reopened, source="127.0.0.2"))
                reopened = gone
            time.sleep(0.1)
    finally:
        for g in groups:
            g.close()
    answers: dict = {}
    for g in groups:
        for _, first in g.closed.values():
            key = first[:12].decode("latin-1") or "closed"
            answers[key] = answers.get(key, 0) + 1
    return {"answers": answers, "reopened": reopened}
