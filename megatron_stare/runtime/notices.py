"""The one path by which a line for the person running the job leaves any layer.

The run's console (``trainer/console.py``) sits high in the package; the checkpoint loader,
the preemption handler and the preflight sit below it and cannot import it. They call
``say``: once the console is installed (``Console.install``, ``train.main``) the line goes
through it (printed, and kept in the run's ``console.log``); before that, and in a process with
no console, it is printed as is. The caller decides which ranks speak: ``say`` prints what it is
given.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

PREFIX = "[megatron-stare]"
"""What starts a notice line (``note``)."""

Sink = Callable[[str, bool], None]
_sink: Optional[Sink] = None


def set_sink(sink: Optional[Sink]) -> Optional[Sink]:
    """Route ``say`` through ``sink(line, err)`` (None: plain printing); returns the previous one."""
    global _sink
    previous, _sink = _sink, sink
    return previous


def say(line: str, err: bool = False) -> None:
    """One line a person reads: stdout, or stderr with ``err`` (warnings, errors)."""
    if _sink is not None:
        _sink(line, err)
    else:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)


def note(text: str, err: bool = False) -> None:
    """A notice: ``[megatron-stare] <text>``."""
    say(f"{PREFIX} {text}", err)
