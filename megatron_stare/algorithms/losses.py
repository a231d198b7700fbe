"""Policy losses: a registry of small classes sharing one two-phase contract.

Per optimizer mini-batch, on every rank, before any backward:
    plan = loss_fn.plan(MiniBatchInput(...this rank's whole mini-batch...), dp_group=..., step=..., stare_state=...)
Per micro-batch:
    out = loss_fn(PolicyLossInput(...), plan)          # out.loss: scalar, out.metrics: MetricSums
    (out.loss * backward_scale(...)).backward()

``out.loss`` is this micro-batch's share of the global mini-batch loss: token losses summed over
its valid tokens (or sequences) divided by the GLOBAL denominators in ``plan``. Summed over all
micro-batches and data(×context)-parallel ranks it equals the loss of the whole mini-batch, so the
summed gradients are layout-independent. If the gradient reducer averages instead of summing,
multiply by ``aggregation.backward_scale`` (Megatron defaults: dp_size * num_microbatches).

Registered names: ``vanilla`` (dual-clip surrogate = GRPO/DAPO/PPO), ``stare``, ``clip_cov``, ``kl_cov``.
Total loss = agg(policy token loss) - entropy_coeff * agg(H) + kl_loss_coef * agg(KL(pi || pi_ref)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Type

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.algorithms import cov as cov_ops
from megatron_stare.algorithms.aggregation import (AGG_MODES, LossDenominators, MetricSums, aggregate,
                                                   compute_loss_denominators)
from megatron_stare.algorithms.config import AlgorithmConfig
from megatron_stare.algorithms.kl import kl_penalty, resolve_kl_type
from megatron_stare.config_fields import ConfigError
from megatron_stare.algorithms.stare import StareSelection, StareState, broadcast_advantages, stare_global_selection, stare_weights

LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyLossInput:
    """One micro-batch on this rank; all ``[B, T]`` unless noted.

    Padded positions must hold finite values: they are excluded from the loss and the metrics,
    but a NaN there would still reach the model through the backward of the elementwise ops.
    """

    logp: Tensor
    """Current-policy log-prob of the sampled tokens (with grad)."""
    old_logp: Tensor
    """Rollout-time / old-log-prob-pass log-prob (no grad)."""
    advantages: Tensor
    """``[B]`` trajectory advantages (broadcast over tokens) or ``[B, T]``."""
    mask: Tensor
    """Valid response tokens (bool)."""
    token_keys: Tensor
    """Global layout-independent int64 keys ``sample_id * max_len + position``."""
    entropy: Optional[Tensor] = None
    """Full-vocabulary entropy (with grad when entropy_coeff > 0); also logged."""
    ref_logp: Optional[Tensor] = None
    """Reference-policy log-prob; required when kl_loss_coef > 0."""
    seq_num_tokens: Optional[Tensor] = None
    """``[B]`` full-sequence valid counts (``aggregation.sequence_token_counts``), only under CP."""
    tis_weight: Optional[Tensor] = None
    """Truncated importance-sampling weights ``min(pi_old / pi_engine, C)`` (no grad) that correct
    the train/inference mismatch; multiply each token's policy loss."""


@dataclass
class MiniBatchInput:
    """This rank's WHOLE optimizer mini-batch (all its micro-batches), old-log-prob pass, ``[N, T]``."""

    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    token_keys: Tensor


@dataclass
class LossPlan:
    """Computed once per mini-batch before the backward passes; identical on every rank."""

    denominators: LossDenominators
    step: int = 0
    stare_state: Optional[StareState] = None
    stare: Optional[StareSelection] = None
    cov: Optional[cov_ops.CovSelection] = None


@dataclass
class LossOutput:
    loss: Tensor
    """Scalar with grad: this micro-batch's share of the global mini-batch loss."""
    pg_loss: Tensor
    """Detached policy-gradient part of ``loss`` (sums to the global value like ``loss``)."""
    metrics: MetricSums
    """Token-level metrics as (sum, count); all-reduce and take ``means()`` for exact global values."""


@dataclass
class Surrogate:
    loss: Tensor
    """``[B, T]`` dual-clip surrogate ``L``."""
    log_ratio: Tensor
    """``[B, T]`` clamped ``logp - old_logp``."""
    clipped: Tensor
    """``[B, T]`` bool: the eps clip is active (L2 > L1)."""
    dual_clipped: Tensor
    """``[B, T]`` bool: the dual clip is active (A < 0 and max(L1, L2) > -A*c)."""


def clipped_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_low: float, eps_high: float,
                      clip_c: Optional[float]) -> Surrogate:
    """``L = max(-A*rho, -A*clip(rho, 1-eps_low, 1+eps_high))``; dual clip for A<0: ``min(L, -A*c)``."""
    a = broadcast_advantages(advantages, logp)
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(log_ratio)
    l1 = -a * rho
    l2 = -a * torch.clamp(rho, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(l1, l2)
    clipped = l2 > l1
    dual = torch.zeros_like(clipped)
    if clip_c is not None:
        l3 = -a * clip_c
        dual = (a < 0) & (loss > l3)
        loss = torch.where(a < 0, torch.minimum(loss, l3), loss)
    return Surrogate(loss=loss, log_ratio=log_ratio, clipped=clipped, dual_clipped=dual)


def _msum(x: Tensor, valid: Tensor) -> Tensor:
    """Sum of ``x`` over valid tokens (select, not multiply: 0 * inf is NaN)."""
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


# ------------------------------------------------------------------------------------------------
class PolicyLoss:
    """Base class: the clipped surrogate plus the shared aggregation, entropy bonus and KL."""

    def __init__(self, cfg: AlgorithmConfig):
        self.cfg = cfg

    # -- phase 1: once per mini-batch -----------------------------------------------------------
    def plan(self, mb: MiniBatchInput, *, dp_group: Optional[dist.ProcessGroup] = None,
             cp_group: Optional[dist.ProcessGroup] = None, step: int = 0,
             stare_state: Optional[StareState] = None) -> LossPlan:
        """Global denominators (and selections) of the mini-batch; collective over the groups.

        ``dp_group``: the group the mini-batch's tokens are partitioned over (data×context
        parallel); ``cp_group``: context-parallel group (None without CP). ``step``: the training
        step (seeds Clip-Cov's pick). ``stare_state``: the controller's state for this step.
        """
        den = compute_loss_denominators(mb.mask, dp_group=dp_group, cp_group=cp_group)
        plan = LossPlan(denominators=den, step=step, stare_state=stare_state)
        self._plan(plan, mb, dp_group)
        return plan

    def _plan(self, plan: LossPlan, mb: MiniBatchInput, dp_group) -> None:
        """Loss-specific additions to ``plan`` (selections); nothing for the plain surrogate."""

    # -- phase 2: per micro-batch ---------------------------------------------------------------
    def token_loss(self, inp: PolicyLossInput, plan: LossPlan, metrics: MetricSums) -> Tensor:
        """``[B, T]`` per-token policy loss; adds its metrics to ``metrics``."""
        sur = self.surrogate(inp, metrics)
        return sur.loss

    def surrogate(self, inp: PolicyLossInput, metrics: MetricSums) -> Surrogate:
        c = self.cfg
        sur = clipped_surrogate(inp.logp, inp.old_logp, inp.advantages, c.clip_ratio_low, c.clip_ratio_high, c.clip_ratio_c)
        valid = inp.mask.bool()
        n = valid.sum()
        metrics.add("pg_clipfrac", (sur.clipped & valid).sum(), n)
        metrics.add("pg_clipfrac_lower", (sur.dual_clipped & valid).sum(), n)
        metrics.add("ppo_kl", _msum(-sur.log_ratio.detach(), valid), n)
        return sur

    def __call__(self, inp: PolicyLossInput, plan: LossPlan) -> LossOutput:
        c = self.cfg
        metrics = MetricSums()
        agg_kw = dict(seq_num_tokens=inp.seq_num_tokens, norm_const=c.seq_mean_norm_const)
        tok = self.token_loss(inp, plan, metrics)
        if inp.tis_weight is not None:
            tok = tok * inp.tis_weight.detach()
        pg = aggregate(tok, inp.mask, c.loss_agg_mode, plan.denominators, **agg_kw)
        loss = pg
        valid = inp.mask.bool()
        n = valid.sum()
        if inp.entropy is not None:
            metrics.add("entropy", _msum(inp.entropy.detach(), valid), n)
            if c.entropy_coeff > 0:
                loss = loss - c.entropy_coeff * aggregate(inp.entropy, inp.mask, c.loss_agg_mode, plan.denominators, **agg_kw)
        if c.kl_loss_coef > 0:
            if inp.ref_logp is None:
                raise ValueError("algorithm.kl_loss_coef > 0 needs reference log-probs (PolicyLossInput.ref_logp)")
            kl = kl_penalty(inp.logp, inp.ref_logp, c.kl_loss_type)
            metrics.add("kl_loss", _msum(kl.detach(), valid), n)
            loss = loss + c.kl_loss_coef * aggregate(kl, inp.mask, c.loss_agg_mode, plan.denominators, **agg_kw)
        metrics.add("pg_loss_token_mean", _msum(tok.detach(), valid), n)
        return LossOutput(loss=loss, pg_loss=pg.detach(), metrics=metrics)


POLICY_LOSSES: Dict[str, Type[PolicyLoss]] = {}


def register_policy_loss(name: str) -> Callable[[Type[PolicyLoss]], Type[PolicyLoss]]:
    def deco(cls: Type[PolicyLoss]) -> Type[PolicyLoss]:
        POLICY_LOSSES[name] = cls
        return cls

    return deco


def check_loss_names(cfg: AlgorithmConfig, prefix: str = "algorithm") -> None:
    """The names a loss looks up (``policy_loss``, ``loss_agg_mode``, ``kl_loss_type``) are
    registered; ``ConfigError`` (a ValueError) naming the field otherwise."""
    if cfg.policy_loss not in POLICY_LOSSES:
        raise ConfigError(f"{prefix}.policy_loss must be one of {sorted(POLICY_LOSSES)}, got {cfg.policy_loss!r}")
    if cfg.loss_agg_mode not in AGG_MODES:
        raise ConfigError(f"{prefix}.loss_agg_mode must be one of {sorted(AGG_MODES)}, got {cfg.loss_agg_mode!r}")
    try:
        resolve_kl_type(cfg.kl_loss_type)
    except ValueError as e:
        raise ConfigError(f"{prefix}.kl_loss_type: {e}") from None


def build_policy_loss(cfg: AlgorithmConfig) -> PolicyLoss:
    """The registered loss ``cfg.policy_loss``; validates ``cfg`` first (ValueError naming the field)."""
    cfg.validate()
    check_loss_names(cfg)
    return POLICY_LOSSES[cfg.policy_loss](cfg)


register_policy_loss("vanilla")(PolicyLoss)


@register_policy_loss("stare")
class StareLoss(PolicyLoss):
    """Dual-clip surrogate times STARE weights omega (no grad, no renormalisation)."""

    def _plan(self, plan, mb, dp_group):
        if plan.stare_state is None:
            raise ValueError("algorithm.policy_loss 'stare' needs stare_state=StareController.state in plan()")
        s = self.cfg.stare
        # The gate is the same on every rank (global entropy), so skipping the collective is safe.
        if s.selection_scope == "global" and plan.stare_state.gate_on:
            plan.stare = stare_global_selection(mb.old_logp, mb.advantages, mb.mask, mb.token_keys, s, dp_group=dp_group)

    def token_loss(self, inp, plan, metrics):
        s = self.cfg.stare
        sur = self.surrogate(inp, metrics)
        surprisal = -(inp.old_logp if s.selection_scope == "global" else inp.logp).detach()
        wts = stare_weights(surprisal, inp.advantages, inp.mask, inp.token_keys, s, plan.stare_state, plan.stare)
        valid = inp.mask.bool()
        n = valid.sum()
        metrics.add("stare/positive_candidate_ratio", wts.pos_candidates.sum(), n)
        metrics.add("stare/negative_candidate_ratio", wts.neg_candidates.sum(), n)
        metrics.add("stare/positive_reweight_ratio", wts.pos_selected.sum(), n)
        metrics.add("stare/negative_reweight_ratio", wts.neg_selected.sum(), n)
        metrics.add("stare/mean_weight", _msum(wts.omega, valid), n)
        if not plan.stare_state.gate_on:
            return sur.loss  # bitwise the plain surrogate
        return sur.loss * wts.omega


@register_policy_loss("clip_cov")
class ClipCovLoss(PolicyLoss):
    """Dual-clip surrogate with the loss of the Clip-Cov-picked tokens set to zero."""

    def _plan(self, plan, mb, dp_group):
        c = self.cfg.clip_cov
        if c.selection_scope == "global":
            plan.cov = cov_ops.clip_cov_global_selection(
                mb.old_logp, mb.advantages, mb.mask, mb.token_keys, lb=c.lb, ub=c.ub, ratio=c.ratio,
                seed=c.seed, step=plan.step, dp_group=dp_group)

    def token_loss(self, inp, plan, metrics):
        c = self.cfg.clip_cov
        sur = self.surrogate(inp, metrics)
        drop = cov_ops.clip_cov_mask(inp.logp, inp.old_logp, inp.advantages, inp.mask, inp.token_keys,
                                     lb=c.lb, ub=c.ub, ratio=c.ratio, seed=c.seed, step=plan.step,
                                     clipped=sur.clipped, selection=plan.cov)
        metrics.add("clip_cov/frac", drop.sum(), inp.mask.bool().sum())
        return torch.where(drop, torch.zeros_like(sur.loss), sur.loss)


@register_policy_loss("kl_cov")
class KLCovLoss(PolicyLoss):
    """``-A*rho`` (no clipping) plus ``beta*|log rho|`` on the KL-Cov-selected tokens."""

    def _plan(self, plan, mb, dp_group):
        c = self.cfg.kl_cov
        if c.selection_scope == "global":
            plan.cov = cov_ops.kl_cov_global_selection(mb.old_logp, mb.advantages, mb.mask, mb.token_keys,
                                                       ratio=c.ratio, dp_group=dp_group)

    def token_loss(self, inp, plan, metrics):
        c = self.cfg.kl_cov
        a = broadcast_advantages(inp.advantages, inp.logp)
        log_ratio = torch.clamp(inp.logp - inp.old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        base = -a * torch.exp(log_ratio)
        sel = cov_ops.kl_cov_mask(inp.logp, inp.old_logp, inp.advantages, inp.mask, inp.token_keys,
                                  ratio=c.ratio, selection=plan.cov)
        valid = inp.mask.bool()
        n = valid.sum()
        metrics.add("kl_cov/frac", sel.sum(), n)
        metrics.add("ppo_kl", _msum(-log_ratio.detach(), valid), n)
        return torch.where(sel, base + c.coef * log_ratio.abs(), base)
