"""Does the engine compute with the weights it was sent? A log-prob probe after a weight sync.

Checksums (``checksum.py``) prove what an engine *received*; they cannot see what its kernels
compute with. vLLM-CPU repacks linear weights into oneDNN / SGL kernels at load, and a tied LM
head kept a kernel packed from the old weights while its checksum matched (``rollout/
vllm_worker_ext.py``). The probe asks the engine itself: it generates a fixed probe, and the
trainer scores the same tokens with its own weights; their log-probs must agree within the
dtype's bound (``BOUNDS``).

The probe (``probe_prompts``): ``PROMPTS`` chat-templated questions that share a long system
turn - real tokens, a shared prefix longer than a KV block, so a prefix cache that outlived the
sync is hit (and caught) - each answered by ``PROBE_TOKENS`` sampled tokens (EOS ignored, so
every sample has tokens) at the run's temperature, with a fixed seed.

When (``SyncProbe.due``): the run's first sync (a fresh start or a resume) and every
``rollout.verify_sync_every`` syncs after it. The engine generates once it is fully awake (after
the KV cache is back); the trainer's pass runs at once when its weights are on the device, else
(``trainer.offload``) at the next step's onload - in both cases before any of the engine's new
samples is trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_stare.types import Sample
from megatron_stare.rollout.base import SamplingParams
from megatron_stare.rollout.data_parallel import replica_slice

__all__ = ["BOUNDS", "MismatchWatch", "ProbeGap", "SyncCheckError", "SyncProbe", "bound_for", "probe_gap", "probe_prompts",
           "sample_sources"]

#: (mean, max) bound of |engine log-prob - trainer log-prob| over the probe's tokens, by the
#: lower of the two sides' precisions. fp32: measured 1e-5 / 4e-5 on SmolLM2-135M (30 layers).
BOUNDS: Dict[str, Tuple[float, float]] = {"float32": (1e-4, 1e-3), "bfloat16": (2e-2, 0.5)}
#: Probe questions (distinct suffixes after the shared system turn).
PROMPTS = ("Add 17 and 25, then double the result. Show the steps.",
           "A shop sells pens at 3 dollars each. How much do 14 pens cost?",
           "What is 144 divided by 12, minus 5?",
           "Tom has 9 apples and gives away 4. How many are left?")
#: The shared system turn (its tokens are the prefix every probe prompt shares).
SYSTEM = ("You are a careful assistant who solves arithmetic word problems. Read the question, "
          "write out each intermediate step on its own line, check every sum and product twice, "
          "and finish with the final number alone on the last line. Keep the answer short, use "
          "digits rather than words for numbers, and never skip a step even when it looks easy.")
PROBE_TOKENS = 16
PROBE_SEED = 20_261_203


class SyncCheckError(RuntimeError):
    """The engine's log-probs are off the trainer's after a sync: it does not compute with the
    weights it was sent. The run stops (exit 1) before training on its samples."""


def bound_for(*dtypes: str) -> Tuple[float, float]:
    """The (mean, max) bound for the least precise of ``dtypes`` (``"float32"``, ``"bfloat16"``...)."""
    return BOUNDS["float32"] if all(d in ("float32", "float64") for d in dtypes) else BOUNDS["bfloat16"]


def probe_prompts(tokenizer, max_prompt_tokens: int, count: int = len(PROMPTS)) -> List[List[int]]:
    """``count`` probe prompts as token ids, each at most ``max_prompt_tokens`` long: the chat
    template's rendering when the tokenizer has one (else plain text), the shared system turn
    shortened word by word until every prompt fits."""
    words = SYSTEM.split()
    questions = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" (case {i})") for i in range(count)]
    while True:
        system = " ".join(words)
        out = [_render(tokenizer, system, q) for q in questions]
        if max(len(p) for p in out) <= max_prompt_tokens or not words:
            return [p[-max_prompt_tokens:] for p in out]
        words = words[:-1]


def _render(tokenizer, system: str, question: str) -> List[int]:
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(f"{system}\n\n{question}\n", add_special_tokens=True)["input_ids"]]


@dataclass
class ProbeGap:
    """The probe's result: per probe sample, the mean and max |engine - trainer| log-prob."""

    sample_mean: List[float]
    sample_max: List[float]
    tokens: int

    @property
    def mean(self) -> float:
        return sum(self.sample_mean) / max(1, len(self.sample_mean))

    @property
    def max(self) -> float:
        return max(self.sample_max, default=0.0)


class SyncProbe:
    """Probe prompts, cadence and bound of a run (``rollout.verify_sync=probe``).

    Args:
        prompts: probe prompt token ids (``probe_prompts``).
        temperature: the run's sampling temperature (the trainer scores at the same).
        every: probe every ``every`` syncs after the run's first (0: the first only).
        bound: (mean, max) of the gap (``bound_for``).
        max_new_tokens: tokens sampled per probe prompt.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], temperature: float, every: int,
                 bound: Tuple[float, float], max_new_tokens: int = PROBE_TOKENS):
        self.prompts = [list(p) for p in prompts]
        self.temperature, self.every, self.bound = temperature, every, bound
        self.max_new_tokens = max_new_tokens
        self.first: Optional[int] = None  # the run's first sync index (a resume starts later)
        self.pending: Optional[Tuple[int, list]] = None  # (step, results) awaiting the trainer's pass
        self.last: Optional[ProbeGap] = None

    @classmethod
    def for_run(cls, cfg, tokenizer, spec) -> Optional["SyncProbe"]:
        """The run's probe (``rollout.verify_sync=probe``; else None): prompts that fit
        ``data.max_prompt_length``, at least one per engine replica, the dtype's bound."""
        r = cfg.rollout
        if r.verify_sync != "probe":
            return None
        prompts = probe_prompts(tokenizer, cfg.data.max_prompt_length, count=max(4, spec.devices.replicas))
        return cls(prompts, r.temperature, r.verify_sync_every, bound_for(cfg.model.dtype, spec.dtype),
                   max_new_tokens=min(PROBE_TOKENS, r.max_new_tokens))

    def due(self, sync_index: int) -> bool:
        """Probe after sync ``sync_index`` (the policy version it installed)?"""
        if self.first is None:
            self.first = sync_index
        k = sync_index - self.first
        return k == 0 or (self.every > 0 and k % self.every == 0)

    def sampling(self):

        return SamplingParams(n=1, temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                              ignore_eos=True, seed=PROBE_SEED)

    def samples(self, results) -> List[Sample]:
        """The probe's results as the trainer's samples (advantage 0: nothing is trained)."""
        return [Sample(sample_id=i, group_id=r.prompt_index, prompt_ids=self.prompts[r.prompt_index],
                       response_ids=list(r.token_ids), engine_logprobs=[float(x) for x in r.logprobs])
                for i, r in enumerate(results)]

    def check(self, gap: ProbeGap, step: int, engine: str, where: Sequence[str]) -> ProbeGap:
        """Raise ``SyncCheckError`` if ``gap`` exceeds the bound. ``where``: a label per probe
        sample (the replica or server that generated it), to name the engine that is off."""
        self.last = gap
        mean_b, max_b = self.bound
        if gap.mean <= mean_b and gap.max <= max_b:
            return gap
        worst = max(range(len(gap.sample_mean)), key=lambda i: max(gap.sample_mean[i] / mean_b, gap.sample_max[i] / max_b))
        at = f" ({where[worst]})" if where and where[worst] else ""
        raise SyncCheckError(
            f"weight sync check: the {engine} engine{at} is off the trainer after the sync of step {step}: "
            f"probe log-prob gap {gap.mean:.2e} mean / {gap.max:.2e} max over {gap.tokens} tokens "
            f"(bound {mean_b:.0e} / {max_b:.0e}); it does not compute with the weights it was sent. "
            f"Stopped before training on its samples; the last checkpoint is intact")


def sample_sources(n: int, devices, engine) -> List[str]:
    """Who generated each of ``n`` probe samples, for the check's line: the engine replica
    (``replica_slice``'s dealing) or the attached / spawned server; "" when there is one engine."""

    if devices.replicas > 1:
        where = [""] * n
        for r in range(devices.replicas):
            for i in replica_slice(n, r, devices.replicas):
                where[i] = f"replica {r} of {devices.replicas}"
        return where
    servers = getattr(engine, "servers", None)  # a vllm-server fleet: the server each prompt went to
    if servers:
        backend = list(engine.dispatch_stats.backend)
        backend = backend if len(backend) == n else [0] * n
        return [f"server {servers[b].base_url}" if 0 <= b < len(servers) else "" for b in backend]
    url = getattr(engine, "base_url", None)
    return [f"server {url}" if url else ""] * n


@torch.no_grad()
def probe_gap(actor, samples: Sequence[Sample], groups) -> ProbeGap:
    """The trainer's log-probs of ``samples`` (every rank; collective over the whole model) and
    their gap to the engine's, per sample: sums and counts all-reduced over the data x context
    parallel group (each token is on exactly one rank of it), maxima likewise."""
    from megatron_stare.actor.logprob_pass import fill_old_logprobs

    batches = actor.prepare(list(samples))
    fill_old_logprobs(actor.model, None, batches, actor.kernel, groups, sensitivity=False, replay=None)
    n = len(samples)
    acc = torch.zeros(2, n, dtype=torch.float64, device=groups.device)  # sum, count
    mx = torch.zeros(n, dtype=torch.float64, device=groups.device)
    for mb in (m for mini in batches for m in mini):
        diff = (mb.engine_logp - mb.old_logp).abs().double() * mb.loss_mask
        for row, sid in enumerate(mb.sample_ids.tolist()):
            acc[0, sid] += diff[row].sum()
            acc[1, sid] += mb.loss_mask[row].sum()
            mx[sid] = torch.maximum(mx[sid], diff[row].max() if diff[row].numel() else mx[sid])
    dist.all_reduce(acc, group=groups.dp_cp_group)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=groups.dp_cp_group)
    means = (acc[0] / acc[1].clamp(min=1)).tolist()
    return ProbeGap(sample_mean=means, sample_max=mx.tolist(), tokens=int(acc[1].sum()))


class MismatchWatch:
    """Says once when the step's engine/trainer gap (``mismatch/mean_abs_logp``) grows past
    ``max(bound, factor x the run's first value)``: the engine drifting from the trainer shows
    there even between probes (an off-policy batch is what a drifting engine produces)."""

    def __init__(self, bound_mean: float, factor: float = 10.0):
        self.bound_mean, self.factor = bound_mean, factor
        self.first: Optional[float] = None
        self.said = False

    def update(self, step: int, mean_gap: Optional[float]) -> Optional[str]:
        """The line to print for this step's gap, once; None otherwise."""
        if mean_gap is None:
            return None
        if self.first is None:
            self.first = mean_gap
            return None
        limit = max(self.bound_mean, self.factor * self.first)
        if self.said or mean_gap <= limit:
            return None
        self.said = True
        return (f"step {step}: the engine's log-probs are {mean_gap:.2e} (mean abs) from the trainer's, "
                f"{mean_gap / max(self.first, 1e-12):.0f}x the first step's {self.first:.2e} (limit {limit:.1e}): "
                f"the engine may not compute with the synced weights or the batch is off-policy; check "
                f"rollout.verify_sync=probe with rollout.verify_sync_every=1, the engine's dtype, and "
                f"trainer.staleness")
