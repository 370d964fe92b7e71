"""What the service answers when it does not answer embeddings: the one place of serve/ that turns a
failure (`qwen_vit_jax.errors`' kinds, and the few that only HTTP has) into an HTTP status, a
metric label and a body. Everything else raises the kind and lets this module choose.

    try:
        ...
    except errors.Error as e:
        status, headers, body = parts(e)     # 413, {...}, b'{"error": {...}}'
        metrics.items.labels(label(e)).inc()

| kind          | status | type                   | label        | raised where                                  |
|---------------|--------|------------------------|--------------|-----------------------------------------------|
| BadInput      | 400    | invalid_request_error  | bad_input    | a body or an item that is not the schema       |
| Unauthorized  | 401    | authentication_error   | unauthorized | no or a wrong bearer token                     |
| TooLarge      | 413    | request_too_large      | too_large    | a body, an item count, an image over a bound   |
| Unsupported   | 415    | unsupported_media_type | unsupported  | an image format off the allow-list             |
| Overloaded    | 429    | rate_limit_error       | busy         | the queue full, a peer's body slots taken      |
| ClientGone    | 499    | client_closed_request  | cancelled    | the client left before its answer              |
| Internal      | 500    | server_error           | error        | the server's own failure (checkpoint, device)  |
| Unavailable   | 503    | unavailable            | unavailable  | loading, a worker died, every slot holds a request |
| TimedOut      | 504    | timeout                | timeout      | not answered within --timeout                  |

and the answers the connection protocol writes itself, before or instead of the app (connections.py):
408 (a request head or a body past its deadline), 431 (a request head over --max-head-kb) and the
raw 503 of an evicted socket. 429 and 503 carry Retry-After; 401 WWW-Authenticate.
"""

from __future__ import annotations

import dataclasses
import json
import re

from qwen_vit_jax import errors


class Unauthorized(errors.Error):
    kind = "unauthorized"


class ClientGone(errors.Error):
    kind = "cancelled"


class TimedOut(errors.Error):
    kind = "timeout"


@dataclasses.dataclass(frozen=True)
class Status:
    code: int
    type: str  # the error body's "type" (OpenAI's names where it has one)
    label: str  # qvj_items_total's status label


_BY_KIND = {
    errors.BadInput: Status(400, "invalid_request_error", "bad_input"),
    Unauthorized: Status(401, "authentication_error", "unauthorized"),
    errors.TooLarge: Status(413, "request_too_large", "too_large"),
    errors.Unsupported: Status(415, "unsupported_media_type", "unsupported"),
    errors.Overloaded: Status(429, "rate_limit_error", "busy"),
    ClientGone: Status(499, "client_closed_request", "cancelled"),
    errors.Internal: Status(500, "server_error", "error"),
    errors.Unavailable: Status(503, "unavailable", "unavailable"),
    TimedOut: Status(504, "timeout", "timeout"),
}
RETRY = (429, 503)  # the statuses a client may send the same request again after (client.py)
OK = 200


def status(e: BaseException) -> Status:
    """The status of a failure: its kind's; anything that is not one of the kinds is Internal."""
    for kind in type(e).__mro__:
        if kind in _BY_KIND:
            return _BY_KIND[kind]
    return _BY_KIND[errors.Internal]


def label(e: BaseException) -> str:
    return status(e).label


def parts(e: BaseException) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, JSON body) of the answer to `e`: {"error": {"message", "type", "code"}}, the
    message without server paths or Python reprs; an error that is not one of the kinds says only
    that it is internal (its details belong in the server's log)."""
    s = status(e)
    message = e.message if isinstance(e, errors.Error) else "an internal error (logged by the server)"
    headers = {}
    if s.code in RETRY:
        headers["Retry-After"] = str(getattr(e, "retry_after", 1))
    if s.code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = {"error": {"message": public(message), "type": s.type, "code": s.code}}
    return s.code, headers, json.dumps(body).encode()


# ---- the protocol's own answers (connections.py writes them to the socket) ----------------------
def _raw(code: int, reason: str, retry_after: int | None = None) -> bytes:
    extra = f"retry-after: {retry_after}\r\n" if retry_after is not None else ""
    return (
        f"HTTP/1.1 {code} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(reason)}\r\n"
        f"connection: close\r\n{extra}\r\n{reason}"
    ).encode("ascii")


REQUEST_TIMEOUT = _raw(408, "Request Timeout")  # a head or a body past its deadline
HEAD_TOO_LARGE = _raw(431, "Request Header Fields Too Large")  # a head over --max-head-kb
EVICTED = _raw(503, "Service Unavailable", retry_after=1)  # a socket without a head, its slot given up
OVER_LIMIT = errors.Unavailable("too many connections; retry later")  # every slot holds a request
PEER_BODIES = errors.Overloaded("too many request bodies in flight from this address; retry later")


# ---- what a stranger may see ------------------------------------------------------------------
_REPR = re.compile(r"<[^<>\n]* at 0x[0-9a-fA-F]+>")  # <_io.BytesIO object at 0x7f...>
_PATH = re.compile(r"(?<![\w./~-])/(?:[^\s/'\"()<>,;]+/)+([^\s/'\"()<>,;]*)")  # /abs/dir/name -> name


def public(message: str) -> str:
    """`message` without Python object reprs (-> "an object") and absolute paths (-> their last part)."""
    return _PATH.sub(lambda m: m[1] or "a folder", _REPR.sub("an object", message))
