"""``get_reward_fn``: a registered reward by name, or a user function by dotted path.

``reward.fn`` in the config names either a built-in (``math``, ``exact_match``) or
``'pkg.module:function'`` / ``'pkg.module.function'``. Every lookup problem is one
``RewardError`` line, e.g.::

    reward.fn: cannot import 'foo.bar:baz' (No module named 'foo')

This module sits above the built-in rewards: importing them here registers them.
"""

from __future__ import annotations

import importlib

from megatron_stare.rewards import math_verify_reward, synthetic  # noqa: F401 - register the built-ins
from megatron_stare.rewards.registry import REWARDS, RewardError, RewardFn


def get_reward_fn(spec: str) -> RewardFn:
    """The registered reward ``spec``, or the callable at dotted path ``spec``.

    ``'pkg.mod:attr'`` imports ``pkg.mod`` and takes ``attr`` (which may itself be dotted);
    ``'pkg.mod.attr'`` splits at the last dot. Raises ``RewardError`` (one line) when the
    module cannot be imported, lacks the attribute, or the attribute is not callable.
    """
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
