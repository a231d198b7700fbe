"""``UserError``: the base of every error the project raises for a user to fix.

``train.main`` turns a ``UserError`` into one line (``error: ...``) and exit code 2; anything
else is a crash and keeps its traceback. The base exists so that the two cannot be confused: a
library's ``ValueError`` (a JSON decoder's, a tokenizer's, torch's) is not a user error, and
before this base every user error was a plain ``ValueError`` subclass, so ``except ValueError``
in ``train.py`` also swallowed those library errors as "user errors" - on the rank that hit them
only, with exit 2, while the other ranks waited in a collective.

A ``UserError`` is still a ``ValueError`` (callers that catch ``ValueError`` keep working); its
message is one line naming the cause and the fix. Raise it only where every rank that reaches
the check finds the same thing (a config value, a file every rank reads), or where a one-line
error on the one rank is what the user needs (a rendezvous problem of one node).
"""

from __future__ import annotations

import sys
from typing import Callable, Tuple, Type

__all__ = ["UserError", "print_or_error"]


class UserError(ValueError):
    """A problem the user fixes (a config value, a file, a server started with other flags);
    ``str()`` is one line naming the cause and the fix. Only this project raises it."""


def print_or_error(work: Callable[[], object], errors: Tuple[Type[Exception], ...] = (UserError,)) -> int:
    """A small command's ending: print ``work()``'s result (unless None) and return 0; one of
    ``errors`` is one ``error: ...`` line on stderr and exit status 2 (as ``train.main`` does)."""
    try:
        result = work()
        if result is not None:
            print(result)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

