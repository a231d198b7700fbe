"""``get_env_class`` / ``make_env``: an environment by registered name or dotted path.

This module sits above the built-in environments: importing them here registers them.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Type

from megatron_stare.config.dotted import resolve
from megatron_stare.envs import calculator  # noqa: F401 - register the built-ins
from megatron_stare.envs.base import ENVIRONMENTS, EnvError, Environment

__all__ = ["get_env_class", "make_env"]


def get_env_class(spec: str) -> Type[Environment]:
    """The registered environment ``spec``, or the class at dotted path ``spec`` (``EnvError``)."""
    return resolve(spec, ENVIRONMENTS, field="rollout.multi_turn.env", noun="environment", kind="class",
                   error=EnvError)


def make_env(spec: str, tokenizer: Any = None, options: Optional[Mapping[str, Any]] = None) -> Environment:
    """A fresh environment: ``get_env_class(spec)(tokenizer, **options)``."""
    cls = get_env_class(spec)
    try:
        env = cls(tokenizer, **dict(options or {}))
    except TypeError as e:  # an option the class does not take
        raise EnvError(f"rollout.multi_turn.env_options: {spec!r} rejects them ({e})") from None
    if not isinstance(env, Environment):
        raise EnvError(f"rollout.multi_turn.env: {spec!r} built a {type(env).__name__}, not an Environment")
    return env
