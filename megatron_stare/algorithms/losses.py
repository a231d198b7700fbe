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

Registered names: ``vanilla`` (dual-clip surrogate = GRPO/DAPO/PPO), ``stare``, ``clip_cov``, ``kl_cov``,
``gspo`` (sequence-level ratio), ``cispo`` (clipped detached IS weight on every token),
``forking_tokens`` (the surrogate on the top-rho entropy tokens of the mini-batch).
Total loss = agg(policy token loss) - entropy_coeff * agg(H) + kl_loss_coef * agg(KL(pi || pi_ref)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Type

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.algorithms import cov as cov_ops
from megatron_stare.algorithms.aggregation import (AGG_MODES, LossDenominators, MetricSums, aggregate,
                                                   compute_loss_denominators)
from megatron_stare.config.algorithm import AlgorithmConfig
from megatron_stare.algorithms.kl import kl_penalty, resolve_kl_type
from megatron_stare.algorithms.off_policy import sequence_sums
from megatron_stare.config.fields import ConfigError
from megatron_stare.algorithms.stare import (StareSelection, StareState, broadcast_advantages, stare_global_selection,
                                             stare_k, stare_weights)
from megatron_stare.ops.selection import TopKThreshold, topk_threshold
from megatron_stare.config.dotted import registrar

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
    """Off-policy correction weights (no grad; ``algorithms/off_policy.py``: TIS ``min(pi_old /
    pi_engine, C)``, MIS, masks) that correct the train/inference mismatch; multiply each token's
    policy loss."""
    old_entropy: Optional[Tensor] = None
    """Old-log-prob-pass entropy (no grad); ``forking_tokens`` selects by it."""
    cp_group: Optional[dist.ProcessGroup] = None
    """Context-parallel group when rows are split over its ranks (None: rows are whole here);
    ``gspo`` all-reduces its per-sequence sums over it."""


@dataclass
class MiniBatchInput:
    """This rank's WHOLE optimizer mini-batch (all its micro-batches), old-log-prob pass, ``[N, T]``."""

    old_logp: Optional[Tensor]
    """None when no log-prob pass ran (only for a loss with ``plan_reads_old_logprobs`` False)."""
    advantages: Tensor
    mask: Tensor
    token_keys: Tensor
    entropy: Optional[Tensor] = None
    """Old-log-prob-pass entropy ``[N, T]`` (``forking_tokens``' selection)."""


@dataclass
class LossPlan:
    """Computed once per mini-batch before the backward passes; identical on every rank."""

    denominators: LossDenominators
    step: int = 0
    stare_state: Optional[StareState] = None
    stare: Optional[StareSelection] = None
    cov: Optional[cov_ops.CovSelection] = None
    forking: Optional[TopKThreshold] = None
    """The global top-rho entropy threshold (``forking_tokens``)."""
    forking_scale: float = 1.0
    """Factor on the kept tokens' losses: N/k with normalizer 'selected', else 1."""


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

    plan_reads_old_logprobs: bool = False
    """The plan selects tokens by the old-log-prob pass's values (log-probs, entropy), or the
    loss needs the controller's state of this step's entropy: then the pass must run before any
    backward. False: only the response mask, so the update's own forward can stand in for the
    pass when the batch gets one optimizer step (``actor/logprob_pass.logprob_pass_reason``)."""

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


register_policy_loss = registrar(POLICY_LOSSES, "policy loss")


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

    plan_reads_old_logprobs = True

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

    plan_reads_old_logprobs = True

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

    plan_reads_old_logprobs = True

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


@register_policy_loss("gspo")
class GspoLoss(PolicyLoss):
    """GSPO: ``s = exp(mean_t log(pi/pi_old))`` per response, ``max(-A*s, -A*clip(s, 1-eps_lo, 1+eps_hi))``.

    Written per token (verl's form): every token of a response carries the value ``s`` and the
    gradient ``s * dlogp_t``, so ``seq-mean-token-mean`` (the paper's mean over responses) gives
    exactly GSPO's loss and gradient ``ds = s * mean_t dlogp_t``; other aggregation modes weight
    the responses as they weight tokens (``token-mean``: by length). The clip is decided by ``s``,
    the same for all a response's tokens. The mean over a response spans its CP chunks
    (``inp.cp_group``). No dual clip (the paper has none).
    """

    def token_loss(self, inp, plan, metrics):
        c = self.cfg.gspo
        a = broadcast_advantages(inp.advantages, inp.logp)
        log_ratio = torch.clamp(inp.logp - inp.old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        total, count = sequence_sums(log_ratio, inp.mask, inp.cp_group)
        log_s = (total / count.clamp(min=1)).to(inp.logp.dtype).unsqueeze(-1)
        s = torch.exp(log_s + log_ratio - log_ratio.detach())  # value s, gradient s * dlogp_t
        l1 = -a * s
        l2 = -a * torch.clamp(s, 1.0 - c.clip_ratio_low, 1.0 + c.clip_ratio_high)
        valid = inp.mask.bool()
        n = valid.sum()
        metrics.add("pg_clipfrac", ((l2 > l1) & valid).sum(), n)
        metrics.add("ppo_kl", _msum(-log_ratio.detach(), valid), n)
        metrics.add("gspo/seq_log_ratio", _msum(log_s.detach().expand_as(log_ratio), valid), n)
        return torch.maximum(l1, l2)


@register_policy_loss("cispo")
class CispoLoss(PolicyLoss):
    """CISPO: ``-sg(min(r, 1+eps_hi)) * A * logp`` on every token (optional lower clip); no token
    loses its gradient, the weight carries none."""

    def token_loss(self, inp, plan, metrics):
        c = self.cfg.cispo
        a = broadcast_advantages(inp.advantages, inp.logp)
        log_ratio = torch.clamp(inp.logp - inp.old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).detach()
        r = torch.exp(log_ratio)
        low = None if c.clip_ratio_low is None else 1.0 - c.clip_ratio_low
        w = torch.clamp(r, min=low, max=1.0 + c.clip_ratio_high)
        valid = inp.mask.bool()
        n = valid.sum()
        metrics.add("pg_clipfrac", ((w != r) & valid).sum(), n)
        metrics.add("ppo_kl", _msum(-log_ratio, valid), n)
        return -w * a * inp.logp


@register_policy_loss("forking_tokens")
class ForkingTokensLoss(PolicyLoss):
    """The dual-clip surrogate (DAPO's clip-higher with the default eps 0.2/0.28) on the top-rho
    fraction of the mini-batch's valid tokens by old-log-prob-pass entropy, zero elsewhere.

    Selection: exact global top-k over the data(x context)-parallel group, k = min(N, max(1,
    ceil(rho*N))), ties at the threshold to the smaller token key (``ops/selection.py``): the same
    set for every layout. Normaliser: the aggregation's (all valid tokens) by default, or the
    kept count (``normalizer: selected``, a factor N/k on the kept tokens). rho = 1 gives the base
    loss bitwise.
    """

    plan_reads_old_logprobs = True

    def _plan(self, plan, mb, dp_group):
        f = self.cfg.forking_tokens
        if mb.entropy is None:
            raise ValueError("algorithm.policy_loss 'forking_tokens' needs the old-log-prob pass's entropy "
                             "(MiniBatchInput.entropy)")
        valid = mb.mask.bool()
        thr = topk_threshold(mb.entropy.detach()[valid], mb.token_keys[valid], lambda n: stare_k(n, f.rho),
                             group=dp_group)
        plan.forking = thr
        if f.normalizer == "selected" and 0 < thr.k < thr.n:
            plan.forking_scale = thr.n / thr.k

    def token_loss(self, inp, plan, metrics):
        if inp.old_entropy is None or plan.forking is None:
            raise ValueError("algorithm.policy_loss 'forking_tokens' needs PolicyLossInput.old_entropy and "
                             "a plan from ForkingTokensLoss.plan")
        sur = self.surrogate(inp, metrics)
        valid = inp.mask.bool()
        kept = plan.forking.select(inp.old_entropy.detach().reshape(-1), inp.token_keys.reshape(-1))
        kept = kept.reshape(valid.shape) & valid
        metrics.add("forking/kept_frac", kept.sum(), valid.sum())
        loss = torch.where(kept, sur.loss, torch.zeros_like(sur.loss))
        return loss * plan.forking_scale if plan.forking_scale != 1.0 else loss
