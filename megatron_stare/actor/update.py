"""The policy update: a loss-function object per micro-batch, an optimizer step per mini-batch.

Plan in, loss out: ``MicroBatchLoss`` takes its mini-batch's ``LossPlan`` explicitly, turns the
last stage's logits into this micro-batch's share of the global loss (scaled for Megatron, see
``aggregation.backward_scale``) and keeps a ``MicroBatchLossResult``. ``train_mini_batch`` runs
the schedule over a mini-batch's micro-batches and takes one guarded optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.actor.diagnostics import selected_token_keys
from megatron_stare.actor.moe_metrics import ExpertLoad
from megatron_stare.actor.optim import guarded_step
from megatron_stare.actor.routing_replay import RoutingReplay
from megatron_stare.actor.schedule import broadcast_from_last_stage, run_schedule
from megatron_stare.actor.token_stats import TokenStatsKernel
from megatron_stare.algorithms.aggregation import MetricSums, backward_scale, sequence_token_counts
from megatron_stare.config.algorithm import StareConfig
from megatron_stare.algorithms.losses import LossPlan, PolicyLoss, PolicyLossInput
from megatron_stare.algorithms.off_policy import OffPolicyCorrection, off_policy_weights
from megatron_stare.runtime.parallel import ParallelGroups
from megatron_stare.types import MicroBatch


@dataclass(frozen=True)
class LossContext:
    """What every micro-batch loss of an update shares."""

    loss_fn: PolicyLoss
    kernel: TokenStatsKernel
    entropy_grad: bool
    """The entropy carries a gradient (entropy bonus on)."""
    off_policy: OffPolicyCorrection
    """The off-policy correction on the engine's log-probs (``algorithms/off_policy.py``)."""
    cp_group: Optional[dist.ProcessGroup]
    """Context-parallel group, None without CP (then sequences are whole on this rank)."""
    stare: StareConfig
    collect_selection: bool = False
    """Also record the STARE-selected token keys (tests, debugging)."""
    fill_old: bool = False
    """No log-prob pass ran (``logprob_pass.logprob_pass_reason``): the forward fills the micro-
    batch's ``old_logp``, ``entropy`` and sensitivity sums, detached, before its loss reads them."""


@dataclass
class MicroBatchLossResult:
    loss: Tensor
    """Detached float64 scalar: this micro-batch's share of the global mini-batch loss."""
    metrics: MetricSums
    selected_keys: Optional[Tensor] = None
    """``[k]`` int64 global keys of the STARE-selected tokens (when collected)."""


class MicroBatchLoss:
    """Megatron's ``loss_func`` for one micro-batch of the update: logits ``[B, L, V/tp]`` ->
    (loss * scale, {}); the unscaled result is kept in ``self.result``."""

    def __init__(self, mb: MicroBatch, plan: LossPlan, ctx: LossContext, scale: float):
        self.mb, self.plan, self.ctx, self.scale = mb, plan, ctx, scale
        self.result: Optional[MicroBatchLossResult] = None

    def policy_loss_input(self, logits: Tensor, metrics: MetricSums) -> PolicyLossInput:
        """The loss's input; adds the off-policy correction's metrics to ``metrics``."""
        mb, ctx = self.mb, self.ctx
        o = ctx.kernel(logits, mb, entropy_grad=ctx.entropy_grad, sensitivity=ctx.fill_old)
        shape = mb.loss_mask.shape
        if ctx.fill_old:  # the batch's one optimizer step: these are the pass's values, unstepped
            mb.old_logp, mb.entropy = o.logprobs.detach().reshape(shape), o.entropy.detach().reshape(shape)
            mb.sum_p2, mb.sum_p2_logp = o.sum_p2.reshape(shape), o.sum_p2_logp.reshape(shape)
        # Under CP a sequence's tokens are spread over the CP ranks: the per-sequence counts of
        # the seq-mean modes must be global.
        seq_tokens = sequence_token_counts(mb.loss_mask, ctx.cp_group) if ctx.cp_group is not None else None
        corr = off_policy_weights(mb.old_logp, mb.engine_logp, mb.loss_mask, ctx.off_policy, ctx.cp_group)
        if corr is not None:
            valid = mb.loss_mask.bool()
            metrics.add("off_policy/masked_frac", (corr.masked & valid).sum(), valid.sum())
            metrics.add("off_policy/weight_mean", corr.weight.double()[valid].sum(), valid.sum())
        return PolicyLossInput(
            logp=o.logprobs.reshape(shape), old_logp=mb.old_logp, advantages=mb.advantages,
            mask=mb.loss_mask, token_keys=mb.token_keys,
            entropy=o.entropy.reshape(shape) if o.entropy is not None else None,
            ref_logp=mb.ref_logp, tis_weight=None if corr is None else corr.weight, seq_num_tokens=seq_tokens,
            old_entropy=mb.entropy, cp_group=ctx.cp_group)

    def __call__(self, logits: Tensor):
        extra = MetricSums()
        out = self.ctx.loss_fn(self.policy_loss_input(logits, extra), self.plan)
        out.metrics.merge(extra)
        selected = None
        if self.ctx.collect_selection and self.plan.stare is not None:
            selected = selected_token_keys(self.mb, self.plan, self.ctx.stare)
        self.result = MicroBatchLossResult(loss=out.loss.detach().double(), metrics=out.metrics,
                                           selected_keys=selected)
        # The schedule divides the returned loss in place: return a fresh tensor.
        return out.loss * self.scale, {}


@dataclass
class MiniBatchResult:
    loss: float
    """Global mini-batch loss (all DP/CP ranks), identical on every rank."""
    grad_norm: float
    optimizer_s: float
    applied: bool
    """False when the non-finite guard skipped the optimizer step."""
    metrics: MetricSums
    """This rank's metric sums (last pipeline stage; empty elsewhere), not yet reduced."""
    selected_keys: List[Tensor] = field(default_factory=list)


def train_mini_batch(model, optimizer, scheduler, micro_batches: Sequence[MicroBatch], plan: LossPlan,
                     ctx: LossContext, groups: ParallelGroups, clip_grad: float,
                     replay: Optional[RoutingReplay] = None,
                     expert_load: Optional[ExpertLoad] = None) -> MiniBatchResult:
    """Forward/backward over the mini-batch's micro-batches and one guarded optimizer step;
    ``replay``: every forward (and recompute) routes as the log-prob pass recorded;
    ``expert_load``: told each micro-batch's real tokens before its forward."""
    scale = backward_scale(grad_reduce_divisor=groups.layout.dp, schedule_divisor=len(micro_batches))
    losses = [MicroBatchLoss(mb, plan, ctx, scale) for mb in micro_batches]
    feeds = [f.feed for f in (replay, expert_load) if f is not None]

    def before_forward(mb: MicroBatch) -> None:
        for feed in feeds:
            feed(mb)

    model.zero_grad_buffer()
    optimizer.zero_grad()
    run_schedule(model, micro_batches, losses, forward_only=False, before_forward=before_forward)
    if replay is not None:
        replay.done()
    step_loss = torch.zeros((), dtype=torch.float64, device=groups.device)
    metrics = MetricSums()
    selected: List[Tensor] = []
    for r in (mbl.result for mbl in losses if mbl.result is not None):  # last stage only
        step_loss = step_loss + r.loss
        metrics.merge(r.metrics)
        if r.selected_keys is not None:
            selected.append(r.selected_keys)
    loss_t = step_loss.reshape(1).clone()
    dist.all_reduce(loss_t, group=groups.dp_cp_group)
    broadcast_from_last_stage([loss_t], groups)
    outcome = guarded_step(optimizer, scheduler, clip_grad, float(loss_t))
    return MiniBatchResult(loss=float(loss_t), grad_norm=outcome.grad_norm, optimizer_s=outcome.seconds,
                           applied=outcome.applied,
                           metrics=metrics, selected_keys=selected)
