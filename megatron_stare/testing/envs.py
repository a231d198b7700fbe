"""Test environments and the boundary recorders of the multi-turn tests.

``EchoToolEnv``: a deterministic environment that always "calls a tool": its observation
depends on the turn's tokens (so a dropped, added or re-tokenized token shows), and it is done
after ``done_after`` steps with reward ``1.0``. ``TracedEngine`` / ``traced_env`` record what
crosses the engine's and the environment's boundaries, the trace the trainer's token ids are
checked against. ``HangingCalculatorEnv``: the calculator with a tool that times out on a
deterministic subset of calls.
"""

from __future__ import annotations

import re
import time
from typing import List, Sequence

from megatron_stare.envs.base import EnvStep, Environment
from megatron_stare.envs.calculator import CalculatorEnv


class EchoToolEnv(Environment):
    """Observation of turn ``k``: ``[base + sum(turn) % 50, base + k, base + len(turn) % 7]``."""

    def __init__(self, tokenizer=None, *, done_after: int = 3, base: int = 60):
        super().__init__(tokenizer)
        self.done_after, self.base, self.k = done_after, base, 0

    def step(self, turn_token_ids: Sequence[int]) -> EnvStep:
        self.k += 1
        if self.k >= self.done_after:
            return EnvStep([], reward=1.0, done=True)
        t = list(turn_token_ids)
        obs = [self.base + sum(t) % 50, self.base + self.k, self.base + len(t) % 7]
        return EnvStep(obs, tool_call=True, tool_error=self.k == 2)


class TracedEngine:
    """Wraps an engine; ``calls`` records every ``generate``: ``(contexts, prompt_indices,
    [(token_ids, logprobs)])`` exactly as passed and returned."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompt_token_ids, params, prompt_indices=None):
        out = self.engine.generate(prompt_token_ids, params, prompt_indices=prompt_indices)
        self.calls.append(([list(p) for p in prompt_token_ids], list(prompt_indices or []),
                           [(list(o.token_ids), o.logprobs.clone()) for o in out]))
        return out


def traced_env(env: Environment, trace: List[tuple]) -> Environment:
    """``env`` whose ``step`` appends ``(turn_token_ids, observation)`` to ``trace``."""
    step = env.step

    def recorded(turn):
        res = step(turn)
        trace.append((list(turn), list(res.observation), res.done))
        return res

    env.step = recorded
    return env



class HangingCalculatorEnv(CalculatorEnv):
    """The ``calculator`` whose tool hangs (sleeps 20x ``time_limit_s``) when the expression's
    first number is divisible by 7: a real wall-clock timeout on a deterministic subset of calls,
    so a run and its resume see the same error observations."""

    def run_tool(self, expr: str) -> str:
        first = re.match(r"\s*(\d+)", expr)
        if first is not None and int(first.group(1)) % 7 == 0:
            time.sleep(20 * self.time_limit_s)
        return super().run_tool(expr)
