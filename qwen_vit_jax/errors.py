"""What went wrong, as types. A library raises the kind of failure where it is known; each edge
maps the kind once: the service to an HTTP status, a metric label and a body, the command line to
an exit status and a message in its own flag names.

  BadInput      the input is malformed: undecodable bytes, a wrong field, a grid that is no grid
  TooLarge      the input is well formed but over a bound (`limit` names the bound)
  Unsupported   a format or container refused on purpose (`what` names it)
  Overloaded    busy now; the same request may succeed later (`retry_after` seconds)
  Unavailable   not ready, shutting down, a worker gone
  Internal      the server's own failure (a bad checkpoint, a device error): never the caller's fault

BadInput, TooLarge and Unsupported are ValueErrors (what callers caught before these types);
Overloaded, Unavailable and Internal are RuntimeErrors.
"""

from __future__ import annotations

import copy
from typing import ClassVar


class Error(Exception):
    """The base of the kinds below. `message` is safe to show a client: it never holds a server
    path or a Python repr. `limit`: the keyword of the bound or setting the failure is about
    ("max_frames", "max_pixels", ...), which an edge spells as its own flag or field."""

    kind: ClassVar[str] = "internal"

    def __init__(self, message: str, *, limit: str | None = None):
        super().__init__(message)
        self.message, self.limit = message, limit

    def at(self, where: str) -> Error:
        """This error, its kind and fields kept, its message naming where it happened
        (`e.at("input[3]")`: "input[3]: ..."), as an edge reports an item of a request."""
        out = copy.copy(self)
        out.message = f"{where}: {self.message}"
        out.args = (out.message,)
        return out


class BadInput(Error, ValueError):
    kind = "bad_input"


class TooLarge(Error, ValueError):
    kind = "too_large"


class Unsupported(Error, ValueError):
    """`what`: the refused format's name ("concat", "ico"), when known."""

    kind = "unsupported"

    def __init__(self, message: str, *, what: str | None = None, limit: str | None = None):
        super().__init__(message, limit=limit)
        self.what = what


class Overloaded(Error, RuntimeError):
    kind = "overloaded"

    def __init__(self, message: str, *, retry_after: int = 1, limit: str | None = None):
        super().__init__(message, limit=limit)
        self.retry_after = retry_after


class Unavailable(Error, RuntimeError):
    kind = "unavailable"


class Internal(Error, RuntimeError):
    kind = "internal"


KINDS = (BadInput, TooLarge, Unsupported, Overloaded, Unavailable, Internal)
