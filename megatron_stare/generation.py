"""Rollout of one training step on the driver rank: generate -> reward -> advantage.

``collect_samples`` asks the engine for ``n`` responses per prompt, scores them in the reward
pool, applies DAPO overlong shaping, computes group advantages, and (optionally) keeps only
groups with non-zero reward variance, generating more batches until enough groups remain
(DAPO dynamic sampling). ``evaluate`` computes avg@k and pass@k on a prompt set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron_stare.algorithms.advantages import compute_advantages
from megatron_stare.config import Config
from megatron_stare.data import Prompt
from megatron_stare.rewards import RewardPool, shape_overlong
from megatron_stare.rollout.base import RolloutEngine, SamplingParams
from megatron_stare.types import Sample


@dataclass
class RolloutStats:
    """What the driver reports about a step's rollout."""

    reward_mean: float = 0.0
    accuracy: float = 0.0
    """Fraction of responses with reward > 0 before shaping (the verifier's verdict)."""
    response_len_mean: float = 0.0
    response_len_max: int = 0
    truncated_frac: float = 0.0
    gen_batches: int = 0
    kept_groups: int = 0
    num_tokens: int = 0
    extra: Dict[str, float] = field(default_factory=dict)


def sampling_params(cfg: Config, *, seed: int, eval_mode: bool = False, stop_ids=()) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        n=r.eval_n if eval_mode else r.n,
        temperature=r.eval_temperature if eval_mode else r.temperature,
        top_p=r.eval_top_p if eval_mode else r.top_p,
        top_k=0 if r.top_k == -1 else r.top_k,
        max_new_tokens=r.max_new_tokens, stop_token_ids=tuple(stop_ids), seed=seed)


def _generate(engine: RolloutEngine, prompts: Sequence[Prompt], params: SamplingParams, tokenizer,
              pool: RewardPool, times: Optional[Dict[str, float]] = None):
    t0 = time.perf_counter()
    results = engine.generate([p.token_ids for p in prompts], params)
    t1 = time.perf_counter()
    texts = tokenizer.batch_decode([r.token_ids for r in results], skip_special_tokens=True)
    answers = [prompts[r.prompt_index].answer for r in results]
    metas = [prompts[r.prompt_index].metadata for r in results]
    scores = pool.submit(texts, answers, metas).result()
    if times is not None:
        times["time/rollout"] = times.get("time/rollout", 0.0) + t1 - t0
        times["time/reward"] = times.get("time/reward", 0.0) + time.perf_counter() - t1
    return results, texts, scores


def collect_samples(engine: RolloutEngine, prompts: List[Prompt], more_prompts, tokenizer,
                    pool: RewardPool, cfg: Config, seed: int) -> tuple:
    """``(samples, stats)`` for one training step (driver rank only).

    ``more_prompts()`` returns the next batch of prompts for dynamic sampling.
    """
    t, a = cfg.trainer, cfg.algorithm
    kept: List[tuple] = []  # (prompt, [results], [raw scores], [shaped rewards])
    all_raw: List[float] = []
    lengths: List[int] = []
    truncated = 0
    batches = 0
    batch = prompts
    times: Dict[str, float] = {}
    while True:
        params = sampling_params(cfg, seed=seed * 1009 + batches)
        results, _, raw = _generate(engine, batch, params, tokenizer, pool, times)
        batches += 1
        lens = torch.tensor([len(r.token_ids) for r in results])
        shaped = shape_overlong(torch.tensor(raw, dtype=torch.float32), lens, cfg.rollout.max_new_tokens,
                                cfg.reward).tolist()
        all_raw += raw
        lengths += lens.tolist()
        truncated += sum(r.finish_reason == "length" for r in results)
        n = params.n
        for i, p in enumerate(batch):
            group = shaped[i * n:(i + 1) * n]
            if t.dynamic_sampling and max(group) == min(group):
                continue  # zero reward variance: no learning signal (DAPO)
            kept.append((p, results[i * n:(i + 1) * n], raw[i * n:(i + 1) * n], group))
        if not t.dynamic_sampling or len(kept) >= t.prompts_per_step or batches >= t.max_gen_batches:
            break
        batch = more_prompts()
    if t.dynamic_sampling:
        kept = kept[:t.prompts_per_step]
        if len(kept) < t.prompts_per_step:
            # Too few informative groups after max_gen_batches: train on what there is, but keep
            # the group count divisible by the mini-batch count.
            kept = kept[:len(kept) - len(kept) % t.mini_batches_per_step]
    samples: List[Sample] = []
    for g, (p, res, raw, rewards) in enumerate(kept):
        for r, rw in zip(res, rewards):
            samples.append(Sample(sample_id=len(samples), group_id=g, prompt_ids=list(p.token_ids),
                                  response_ids=list(r.token_ids), reward=float(rw),
                                  engine_logprobs=r.logprobs.tolist(), finish_reason=r.finish_reason))
    if samples:
        adv = compute_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64),
                                 torch.tensor([s.group_id for s in samples]), a)
        for s, v in zip(samples, adv.tolist()):
            s.advantage = float(v)
    stats = RolloutStats(
        reward_mean=float(sum(s.reward for s in samples) / max(len(samples), 1)),
        accuracy=float(sum(x > 0 for x in all_raw) / max(len(all_raw), 1)),
        response_len_mean=float(sum(lengths) / max(len(lengths), 1)),
        response_len_max=int(max(lengths, default=0)),
        truncated_frac=truncated / max(len(lengths), 1), gen_batches=batches, kept_groups=len(kept),
        num_tokens=int(sum(lengths)), extra=times)
    return samples, stats


def evaluate(engine: RolloutEngine, prompts: List[Prompt], tokenizer, pool: RewardPool, cfg: Config,
             seed: int) -> Dict[str, float]:
    """avg@k (mean accuracy over k samples) and pass@k (any of k correct), k = rollout.eval_n."""
    params = sampling_params(cfg, seed=seed, eval_mode=True)
    results, _, scores = _generate(engine, prompts, params, tokenizer, pool)
    k = params.n
    correct = torch.tensor([s > 0 for s in scores], dtype=torch.float64).view(len(prompts), k)
    return {f"eval/avg@{k}": float(correct.mean()), f"eval/pass@{k}": float(correct.max(1).values.mean()),
            "eval/response_len_mean": float(sum(len(r.token_ids) for r in results) / max(len(results), 1))}


def as_metrics(stats: RolloutStats) -> Dict[str, Any]:
    return {"reward/mean": stats.reward_mean, "reward/accuracy": stats.accuracy,
            "response/mean_length": stats.response_len_mean, "response/max_length": stats.response_len_max,
            "response/truncated_frac": stats.truncated_frac, "rollout/gen_batches": stats.gen_batches,
            "rollout/kept_groups": stats.kept_groups, **stats.extra}
