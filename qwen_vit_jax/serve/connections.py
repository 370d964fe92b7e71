"""Connections from strangers: request-head and body deadlines, bounded heads, a connection limit
that idle sockets cannot fill, bounded body slots per client address, and answers a client must
read. `uvicorn_config(app, settings)` is the uvicorn.Config `qwen-vit-jax serve` runs.

    config = uvicorn_config(app, settings, log_level="warning")
    uvicorn.Server(config).run()

What a connection may hold, and for how long (S = settings.header_timeout_s):
  * its request head (request line and headers): complete within S of the connection's start (or
    of a kept-alive connection's next first byte), however slowly it trickles: else 408 and closed;
    and at most settings.max_head_bytes: 431 and closed as soon as the bytes received pass it, before
    the parser has buffered more (within one socket read of the bound);
  * its body: no pause longer than S while the server reads it, and all of it within
    settings.request_timeout_s of the head: else 408 and closed;
  * a body still arriving after its answer (a 401 / 413 / 429 sent before the body was read):
    closed S after the answer;
  * its answer: a client that reads nothing of it for S while the socket's buffer is full is cut off
    (the buffer dropped), so a client that does not read holds at most a buffer and one chunk of a
    streamed answer (answers.py), for S;
  * an idle kept-alive connection: settings.keep_alive_s (uvicorn's own timer), then closed, and a
    client that does not read its answer meanwhile is cut off (its buffered answer dropped). A
    request pipelined behind another is served, not dropped: the timer starts after the last answer.
At settings.max_connections, a connection that completes a request head takes the slot of the
oldest connection that has not (a fresh socket still silent or trickling, an idle kept-alive one),
which is closed with 503: sockets that never send a head cannot lock out a client that does. Past
that (every slot holds a request) the answer is 503 with Retry-After. One client address may have
at most settings.max_peer_bodies connections reading a request body at once; its next request with
a body gets 429 (Retry-After) and is closed, so slow bodies of one address cannot hold every slot.
`qvj_connections_closed_total{reason}` counts each: header_timeout, body_timeout, drain_timeout,
send_timeout, keep_alive, head_too_large, evicted, over_limit, peer_bodies.

Why by hand: uvicorn 0.55 has no request-head or body deadline (its keep-alive timer restarts on
every byte received; uvicorn issue #157 asks for `--timeout-request-start` since 2018), no bound on
a head's size (httptools buffers a header value however long it grows), ASGI middleware runs only
once a head is parsed, and h11's size limits bound bytes, not time. So this is a subclass of
uvicorn's httptools protocol that counts the bytes it is given before its parser sees them, hooks
the parser callbacks (llhttp's on_message_begin / on_headers_complete / on_body /
on_message_complete), its response hook and asyncio's write flow control; everything else is
uvicorn's. The status codes and bodies are statuses.py's.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import heapq
import logging
import socket
import struct

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from qwen_vit_jax.serve import statuses

log = logging.getLogger("qwen_vit_jax.serve")

# What a connection is doing: reading a request head, reading its body, serving it (no deadline),
# draining a body after its answer, idle between requests (kept alive), refused and dropping what
# still arrives (so that the client reads the refusal instead of a reset).
HEAD, BODY, SERVING, DRAIN, IDLE, LINGER = "head", "body", "serving", "drain", "idle", "linger"
_END_OF_HEAD = b"\r\n\r\n"
LINGER_BYTES = 1 << 20  # what a refused connection's client may still send before reading stops


def _asgi_error(e):
    """An ASGI app that answers `e` (statuses.py's status and body) and closes the connection."""

    async def app(scope, receive, send) -> None:
        code, headers, body = statuses.parts(e)
        pairs = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        pairs += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": code, "headers": [*pairs, (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


_over_limit = _asgi_error(statuses.OVER_LIMIT)  # every connection slot holds a request
_peer_bodies = _asgi_error(statuses.PEER_BODIES)  # this address reads max_peer_bodies bodies already


class Peers:
    """Connections reading a request body, per client address (shared by one server's protocols)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.bodies: collections.Counter[str] = collections.Counter()

    def take(self, address: str) -> bool:
        if self.bodies[address] >= self.limit:
            return False
        self.bodies[address] += 1
        return True

    def give(self, address: str) -> None:
        self.bodies[address] -= 1
        if self.bodies[address] <= 0:
            del self.bodies[address]


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and the limits of the module docstring.
    `header_timeout`, `body_timeout` in seconds; `max_head_bytes` per request head; `peers`: the
    server's Peers (body slots per address); `metrics`: the app's Metrics or None."""

    def __init__(
        self,
        *args,
        header_timeout: float,
        body_timeout: float,
        max_connections: int,
        max_head_bytes: int,
        peers: Peers,
        metrics=None,
        **kw,
    ):
        super().__init__(*args, **kw)
        self.limit_concurrency = None  # the limit is ours (below): uvicorn's 503 carries no Retry-After
        self._app = self.app
        self._header_timeout, self._body_timeout = header_timeout, body_timeout
        self._max_connections, self._max_head, self._peers, self._metrics = (
            max_connections,
            max_head_bytes,
            peers,
            metrics,
        )
        self._state, self._since = HEAD, 0.0  # since: when this state began (evictions go oldest first)
        # when the state's deadline falls (a body's moves with its bytes), and the latest a body may end
        self._due, self._body_due = 0.0, 0.0
        self._timer = self._stall = None
        self._head_bytes, self._tail = 0, b""  # of the head being read, and its last 3 bytes
        self._peer = None  # the address whose body slot this connection holds

    # ---- uvicorn's hooks -------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._enter(HEAD, self._header_timeout)
        self._gauge()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self._cancel()
        self._cancel_stall()
        self._release_body()
        self._gauge()

    def data_received(self, data: bytes) -> None:
        if self._state == LINGER:  # dropped; past LINGER_BYTES no more is read (the deadline closes it)
            self._head_bytes += len(data)
            if self._head_bytes > LINGER_BYTES:
                self.transport.pause_reading()
            return
        if self._state in (HEAD, IDLE, SERVING) and not self._head_fits(data):  # SERVING: a pipelined head
            self._refuse("head_too_large", statuses.HEAD_TOO_LARGE)
            return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._state != HEAD:  # a kept-alive connection's next request: its first byte starts the clock
            self._enter(HEAD, self._header_timeout)

    def on_headers_complete(self) -> None:
        self._enter(BODY, self._header_timeout)
        self._head_bytes, self._tail = 0, b""
        self._body_due = self._since + self._body_timeout
        if not self._admit():
            self.app, reason = _over_limit, "over_limit"
        elif self._has_body() and not self._take_body():
            self.app, reason = _peer_bodies, "peer_bodies"
        else:
            self.app, reason = self._app, None
        if reason is not None and self._metrics is not None:
            self._metrics.connections_closed.labels(reason).inc()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._state == BODY:
            self._due = self.loop.time() + self._header_timeout  # a pause counts from the last bytes

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._state == BODY:
            self._state = SERVING
            self._cancel()
            self._release_body()
        elif self._state == DRAIN:  # the rest of an answered request's body: idle now
            self._enter(IDLE, self.timeout_keep_alive)

    def on_response_complete(self) -> None:
        # `self.cycle` is the newest request's: when an earlier, pipelined one was answered, the
        # newest is still being read or served, and its state stands (no keep-alive timer yet)
        newest = self.cycle is None or self.cycle.response_complete
        super().on_response_complete()
        if not newest:
            return
        if self._state == BODY:  # answered before its body was read: the rest may arrive for S more
            self._release_body()
            self._enter(DRAIN, self._header_timeout)
        elif self._state == SERVING:
            self._enter(IDLE, self.timeout_keep_alive)

    def timeout_keep_alive_handler(self) -> None:
        self._close("keep_alive")

    def pause_writing(self) -> None:  # the socket's buffer is full: the client must read within S
        super().pause_writing()
        self._cancel_stall()
        self._stall = self.loop.call_later(self._header_timeout, self._close, "send_timeout")

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_stall()

    # ---- the head's size -------------------------------------------------------------------------
    def _head_fits(self, data: bytes) -> bool:
        """Whether the head being read stays within max_head_bytes with `data` (a read may carry the
        head's end and then its body: only the bytes up to the head's end count)."""
        start = self._head_bytes
        self._head_bytes += len(data)
        if self._head_bytes > self._max_head:
            window = (self._tail + data)[: self._max_head - start + len(self._tail)]
            if _END_OF_HEAD not in window:
                return False
        self._tail = (self._tail + data)[-3:]
        return True

    # ---- body slots per address ------------------------------------------------------------------
    def _has_body(self) -> bool:
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"0", b"")):
                return True
        return False

    def _take_body(self) -> bool:
        address = self.client[0] if self.client else ""
        if not self._peers.take(address):
            return False
        self._peer = address
        return True

    def _release_body(self) -> None:
        if self._peer is not None:
            self._peers.give(self._peer)
            self._peer = None

    # ---- deadlines -------------------------------------------------------------------------------
    def _enter(self, state: str, timeout: float) -> None:
        self._state, self._since = state, self.loop.time()
        self._due = self._since + timeout
        self._arm(self._due)

    def _arm(self, when: float) -> None:
        self._cancel()
        self._timer = self.loop.call_at(when, self._check)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cancel_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _check(self) -> None:
        """The deadline passed, or moved (body bytes arrived): close, or wait for the new one."""
        self._timer = None
        if self.transport.is_closing() or self._state in (SERVING, LINGER):
            return
        now, due = self.loop.time(), self._due
        if self._state == BODY:
            cycle = self.cycle
            if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
                self._due = now + self._header_timeout  # the server is not reading: not the client's pause
            due = min(self._due, self._body_due)
        if now < due:
            self._arm(due)
            return
        pending = self.cycle is not None and not self.cycle.response_complete
        if self._state == HEAD:  # a pipelined head may trail a request still being answered
            self._close("header_timeout", None if pending else statuses.REQUEST_TIMEOUT)
        elif self._state == BODY:
            answer = None if pending and self.cycle.response_started else statuses.REQUEST_TIMEOUT
            self._close("body_timeout", answer)
        else:
            self._close("drain_timeout" if self._state == DRAIN else "keep_alive")

    def _refuse(self, reason: str, answer: bytes) -> None:
        """Answer and close a connection whose client is still sending: the answer, then our end of
        the stream, then what still arrives is dropped (nginx's lingering close; LINGER_BYTES at
        most) for S at most. Closed at once, the socket would answer the client's next bytes with a
        reset that can destroy the answer before the client reads it."""
        self._cancel()
        self.transport.write(answer)
        if not self.transport.can_write_eof():
            self._close(reason)
            return
        self.transport.write_eof()
        self._state, self._since, self._head_bytes = LINGER, self.loop.time(), 0
        self._timer = self.loop.call_later(self._header_timeout, self._reset)
        if self._metrics is not None:
            self._metrics.connections_closed.labels(reason).inc()

    def _close(self, reason: str, answer: bytes | None = None) -> None:
        """Close with `answer` written first (if any). A client that has not read what is buffered
        for it is cut off, not waited for (asyncio's close() would wait for the buffer to drain)."""
        if self.transport.is_closing():
            return
        self._cancel()
        self._cancel_stall()
        if self._state == LINGER:  # refused and counted already: only its end
            self._reset()
            return
        if answer is not None:
            self.transport.write(answer)
        if self.transport.get_write_buffer_size():
            self._reset()
        else:
            self.transport.close()
        if self._metrics is not None:
            self._metrics.connections_closed.labels(reason).inc()
        log.debug("closed a connection from %s: %s", self.client, reason)

    def _reset(self) -> None:
        """Cut the connection off: what is buffered for it is dropped, ours and the kernel's (a
        linger of 0 makes the close a reset; a plain close would leave the kernel holding its send
        buffer, megabytes, for as long as a client that does not read keeps its window shut)."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    # ---- the connection limit --------------------------------------------------------------------
    def _admit(self) -> bool:
        """Whether this request may run; past max_connections, room is made first by closing the
        oldest connections that hold no request (this one excepted)."""
        over = len(self.connections) - self._max_connections
        if over > 0:
            idle = [c for c in self.connections if c is not self and isinstance(c, GuardedProtocol) and c._idle()]
            for c in heapq.nsmallest(over, idle, key=lambda c: c._since):
                c._close("evicted", statuses.EVICTED)
                self.connections.discard(c)  # now: uvicorn discards it once its socket is gone
        return len(self.connections) <= self._max_connections and len(self.tasks) < self._max_connections

    def _idle(self) -> bool:
        """Whether this connection holds no request: its head not complete, a body drained after its
        answer, or kept alive between requests."""
        return self._state in (HEAD, DRAIN, IDLE, LINGER) and (self.cycle is None or self.cycle.response_complete)

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.connections.set(len(self.connections))


def uvicorn_config(app, settings, **kw):
    """The uvicorn.Config serving `app` (create_app's) under `settings`: GuardedProtocol with its
    deadlines and limits, the keep-alive, the graceful-shutdown wait. `kw`: more
    uvicorn.Config arguments (log_level, ...)."""
    import uvicorn

    protocol = functools.partial(
        GuardedProtocol,
        header_timeout=settings.header_timeout_s,
        body_timeout=settings.request_timeout_s,
        max_connections=settings.max_connections,
        max_head_bytes=settings.max_head_bytes,
        peers=Peers(settings.max_peer_bodies),
        metrics=getattr(app.state, "metrics", None),
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=settings.request_timeout_s + 5,
        ws="none",  # no route takes a WebSocket
        server_header=False,
        **kw,
    )
