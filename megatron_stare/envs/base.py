"""The environment interface of multi-turn rollouts, and its registry.

An environment plays the other side of a trajectory: after ``reset`` with the task, each
``step`` receives the model's turn as the token ids the engine sampled and answers with an
``EnvStep``: the observation as token ids (appended to the context as they are, trained with
loss mask 0), a reward and whether the trajectory is done. An environment may decode the turn to
parse a tool call, but what it returns are token ids: nothing is ever re-tokenized from text
(``rollout/multiturn.py``), so the trainer sees exactly the tokens the engine produced and the
environment returned.

Environments are registered by name (``@register_env``) or given by dotted path
(``rollout.multi_turn.env: 'pkg.module:MyEnv'``), like rewards; ``envs/lookup.py`` resolves
them and ``make_env(spec, tokenizer, options)`` builds one per trajectory.

Tool failures never stop a run: a tool that raises or runs out of time becomes an error
observation (``EnvStep.tool_error``) and the trajectory continues.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Type

from megatron_stare.errors import UserError
from megatron_stare.config.dotted import registrar


__all__ = ["ENVIRONMENTS", "EnvError", "EnvStep", "Environment", "register_env"]


class EnvError(UserError):
    """A bad ``rollout.multi_turn.env`` (unknown name, import failure); one line."""


@dataclass
class EnvStep:
    """The environment's answer to one model turn."""

    observation: List[int]
    """Token ids appended after the turn (loss mask 0); may be empty when ``done``."""
    reward: float = 0.0
    """The trajectory's reward so far; the last step's is the trajectory's reward."""
    done: bool = False
    tool_call: bool = False
    """The turn called a tool."""
    tool_error: bool = False
    """That call failed (raised, timed out or was malformed); ``observation`` says why."""

    def __post_init__(self):
        self.observation = [int(t) for t in self.observation]


class Environment(ABC):
    """One trajectory's environment. ``tokenizer`` encodes observations and may decode turns."""

    def __init__(self, tokenizer: Any = None, **options):
        if options:
            raise EnvError(f"rollout.multi_turn.env_options: {type(self).__name__} takes no option "
                           f"{', '.join(sorted(options))}")
        self.tokenizer = tokenizer

    def reset(self, prompt_token_ids: Sequence[int], answer: str = "", metadata: Optional[Mapping] = None) -> None:
        """Start a trajectory for this task (the prompt as the model sees it, its answer and the
        dataset row's other keys)."""
        self.prompt_token_ids, self.answer, self.metadata = list(prompt_token_ids), answer, dict(metadata or {})

    @abstractmethod
    def step(self, turn_token_ids: Sequence[int]) -> EnvStep:
        """Answer the model's turn (its sampled tokens, a stop token included)."""

    def encode(self, text: str) -> List[int]:
        """``text`` as token ids, without special tokens (an observation's tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


#: name -> environment class; filled by ``@register_env``.
ENVIRONMENTS: Dict[str, Type[Environment]] = {}


register_env = registrar(ENVIRONMENTS, "environment")
