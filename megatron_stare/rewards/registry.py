"""Reward functions: the registry and the per-call deadline.

The contract (``rewards/contract.py`` implements it): a reward function scores one response,
called with verl's keywords when its parameters are named so::

    compute_score(data_source, solution_str, ground_truth, extra_info) -> float | bool | dict

(those of the four it takes; other parameters need defaults; ``**kwargs`` gets all four), else
positionally, as the built-ins (``exact_match``, ``math``) are::

    fn(response_text: str, answer: str, metadata: dict) -> float | bool | dict

``metadata`` holds the dataset row's other keys (``data_source``, ``extra_info``, ...). A dict
return needs a ``"score"``; its other numbers are logged as ``reward/<key>`` means. A function
neither call fits is refused at start, naming ``reward.fn``; ``reward.by_source`` picks a
reward per row ``data_source``. A reward object may also define ``warmup()``
(heavy imports), which ``RewardPool`` calls once per process before any timed call. Register
built-ins with ``@register_reward("name")``; ``rewards.lookup.get_reward_fn`` resolves a
registered name or a dotted path. This module is the bottom of the package: the built-in
rewards import it, and it imports none of them.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Dict, Iterator

from megatron_stare.errors import UserError
from megatron_stare.config.dotted import registrar

RewardFn = Callable[[str, str, dict], float]

#: name -> reward function; filled by ``@register_reward``.
REWARDS: Dict[str, RewardFn] = {}
#: The entry-point group through which an installed package registers rewards by name
#: (``setup.py``: ``entry_points={"megatron_stare.rewards": ["name = pkg.module:function"]}``).
REWARD_PLUGINS = "megatron_stare.rewards"


class RewardError(UserError):
    """A reward problem (bad ``reward.fn``, a reward function that raised); one line."""


class RewardTimeout(BaseException):
    """Raised inside a reward call when its ``deadline`` expires.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that verifier code catching
    ``Exception`` (math-verify and sympy do, widely) cannot swallow it.
    """


#: Decorator (for a function or a callable instance) adding it to ``REWARDS`` as ``name``.
register_reward = registrar(REWARDS, "reward")


# ------------------------------------------------------------------------------------------------
# The deadline: a wall-clock limit on one reward call, in the calling (main) thread.
#: seconds between re-fires once a deadline has expired (see ``_on_deadline``).
_REFIRE_S = 0.05


class _Armed:
    """Whether one of our deadlines is armed; the handler reads it (set and cleared in ``deadline``)."""
    on = False


def _on_deadline(signum, frame):
    if not _Armed.on:  # fired between the block's end and the timer's reset: nothing to interrupt
        return
    # Re-fire until the block ends: a raise that lands inside a ``__del__`` or a weakref callback is
    # printed and dropped by the interpreter ("Exception ignored in ..."), which would lose the deadline.
    signal.setitimer(signal.ITIMER_REAL, _REFIRE_S)
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
    which is why ``RewardPool`` workers also have a hard kill from the parent. An expired
    deadline re-fires every ``_REFIRE_S`` until the block ends, so a raise the interpreter drops
    (one landing in a ``__del__`` or a weakref callback during garbage collection) is not lost.
    """
    if not deadline_supported() or signal.getsignal(signal.SIGALRM) is _on_deadline:
        yield False
        return
    old_handler = signal.signal(signal.SIGALRM, _on_deadline)
    _Armed.on = True
    signal.setitimer(signal.ITIMER_REAL, max(float(seconds), 1e-3))
    try:
        yield True
    finally:
        _Armed.on = False  # first: a fire from here on returns without raising or re-arming
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
