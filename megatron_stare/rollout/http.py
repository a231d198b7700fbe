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
import socket
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Set

__all__ = ["TRANSPORT_ERRORS", "EngineFailure", "ErrorReply", "InFlight", "request_json"]

#: Transport-level failures of an HTTP call (``HTTPError``, a reply, is handled apart).
TRANSPORT_ERRORS = (urllib.error.URLError, http.client.HTTPException, OSError)


class EngineFailure(RuntimeError):
    """A rollout server died, stopped answering or answered with an error; the first line names it."""


class ErrorReply(Exception):
    """A reply with an error status; ``str()`` is ``HTTP <status>: <body>``."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


class InFlight:
    """The HTTP calls in flight to one server, so that a watchdog can cut them: a hung server
    (stopped, or an engine that makes no progress) keeps its sockets open and answers nothing,
    and a blocked read has no other way out than its socket timeout, which a long generation
    cannot have. ``cut()`` shuts their sockets down; each call then fails at once
    (``RemoteDisconnected``), as if the server had closed them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conns: Set[http.client.HTTPConnection] = set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._conns)

    @contextmanager
    def track(self, conn: http.client.HTTPConnection) -> Iterator[None]:
        with self._lock:
            self._conns.add(conn)
        try:
            yield
        finally:
            with self._lock:
                self._conns.discard(conn)

    def cut(self) -> int:
        """Shut down the socket of every call in flight; returns how many."""
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                if c.sock is not None:
                    c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(conns)


def _tracked(url: str, data: Optional[bytes], method: str, timeout: Optional[float], in_flight: InFlight,
             path: str, failure: Callable[[str, BaseException], Exception]) -> bytes:
    """``request_json``'s call over a connection ``in_flight`` holds (so a watchdog can cut it)."""
    u = urllib.request.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    target = u.path + (f"?{u.query}" if u.query else "")
    try:
        with in_flight.track(conn):
            conn.request(method, target, body=data, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read()
        if r.status >= 400:
            raise failure(path, ErrorReply(r.status, " ".join(raw.decode(errors="replace").split())[:2000]))
        return raw
    except TRANSPORT_ERRORS as e:
        raise failure(path, e) from None
    finally:
        conn.close()


def request_json(url: str, body: Optional[dict], *, method: str, timeout: Optional[float], server: str,
                 failure: Callable[[str, BaseException], Exception], text: bool = False,
                 in_flight: Optional[InFlight] = None) -> Any:
    """``method`` ``url`` with ``body`` as JSON (None: no body); the decoded reply (None if empty),
    or with ``text`` the reply as text (a route that answers in plain text, e.g. SGLang's
    ``/flush_cache``: decoding it as JSON would fail on a good reply). ``timeout``: per socket
    operation (None: none; a call that ``in_flight`` holds is bounded by whoever cuts it)."""
    data = None if body is None else json.dumps(body).encode()
    path = urllib.request.urlparse(url).path
    if in_flight is not None:
        raw = _tracked(url, data, method, timeout, in_flight, path, failure)
        return raw.decode(errors="replace") if text else (json.loads(raw) if raw else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
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
