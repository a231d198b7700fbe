"""What a step makes of generated and scored responses: samples, advantages, DAPO selection.

The trainer runs step phases 1-3 (``runtime/phases.py``: generate, gather, score) and hands
each generation batch, as a ``ScoredBatch``, to a ``GroupSelector``. Every rank holds the same
gathered responses and the same shared scores, so every rank's selector keeps the same groups
and asks for the same number of batches: DAPO dynamic sampling cannot split the ranks, and a
colocated vLLM (which needs every rank to make the same ``generate`` calls) stays in lockstep.

``GroupSelector.finish()`` applies DAPO overlong shaping, keeps groups with non-zero reward
variance (with dynamic sampling), computes group advantages and returns the step's samples.
``eval_metrics`` computes avg@k and pass@k of an evaluation batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

import torch

from megatron_stare.algorithms.advantages import compute_advantages
from megatron_stare.config.load import Config
from megatron_stare.data import Prompt
from megatron_stare.envs import make_env
from megatron_stare.rewards import shape_overlong
from megatron_stare.rollout.base import GenerationResult, SamplingParams
from megatron_stare.rollout.multiturn import MultiTurnLimits, generate_multiturn
from megatron_stare.rollout.spec import SamplingDefaults
from megatron_stare.types import Sample


@dataclass
class ScoredBatch:
    """One generation batch after phases 1-3: ``results`` prompt-major (``n`` per prompt), the
    verifier's raw ``scores`` ``[len(results)]``, how many calls timed out or crashed, and the
    ``extras`` ``[len(results)]`` of dict returns (``rewards/contract.py``; may be empty)."""

    prompts: List[Prompt]
    results: List[GenerationResult]
    scores: List[float]
    n: int
    timeouts: int = 0
    crashes: int = 0
    extras: List[Dict[str, float]] = field(default_factory=list)

    def verdicts(self) -> List[float]:
        """``[len(results)]`` 1.0 / 0.0, whether each response is correct: the reward's ``acc``
        where its dict return gives one (verl's key for a reward that also pays for format or
        length), else whether its raw score is > 0."""
        extras = self.extras or [{}] * len(self.scores)
        return [float(x["acc"] > 0) if "acc" in x else float(s > 0) for s, x in zip(self.scores, extras)]


@dataclass
class RolloutStats:
    """What a step reports about its rollout (identical on every rank)."""

    reward_mean: float = 0.0
    accuracy: float = 0.0
    """Fraction of responses judged correct (``ScoredBatch.verdicts``: the reward's ``acc``, else
    reward > 0 before shaping)."""
    response_len_mean: float = 0.0
    """Response lengths count model tokens only (``model_tokens``): with multi-turn, the
    observations are not a length the policy chose; DAPO overlong shaping counts the same way
    against ``rollout.max_model_tokens``."""
    response_len_max: int = 0
    truncated_frac: float = 0.0
    """Responses that ended ``"length"``: out of new tokens, or (multi-turn) out of turns or of
    ``max_total_tokens`` before the environment said done."""
    gen_batches: int = 0
    kept_groups: int = 0
    flat_groups: float = 0.0
    """Fraction of the step's drawn prompt groups whose responses all earned the same (shaped)
    reward: under the group-relative estimators (grpo, dr_grpo, rloo) their advantages are all 0,
    so they teach nothing (dynamic sampling drops them).
    Near 1, a step trains on almost nothing whatever the loss."""
    num_tokens: int = 0
    """Every response token generated or appended (observations included): the rollout's work."""
    reward_timeouts: int = 0
    """Responses scored 0 because their verifier call ran out of time (or its worker died)."""
    multiturn: Dict[str, float] = field(default_factory=dict)
    """Multi-turn rollouts only: ``rollout.multiturn.multiturn_metrics`` of the step's trajectories."""
    reward_extras: Dict[str, float] = field(default_factory=dict)
    """Each extra number of the reward's dict returns: its mean over the responses that gave it
    (logged as ``reward/<key>``; a key named as a built-in metric does not replace it)."""

    def metrics(self) -> Dict[str, Any]:
        return {**self.multiturn, **{f"reward/{k}": v for k, v in self.reward_extras.items()},
                "reward/mean": self.reward_mean, "reward/accuracy": self.accuracy,
                "reward/timeouts": self.reward_timeouts,
                "response/mean_length": self.response_len_mean, "response/max_length": self.response_len_max,
                "response/truncated_frac": self.truncated_frac, "rollout/gen_batches": self.gen_batches,
                "rollout/kept_groups": self.kept_groups, "rollout/flat_groups": self.flat_groups,
                "rollout/generated_tokens": self.num_tokens}


def model_tokens(result: GenerationResult) -> int:
    """The tokens of a response the policy generated: all of them, or a multi-turn trajectory's
    loss-mask-1 tokens (its observations are the environment's)."""
    mask = getattr(result, "loss_mask", None)
    return len(result.token_ids) if mask is None else int(sum(mask))


def generate_episodes(engine, prompts: Sequence[Prompt], indices: Sequence[int], params: SamplingParams, mt,
                      tokenizer) -> List[GenerationResult]:
    """Multi-turn rollouts of ``prompts`` (their batch ``indices`` seed them): one environment per
    trajectory (``mt``: ``rollout.multi_turn``), reset with its prompt's task."""

    def new_env(j: int):  # for the call's prompt j
        env = make_env(mt.env, tokenizer, mt.env_options)
        env.reset(prompts[j].token_ids, prompts[j].answer, prompts[j].metadata)
        return env

    return generate_multiturn(engine, [p.token_ids for p in prompts], params,
                              MultiTurnLimits(mt.max_turns, mt.max_total_tokens), new_env, prompt_indices=list(indices))


def sampling_params(defaults: SamplingDefaults, *, seed: int, stop_ids: Sequence[int] = ()) -> SamplingParams:
    """One generate call's ``SamplingParams`` from the spec's defaults (training or eval)."""
    d = defaults
    return SamplingParams(n=d.n, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k,
                          max_new_tokens=d.max_new_tokens, stop_token_ids=tuple(stop_ids), seed=seed,
                          ignore_eos=d.ignore_eos)


class RanDry(RuntimeError):
    """DAPO's dynamic sampling drew ``trainer.max_gen_batches`` generation batches and kept too few
    prompt groups with mixed rewards to train on: the policy's groups are all right or all wrong.
    Every rank finds it on the same shared scores, so ``train.main`` prints one line; the run
    stops there, as verl's DAPO does, and its steps so far are its result (the study records such
    a run as stopped)."""


class GroupSelector:
    """Collects a step's scored generation batches; keeps whole prompt groups (see the module
    docstring). ``full`` says whether the step has what it needs."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.kept: List[tuple] = []  # (prompt, [results], [shaped rewards])
        self.correct: List[float] = []
        self.lengths: List[int] = []
        self.truncated = self.batches = self.timeouts = self.total_tokens = 0
        self.drawn = self.flat = 0  # prompt groups drawn, and those of zero reward variance
        self.extra_sums: Dict[str, List[float]] = {}  # key -> [sum, count] over the responses

    def add(self, batch: ScoredBatch) -> None:
        t = self.cfg.trainer
        lens = torch.tensor([model_tokens(r) for r in batch.results])
        shaped = shape_overlong(torch.tensor(batch.scores, dtype=torch.float32), lens,
                                self.cfg.rollout.max_model_tokens, self.cfg.reward).tolist()
        self.batches += 1
        self.correct += batch.verdicts()
        self.lengths += lens.tolist()
        self.total_tokens += sum(len(r.token_ids) for r in batch.results)
        self.truncated += sum(r.finish_reason == "length" for r in batch.results)
        self.timeouts += batch.timeouts + batch.crashes
        for x in batch.extras:
            for k, v in x.items():
                acc = self.extra_sums.setdefault(k, [0.0, 0])
                acc[0], acc[1] = acc[0] + v, acc[1] + 1
        n = batch.n
        for i, p in enumerate(batch.prompts):
            group = shaped[i * n:(i + 1) * n]
            self.drawn += 1
            if max(group) == min(group):  # zero reward variance: every advantage 0
                self.flat += 1
                if t.dynamic_sampling:
                    continue  # no learning signal: DAPO draws another group instead
            self.kept.append((p, batch.results[i * n:(i + 1) * n], group))

    @property
    def full(self) -> bool:
        t = self.cfg.trainer
        return self.batches > 0 and (not t.dynamic_sampling or len(self.kept) >= t.prompts_per_step
                                     or self.batches >= t.max_gen_batches)

    def finish(self) -> tuple:
        """``(samples, stats)``: the kept groups as samples with advantages."""
        t = self.cfg.trainer
        kept = self.kept
        if t.dynamic_sampling:
            kept = kept[:t.prompts_per_step]
            if len(kept) < t.prompts_per_step:
                # Too few informative groups after max_gen_batches: train on what there is, but
                # keep the group count divisible by the mini-batch count.
                kept = kept[:len(kept) - len(kept) % t.mini_batches_per_step]
        samples: List[Sample] = []
        for g, (p, res, rewards) in enumerate(kept):
            for r, rw in zip(res, rewards):
                samples.append(Sample(sample_id=len(samples), group_id=g, prompt_ids=list(p.token_ids),
                                      response_ids=list(r.token_ids), reward=float(rw),
                                      engine_logprobs=r.logprobs.tolist(), finish_reason=r.finish_reason,
                                      loss_mask=getattr(r, "loss_mask", None), routed_experts=r.routed_experts,
                                      metadata={} if r.versions is None else {"token_versions": list(r.versions)}))
        if samples:
            adv = compute_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64),
                                     torch.tensor([s.group_id for s in samples]), self.cfg.algorithm)
            for s, v in zip(samples, adv.tolist()):
                s.advantage = float(v)
        stats = RolloutStats(
            reward_mean=float(sum(s.reward for s in samples) / max(len(samples), 1)),
            accuracy=float(sum(self.correct) / max(len(self.correct), 1)),
            response_len_mean=float(sum(self.lengths) / max(len(self.lengths), 1)),
            response_len_max=int(max(self.lengths, default=0)),
            truncated_frac=self.truncated / max(len(self.lengths), 1), gen_batches=self.batches,
            kept_groups=len(kept), flat_groups=self.flat / max(self.drawn, 1), num_tokens=self.total_tokens,
            reward_timeouts=self.timeouts,
            reward_extras={k: s / c for k, (s, c) in self.extra_sums.items()})
        return samples, stats


def pass_at_j(correct: torch.Tensor, j: int) -> float:
    """Mean over prompts of the unbiased pass@j from ``correct`` ``[prompts, k]`` (0/1), j <= k."""
    k = correct.shape[1]
    return float(sum(1.0 if k - c < j else 1.0 - math.comb(k - c, j) / math.comb(k, j)
                     for c in correct.sum(1).long().tolist()) / max(correct.shape[0], 1))


def eval_metrics(batch: ScoredBatch) -> Dict[str, float]:
    """avg@k (mean accuracy over k samples) and pass@k (any of k correct), k = ``batch.n``;
    correct as ``ScoredBatch.verdicts`` judges."""
    k = batch.n
    correct = torch.tensor(batch.verdicts(), dtype=torch.float64).view(len(batch.prompts), k)
    # With many samples (>= 16), also pass@j for j = 2, 4, ... < k (the unbiased estimator
    # 1 - C(k-c, j) / C(k, j) per prompt): a pass@k curve. Small evals keep their two numbers.
    ladder = {f"eval/pass@{j}": pass_at_j(correct, j) for j in (2 ** i for i in range(1, 10)) if k >= 16 and j < k}
    return {**ladder, f"eval/avg@{k}": float(correct.mean()), f"eval/pass@{k}": float(correct.max(1).values.mean()),
            "eval/response_len_mean": float(sum(model_tokens(r) for r in batch.results)
                                            / max(len(batch.results), 1))}
