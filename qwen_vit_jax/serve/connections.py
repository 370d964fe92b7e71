"""Connections from strangers: request-head and body deadlines, and a connection limit that idle
sockets cannot fill. `uvicorn_config(app, settings)` is the uvicorn.Config `qwen-vit-jax serve` runs.

    config = uvicorn_config(app, settings, log_level="warning")
    uvicorn.Server(config).run()

What a connection may hold, and for how long (S = settings.header_timeout_s):
  * its request head (request line and headers): complete within S of the connection's start (or
    of a kept-alive connection's next first byte), however slowly it trickles: else 408 and closed;
  * its body: no pause longer than S while the server reads it, and all of it within
    settings.request_timeout_s of the head: else 408 and closed;
  * a body still arriving after its answer (a 401 / 413 / 429 sent before the body was read):
    closed S after the answer;
  * an idle kept-alive connection: settings.keep_alive_s (uvicorn's own timer), then closed, and a
    client that does not read its answer meanwhile is cut off (its buffered answer dropped).
At settings.max_connections, a connection that completes a request head takes the slot of the
oldest connection that has not (a fresh socket still silent or trickling, an idle kept-alive one),
which is closed with 503: sockets that never send a head cannot lock out a client that does. Past
that (every slot holds a request) the answer is 503 with Retry-After.

Why by hand: uvicorn 0.55 has no request-head or body deadline (its keep-alive timer restarts on
every byte received; uvicorn issue #157 asks for `--timeout-request-start` since 2018), ASGI
middleware runs only once a head is parsed, and h11's size limits bound bytes, not time. So this
is a subclass of uvicorn's httptools protocol that hooks its parser callbacks (llhttp's
on_message_begin / on_headers_complete / on_body / on_message_complete) and its response hook;
everything else is uvicorn's.
"""

from __future__ import annotations

import functools
import heapq
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("qwen_vit_jax.serve")

# What a connection is doing: reading a request head, reading its body, serving it (no deadline),
# draining a body after its answer, idle between requests (kept alive).
HEAD, BODY, SERVING, DRAIN, IDLE = "head", "body", "serving", "drain", "idle"


def _raw_response(status: int, reason: str, retry_after: int | None = None) -> bytes:
    extra = f"retry-after: {retry_after}\r\n" if retry_after is not None else ""
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(reason)}\r\n"
        f"connection: close\r\n{extra}\r\n{reason}"
    ).encode("ascii")


REQUEST_TIMEOUT = _raw_response(408, "Request Timeout")
EVICTED = _raw_response(503, "Service Unavailable", retry_after=1)


async def _over_limit(scope, receive, send) -> None:
    """The answer when every connection slot holds a request: 503 with Retry-After."""
    body = b'{"error": {"message": "too many connections; retry later", "type": "unavailable", "code": 503}}'
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and the connection limit of the module
    docstring. `header_timeout`, `body_timeout` in seconds; `metrics`: the app's Metrics or None."""

    def __init__(self, *args, header_timeout: float, body_timeout: float, max_connections: int, metrics=None, **kw):
        super().__init__(*args, **kw)
        self.limit_concurrency = None  # the limit is ours (below): uvicorn's 503 carries no Retry-After
        self._app = self.app
        self._header_timeout, self._body_timeout = header_timeout, body_timeout
        self._max_connections, self._metrics = max_connections, metrics
        self._state, self._since = HEAD, 0.0  # since: when this state began (evictions go oldest first)
        # when the state's deadline falls (a body's moves with its bytes), and the latest a body may end
        self._due, self._body_due = 0.0, 0.0
        self._timer = None

    # ---- uvicorn's hooks -------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._enter(HEAD, self._header_timeout)
        self._gauge()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self._cancel()
        self._gauge()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._state != HEAD:  # a kept-alive connection's next request: its first byte starts the clock
            self._enter(HEAD, self._header_timeout)

    def on_headers_complete(self) -> None:
        self._enter(BODY, self._header_timeout)
        self._body_due = self._since + self._body_timeout
        admitted = self._admit()
        self.app = self._app if admitted else _over_limit
        if not admitted and self._metrics is not None:
            self._metrics.connections_closed.labels("over_limit").inc()
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
        elif self._state == DRAIN:  # the rest of an answered request's body: idle now
            self._enter(IDLE, self.timeout_keep_alive)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._state == BODY:  # answered before its body was read: the rest may arrive for S more
            self._enter(DRAIN, self._header_timeout)
        elif self._state == SERVING:
            self._enter(IDLE, self.timeout_keep_alive)

    def timeout_keep_alive_handler(self) -> None:
        self._close("keep_alive")

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

    def _check(self) -> None:
        """The deadline passed, or moved (body bytes arrived): close, or wait for the new one."""
        self._timer = None
        if self.transport.is_closing() or self._state == SERVING:
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
            self._close("header_timeout", None if pending else REQUEST_TIMEOUT)
        elif self._state == BODY:
            self._close("body_timeout", None if pending and self.cycle.response_started else REQUEST_TIMEOUT)
        else:
            self._close("drain_timeout" if self._state == DRAIN else "keep_alive")

    def _close(self, reason: str, answer: bytes | None = None) -> None:
        """Close with `answer` written first (if any). A client that has not read what is buffered
        for it is cut off, not waited for (asyncio's close() would wait for the buffer to drain)."""
        if self.transport.is_closing():
            return
        self._cancel()
        if answer is not None:
            self.transport.write(answer)
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()
        if reason != "keep_alive" and self._metrics is not None:
            self._metrics.connections_closed.labels(reason).inc()
        log.debug("closed a connection from %s: %s", self.client, reason)

    # ---- the connection limit --------------------------------------------------------------------
    def _admit(self) -> bool:
        """Whether this request may run; past max_connections, room is made first by closing the
        oldest connections that hold no request (this one excepted)."""
        over = len(self.connections) - self._max_connections
        if over > 0:
            idle = [c for c in self.connections if c is not self and isinstance(c, GuardedProtocol) and c._idle()]
            for c in heapq.nsmallest(over, idle, key=lambda c: c._since):
                c._close("evicted", EVICTED)
                self.connections.discard(c)  # now: uvicorn discards it once its socket is gone
        return len(self.connections) <= self._max_connections and len(self.tasks) < self._max_connections

    def _idle(self) -> bool:
        """Whether this connection holds no request: its head not complete, a body drained after its
        answer, or kept alive between requests."""
        return self._state in (HEAD, DRAIN, IDLE) and (self.cycle is None or self.cycle.response_complete)

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.connections.set(len(self.connections))


def uvicorn_config(app, settings, **kw):
    """The uvicorn.Config serving `app` (create_app's) under `settings`: GuardedProtocol with its
    deadlines and connection limit, the keep-alive, the graceful-shutdown wait. `kw`: more
    uvicorn.Config arguments (log_level, ...)."""
    import uvicorn

    protocol = functools.partial(
        GuardedProtocol,
        header_timeout=settings.header_timeout_s,
        body_timeout=settings.request_timeout_s,
        max_connections=settings.max_connections,
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
