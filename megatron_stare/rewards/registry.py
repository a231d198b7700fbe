"""Reward functions: the registry, dotted-path lookup, and the per-call deadline.

A reward function scores one response::

    fn(response_text: str, answer: str, metadata: dict) -> float

``metadata`` holds the dataset row's other keys. A reward object may also define ``warmup()``
(heavy imports), which ``RewardPool`` calls once per process before any timed call. Register built-ins with
``@register_reward("name")``; ``get_reward_fn`` also accepts a user function by dotted path
(``'pkg.module:function'`` or ``'pkg.module.function'``), so ``reward.fn`` in the config can
name either. Every lookup problem is one ``RewardError`` line, e.g.::

    reward.fn: cannot import 'foo.bar:baz' (No module named 'foo')
"""

from __future__ import annotations

import importlib
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Dict, Iterator

RewardFn = Callable[[str, str, dict], float]

#: name -> reward function; filled by ``@register_reward``.
REWARDS: Dict[str, RewardFn] = {}


class RewardError(ValueError):
    """A reward problem (bad ``reward.fn``, a reward function that raised); one line."""


class RewardTimeout(BaseException):
    """Raised inside a reward call when its ``deadline`` expires.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that verifier code catching
    ``Exception`` (math-verify and sympy do, widely) cannot swallow it.
    """


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator (for a function or a callable instance) adding it to ``REWARDS`` as ``name``."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} registered twice")
        REWARDS[name] = fn
        return fn

    return deco


def get_reward_fn(spec: str) -> RewardFn:
    """The registered reward ``spec``, or the callable at dotted path ``spec``.

    ``'pkg.mod:attr'`` imports ``pkg.mod`` and takes ``attr`` (which may itself be dotted);
    ``'pkg.mod.attr'`` splits at the last dot. Raises ``RewardError`` (one line) when the
    module cannot be imported, lacks the attribute, or the attribute is not callable.
    """
    import megatron_stare.rewards  # noqa: F401  (registers the built-ins)

    if spec in REWARDS:
        return REWARDS[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    elif "." in spec:
        module_name, _, attr = spec.rpartition(".")
    else:
        raise RewardError(f"reward.fn: unknown reward {spec!r}; registered: {', '.join(sorted(REWARDS))}; "
                          f"or give a function as 'pkg.module:function'")
    if not module_name or not attr:
        raise RewardError(f"reward.fn: {spec!r} is not of the form 'pkg.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # any failure while importing user code is the user's to fix
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RewardError(f"reward.fn: cannot import {spec!r} ({msg})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(f"reward.fn: cannot import {spec!r} "
                              f"({getattr(obj, '__name__', type(obj).__name__)!s} has no attribute {part!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(f"reward.fn: {spec!r} is not callable (it is a {type(obj).__name__})")
    return obj


# ------------------------------------------------------------------------------------------------
# The deadline: a wall-clock limit on one reward call, in the calling (main) thread.
def _on_deadline(signum, frame):
    raise RewardTimeout("reward call exceeded its deadline")


def deadline_supported() -> bool:
    """Whether ``deadline`` can interrupt the current thread (signals reach the main thread only)."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def deadline(seconds: float) -> Iterator[bool]:
    """Raise ``RewardTimeout`` inside the block after ``seconds`` of wall time.

    Yields whether this call armed the timer (False: nested, unsupported thread), so a callee
    can tell its own timeout from an outer one it must let through.

    ``ITIMER_REAL``/``SIGALRM`` based, so it only works in the main thread; elsewhere (and on
    platforms without ``setitimer``) the block runs without a limit. Nested deadlines: while
    one of ours is armed, an inner ``deadline`` is a no-op (the outermost governs). Python
    code is interrupted between bytecodes; one long C call (e.g. a huge integer power) is not,
    which is why ``RewardPool`` workers also have a hard kill from the parent.
    """
    if not deadline_supported() or signal.getsignal(signal.SIGALRM) is _on_deadline:
        yield False
        return
    old_handler = signal.signal(signal.SIGALRM, _on_deadline)
    signal.setitimer(signal.ITIMER_REAL, max(float(seconds), 1e-3))
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
