"""What a hostile client does to `qwen-vit-jax serve` on 127.0.0.1: sockets that never send a request
head (silent, or trickling one byte at a time: slowloris), bodies that stall, a 49-megapixel image.

Shared by tests/test_serve_hostile.py (small scale) and the hostile suite (measured).
Every socket is bounded in count and time and goes to 127.0.0.1.
"""

from __future__ import annotations

import io
import selectors
import socket
import threading
import time

# A request head that never ends: one more header byte at a time (slowloris).
SLOW_HEAD = b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


class Sockets:
    """`silent` sockets that connect and send nothing, `slow` ones that trickle a request head (one
    byte every `every` s, never the end of it), and `stalled` ones that send a whole head announcing a
    body of `body_bytes` (with `headers`), 16 bytes of it, then nothing. A thread watches them all:
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
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
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
