"""Off-policy corrections on the train/behaviour ratio, one implementation for every rule.

``k_t = exp(old_logp_t - engine_logp_t)`` ``[B, T]``: the trainer's log-prob of a sampled token
over the rollout engine's (the behaviour policy's, possibly several versions old). A rule turns
it into a detached token weight that multiplies each token's policy loss (docs/algorithms.md,
last section; bounds in ``algorithm.off_policy``):

- ``tis``: ``min(k, C)`` (truncated importance sampling);
- ``mis_token``: ``k`` where ``k <= C``, else 0 (masked importance sampling, token level);
- ``mis_sequence``: the response's product ratio ``prod_t k_t`` on each of its tokens where it is
  ``<= C``, else 0 for the whole response;
- ``band_mask``: 1 where ``a <= k <= b``, else 0 (IcePop-style band; the asynchronous mode's
  default with ``[0.5, 2]``);
- ``geo_mask``: 1 for a response whose geometric mean ``exp(mean_t log k_t)`` lies in
  ``[1/C, C]``, else 0 for the whole response.

A weight rule and a mask rule compose by product (``tis+band_mask``). At ``k = 1`` every rule
gives weight 1: the base loss. Comparisons are in log space (no ratio overflows).

Per-sequence rules (``mis_sequence``, ``geo_mask``) need the sums over a response's valid tokens:
rows of ``[B, T]`` are responses (packed micro-batches are gathered into this layout), and under
context parallelism a row's tokens are spread over the CP ranks, so the per-row sums are
all-reduced over ``cp_group`` (one all-reduce of ``[2, B]`` float64): exact, whatever the split.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.algorithms.aggregation import all_reduce_sum
from megatron_stare.config.algorithm import AlgorithmConfig, OffPolicyConfig, parse_off_policy
from megatron_stare.config.dotted import registrar


@dataclass(frozen=True)
class OffPolicyCorrection:
    """The resolved correction of a run: its rules (empty = none) and their bounds."""

    rules: Tuple[str, ...] = ()
    bounds: OffPolicyConfig = dataclasses.field(default_factory=OffPolicyConfig)

    @property
    def masks(self) -> bool:
        """Some rule can give a token weight 0."""
        return any(r != "tis" for r in self.rules)


def resolve_off_policy(algo: AlgorithmConfig, *, staleness: int = 0, ratio_mask_low: Optional[float] = None,
                       ratio_mask_high: Optional[float] = None) -> Tuple[OffPolicyCorrection, List[str]]:
    """The correction a run applies, and the deprecation lines of the old fields it read.

    ``algorithm.off_policy_correction`` null means ``band_mask`` with ``staleness > 0`` (the
    asynchronous default) and ``none`` otherwise. Old fields still work: ``algorithm.tis_cap``
    is ``tis`` with that cap; ``trainer.ratio_mask_low/high`` are the band's bounds.
    """
    notes: List[str] = []
    value, bounds = algo.off_policy_correction, algo.off_policy
    if algo.tis_cap is not None:
        notes.append(f"algorithm.tis_cap is deprecated: use algorithm.off_policy_correction=tis "
                     f"algorithm.off_policy.tis_cap={algo.tis_cap}")
        value, bounds = "tis", dataclasses.replace(bounds, tis_cap=algo.tis_cap)
    if ratio_mask_low is not None or ratio_mask_high is not None:
        notes.append("trainer.ratio_mask_low/high are deprecated: use algorithm.off_policy_correction=band_mask "
                     "with algorithm.off_policy.band_low/band_high")
        bounds = dataclasses.replace(bounds, band_low=bounds.band_low if ratio_mask_low is None else ratio_mask_low,
                                     band_high=bounds.band_high if ratio_mask_high is None else ratio_mask_high)
    if algo.off_policy_correction is None and staleness > 0:
        value = "tis+band_mask" if value == "tis" else "band_mask"
    return OffPolicyCorrection(parse_off_policy(value), bounds), notes


def sequence_sums(x: Tensor, mask: Tensor, cp_group: Optional[dist.ProcessGroup]) -> Tuple[Tensor, Tensor]:
    """``([B], [B])`` float64: the sum of ``x`` ``[B, T]`` over each row's valid tokens and their
    count, over the whole response (all-reduced over ``cp_group``; None = rows are whole here)."""
    valid = mask.bool()
    x = torch.where(valid, x.detach().to(torch.float64), torch.zeros((), dtype=torch.float64, device=x.device))
    sums = all_reduce_sum(torch.stack([x.sum(-1), valid.sum(-1, dtype=torch.float64)]), cp_group)
    return sums[0], sums[1]


@dataclass
class RuleInput:
    log_k: Tensor
    """``[B, T]`` ``old_logp - engine_logp`` (the log-probs' dtype)."""
    mask: Tensor
    bounds: OffPolicyConfig
    cp_group: Optional[dist.ProcessGroup]


#: name -> (weight ``[B, T]`` or None for an all-ones weight, masked ``[B, T]`` bool).
RuleFn = Callable[[RuleInput], Tuple[Optional[Tensor], Tensor]]
OFF_POLICY_RULES: Dict[str, RuleFn] = {}


register_rule = registrar(OFF_POLICY_RULES, "off-policy rule")


def _row(x: Tensor, like: Tensor) -> Tensor:
    return x.unsqueeze(-1).expand_as(like).to(like.dtype)


def _log(bound: float, like: Tensor) -> Tensor:
    """``log(bound)`` in the dtype of ``like``: a token whose ratio equals the bound in that dtype
    compares as equal (float32 log(0.5) is not float64 log(0.5))."""
    return torch.log(torch.tensor(float(bound), dtype=like.dtype, device=like.device))


@register_rule("tis")
def _tis(r: RuleInput):
    return torch.exp(torch.minimum(r.log_k, _log(r.bounds.tis_cap, r.log_k))), torch.zeros_like(r.mask, dtype=torch.bool)


@register_rule("mis_token")
def _mis_token(r: RuleInput):
    cap = _log(r.bounds.mis_cap, r.log_k)
    out = r.log_k > cap
    return torch.where(out, torch.zeros_like(r.log_k), torch.exp(torch.minimum(r.log_k, cap))), out


@register_rule("mis_sequence")
def _mis_sequence(r: RuleInput):
    total, _ = sequence_sums(r.log_k, r.mask, r.cp_group)
    out = total > math.log(r.bounds.mis_cap)
    w = torch.where(out, torch.zeros_like(total), torch.exp(total.clamp(max=math.log(r.bounds.mis_cap))))
    return _row(w, r.log_k), _row(out, r.mask)


@register_rule("band_mask")
def _band_mask(r: RuleInput):
    b = r.bounds
    out = r.log_k < _log(b.band_low, r.log_k)
    if b.band_high != math.inf:
        out |= r.log_k > _log(b.band_high, r.log_k)
    return None, out


@register_rule("geo_mask")
def _geo_mask(r: RuleInput):
    total, count = sequence_sums(r.log_k, r.mask, r.cp_group)
    mean = total / count.clamp(min=1)
    return None, _row(mean.abs() > math.log(r.bounds.geo_cap), r.mask)


@dataclass
class OffPolicyWeights:
    weight: Tensor
    """``[B, T]`` detached token weights in the dtype of the log-probs (0 where masked)."""
    masked: Tensor
    """``[B, T]`` bool: tokens a rule masked (weight 0)."""


@torch.no_grad()
def off_policy_weights(old_logp: Tensor, engine_logp: Optional[Tensor], mask: Tensor,
                       correction: OffPolicyCorrection,
                       cp_group: Optional[dist.ProcessGroup] = None) -> Optional[OffPolicyWeights]:
    """The correction's token weights ``[B, T]``; None without rules or engine log-probs.

    ``cp_group``: the context-parallel group when rows are split over its ranks (collective
    there for the per-sequence rules: every CP rank calls it for the same micro-batch).
    Padding holds finite values that the loss masks.
    """
    if engine_logp is None or not correction.rules:
        return None
    inp = RuleInput(old_logp - engine_logp, mask, correction.bounds, cp_group)
    weight = torch.ones_like(inp.log_k)
    masked = torch.zeros_like(mask, dtype=torch.bool)
    for rule in correction.rules:
        w, m = OFF_POLICY_RULES[rule](inp)
        masked |= m
        if w is not None:
            weight = weight * w
    weight = torch.where(masked, torch.zeros_like(weight), weight)
    return OffPolicyWeights(weight=weight, masked=masked)


def run_off_policy(cfg) -> Tuple[OffPolicyCorrection, List[str]]:
    """``resolve_off_policy`` of a run's ``Config`` (its algorithm and trainer sections)."""
    t = cfg.trainer
    return resolve_off_policy(cfg.algorithm, staleness=t.staleness, ratio_mask_low=t.ratio_mask_low,
                              ratio_mask_high=t.ratio_mask_high)
