"""The one HTTP call of the server engines: JSON in, JSON out, failures named.

Every failure raises what the engine's ``failure(path, err)`` makes of it: an ``EngineFailure``
whose first line names the server (pid, URL) and what happened, followed by the tail of its log.
``err`` is the transport's own error (connection refused or reset, a closed socket, a timeout)
or, for a reply with an error status (a 5xx from a dead engine core), an ``ErrorReply`` holding
the status and the reply's body.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, Callable, Optional

__all__ = ["TRANSPORT_ERRORS", "EngineFailure", "ErrorReply", "request_json"]

#: Transport-level failures of an HTTP call (``HTTPError``, a reply, is handled apart).
TRANSPORT_ERRORS = (urllib.error.URLError, http.client.HTTPException, OSError)


class EngineFailure(RuntimeError):
    """A rollout server died, stopped answering or answered with an error; the first line names it."""


class ErrorReply(Exception):
    """A reply with an error status; ``str()`` is ``HTTP <status>: <body>``."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


def request_json(url: str, body: Optional[dict], *, method: str, timeout: float, server: str,
                 failure: Callable[[str, BaseException], Exception], text: bool = False) -> Any:
    """``method`` ``url`` with ``body`` as JSON (None: no body); the decoded reply (None if empty),
    or with ``text`` the reply as text (a route that answers in plain text, e.g. SGLang's
    ``/flush_cache``: decoding it as JSON would fail on a good reply)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    path = urllib.request.urlparse(url).path
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        body = " ".join(e.read().decode(errors="replace").split())[:2000]  # one line
        raise failure(path, ErrorReply(e.code, body)) from None
    except TRANSPORT_ERRORS as e:
        raise failure(path, e) from None
    if text:
        return raw.decode(errors="replace")
    return json.loads(raw) if raw else None
