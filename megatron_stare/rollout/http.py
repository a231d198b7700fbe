"""The one HTTP call of the server engines: JSON in, JSON out, failures named.

A reply with an error status raises ``RuntimeError`` naming the server and the path with the
reply's body; a failure of the transport itself (connection refused or reset, a timeout)
raises what the engine's ``failure(path, err)`` makes of it (an ``EngineFailure`` line that
says whether the server died or stopped answering).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, Callable, Optional

__all__ = ["TRANSPORT_ERRORS", "EngineFailure", "request_json"]

#: Transport-level failures of an HTTP call (``HTTPError``, a reply, is handled apart).
TRANSPORT_ERRORS = (urllib.error.URLError, http.client.HTTPException, OSError)


class EngineFailure(RuntimeError):
    """A rollout server died or stopped answering; the first line names it."""


def request_json(url: str, body: Optional[dict], *, method: str, timeout: float, server: str,
                 failure: Callable[[str, BaseException], Exception]) -> Any:
    """``method`` ``url`` with ``body`` as JSON (None: no body); the decoded reply (None if empty)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    path = urllib.request.urlparse(url).path
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{server} {path} failed ({e.code}): "
                           f"{e.read().decode(errors='replace')[:2000]}") from None
    except TRANSPORT_ERRORS as e:
        raise failure(path, e) from None
    return json.loads(raw) if raw else None
