"""``get_reward_fn``: a registered reward by name, or a user function by dotted path.

``reward.fn`` in the config names either a built-in (``math``, ``exact_match``), a reward an
installed package registers in the entry-point group ``megatron_stare.rewards`` (the study's
``pick_sum``, ``sum_steps``, ``hop_path``: ``setup.py``), or ``'pkg.module:function'`` /
``'pkg.module.function'``. Every lookup problem is one
``RewardError`` line, e.g.::

    reward.fn: cannot import 'foo.bar:baz' (No module named 'foo')

This module sits above the built-in rewards: importing them here registers them.
"""

from __future__ import annotations

from megatron_stare.config.dotted import resolve, with_plugins
from megatron_stare.rewards import math_verify_reward, synthetic  # noqa: F401 - register the built-ins
from megatron_stare.rewards.registry import REWARD_PLUGINS, REWARDS, RewardError, RewardFn


def get_reward_fn(spec: str) -> RewardFn:
    """The registered reward ``spec``, or the callable at dotted path ``spec``.

    ``'pkg.mod:attr'`` imports ``pkg.mod`` and takes ``attr`` (which may itself be dotted);
    ``'pkg.mod.attr'`` splits at the last dot. Raises ``RewardError`` (one line) when the
    module cannot be imported, lacks the attribute, or the attribute is not callable.
    """
    return resolve(spec, with_plugins(REWARDS, REWARD_PLUGINS), field="reward.fn", noun="reward", kind="function", error=RewardError)
