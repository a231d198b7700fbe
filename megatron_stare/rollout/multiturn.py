"""Multi-turn rollouts on token ids: the model's turns through any engine's ``generate``, the
environment's observations appended as tokens, and a loss mask over the response.

A trajectory's response is its turns end to end: model turn 1 (as sampled, stop token
included), observation 1 (the environment's token ids, as returned), model turn 2, ... Each
model turn is one ``engine.generate`` call on the prompt plus everything so far, as token ids;
nothing is decoded and re-tokenized, so the trainer sees exactly the tokens the engine produced
and the environment returned (the tokenization-drift bug of text-based agent loops cannot
happen). ``loss_mask`` is 1 on model tokens and 0 on observation tokens; observation tokens
carry log-prob 0 (they were not sampled).

Limits (``MultiTurnLimits``): at most ``max_turns`` model turns and ``max_total_tokens``
response tokens (model + observation) per trajectory; a turn gets
``min(params.max_new_tokens, what is left)`` new tokens, an observation is cut to what is left.
A trajectory ends ``"stop"`` when the environment says done, else ``"length"``.

Seeds: turn ``k`` of row ``r`` (prompt ``i``'s sample ``s``, ``r = i * n + s`` over the whole
batch) is generated as prompt ``r`` of a call seeded ``sample_seed(seed, k)``, so a seeded
rollout is reproducible whichever rows share a call. Works with every engine: it only uses
``RolloutEngine.generate`` on token ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron_stare.envs.base import Environment
from megatron_stare.rollout.base import GenerationResult, RolloutEngine, SamplingParams, batch_indices, sample_seed

__all__ = ["MultiTurnLimits", "Trajectory", "generate_multiturn", "multiturn_metrics"]


@dataclass(frozen=True)
class MultiTurnLimits:
    max_turns: int = 4
    """Most model turns per trajectory."""
    max_total_tokens: int = 256
    """Most response tokens (model + observation) per trajectory."""

    def __post_init__(self):
        if self.max_turns < 1 or self.max_total_tokens < 1:
            raise ValueError(f"MultiTurnLimits needs max_turns >= 1 and max_total_tokens >= 1, got {self}")


@dataclass
class Trajectory(GenerationResult):
    """A multi-turn response: ``token_ids`` ``[T]`` model and observation tokens interleaved,
    ``logprobs`` ``[T]`` (0 on observation tokens), ``loss_mask`` ``[T]`` 1 on model tokens."""

    loss_mask: List[int] = field(default_factory=list)
    turns: int = 0
    """Model turns taken."""
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float = 0.0
    """The environment's reward at its last step."""

    def __post_init__(self):
        super().__post_init__()
        if len(self.loss_mask) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but a loss mask of {len(self.loss_mask)}")


@dataclass
class _Row:
    env: Environment
    context: List[int]
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    errors: int = 0
    reward: float = 0.0
    finish: Optional[str] = None

    def add(self, ids: Sequence[int], logprobs: Sequence[float], model: bool) -> None:
        self.tokens += ids
        self.context += ids
        self.logprobs += logprobs
        self.mask += [int(model)] * len(ids)


def generate_multiturn(engine: RolloutEngine, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                       limits: MultiTurnLimits, new_env: Callable[[int], Environment],
                       prompt_indices: Optional[Sequence[int]] = None) -> List[Trajectory]:
    """``len(prompts) * params.n`` trajectories, prompt-major (as ``generate``).

    ``new_env(p)``: a fresh environment, already ``reset`` for prompt ``p`` of this call (one
    per trajectory). ``prompt_indices``: each prompt's index in the whole batch (seeds and
    ``prompt_index``, as ``generate``).
    """
    idx = batch_indices(prompt_token_ids, prompt_indices)
    n = params.n
    rows: Dict[int, _Row] = {}
    for p, ids in enumerate(prompt_token_ids):
        for s in range(n):
            rows[idx[p] * n + s] = _Row(new_env(p), list(ids))
    for turn in range(limits.max_turns):
        # One call per turn budget (rows whose budgets differ cannot share SamplingParams).
        by_budget: Dict[int, List[int]] = {}
        for r, row in rows.items():
            if row.finish is None:
                budget = min(params.max_new_tokens, limits.max_total_tokens - len(row.tokens))
                by_budget.setdefault(budget, []).append(r)
        if not by_budget:
            break
        for budget, active in sorted(by_budget.items()):
            call = dataclasses.replace(params, n=1, max_new_tokens=budget,
                                       seed=None if params.seed is None else sample_seed(params.seed, turn))
            outs = engine.generate([rows[r].context for r in active], call, prompt_indices=active)
            for r, out in zip(active, outs):
                _take_turn(rows[r], out, limits, last=turn + 1 == limits.max_turns)
    return [_trajectory(idx[p], s, rows[idx[p] * n + s]) for p in range(len(prompt_token_ids)) for s in range(n)]


def _take_turn(row: _Row, out: GenerationResult, limits: MultiTurnLimits, last: bool) -> None:
    """Append the model's turn, let the environment answer, append its observation."""
    row.add(out.token_ids, out.logprobs.tolist(), model=True)
    row.turns += 1
    step = row.env.step(list(out.token_ids))
    row.calls += step.tool_call
    row.errors += step.tool_error
    row.reward = step.reward
    left = limits.max_total_tokens - len(row.tokens)
    if step.done:
        row.finish = "stop"
    elif last or left <= 0:
        row.finish = "length"  # out of turns or tokens; a trailing observation trains nothing
    else:
        obs = step.observation[:left]
        row.add(obs, [0.0] * len(obs), model=False)
        if len(obs) < len(step.observation) or len(row.tokens) >= limits.max_total_tokens:
            row.finish = "length"


def _trajectory(prompt_index: int, sample_index: int, row: _Row) -> Trajectory:
    return Trajectory(prompt_index, sample_index, row.tokens, torch.tensor(row.logprobs, dtype=torch.float32),
                      row.finish or "length", loss_mask=row.mask, turns=row.turns, tool_calls=row.calls,
                      tool_errors=row.errors, env_reward=row.reward)


def multiturn_metrics(trajectories: Sequence[Trajectory]) -> Dict[str, float]:
    """Per-step metrics: mean turns per trajectory, the fraction of tool calls that succeeded
    (1.0 when none was made) and the fraction of response tokens trained on (loss mask 1)."""
    k = max(len(trajectories), 1)
    calls = sum(t.tool_calls for t in trajectories)
    errors = sum(t.tool_errors for t in trajectories)
    tokens = sum(len(t.loss_mask) for t in trajectories)
    return {"multiturn/turns_mean": sum(t.turns for t in trajectories) / k,
            "multiturn/tool_calls_mean": calls / k,
            "multiturn/tool_success_rate": (calls - errors) / calls if calls else 1.0,
            "multiturn/trained_token_frac": sum(sum(t.loss_mask) for t in trajectories) / tokens if tokens else 1.0}
