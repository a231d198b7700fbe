"""The forward-only log-prob pass: micro-batches in, per-token statistics out.

``forward_token_stats`` runs a model (the policy or the reference) over micro-batches through
Megatron's schedule and returns each micro-batch's ``TokenStats`` on every pipeline stage.
``fill_old_logprobs`` stores them in the micro-batches and returns the step's global
``StepStats`` (the controller's entropy, the token count and the engine mismatch).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_stare.actor.mismatch import engine_mismatch
from megatron_stare.actor.routing_replay import RoutingReplay
from megatron_stare.actor.schedule import broadcast_from_last_stage, run_schedule
from megatron_stare.actor.token_stats import TokenStats, TokenStatsKernel
from megatron_stare.actor.types import StepStats
from megatron_stare.algorithms.aggregation import global_token_mean
from megatron_stare.parallel import ParallelGroups
from megatron_stare.types import MicroBatch, cat_padded


class TokenStatsCollector:
    """Megatron's ``loss_func`` for one micro-batch of a forward-only pass: keeps the
    micro-batch's ``TokenStats`` in ``self.stats`` and hands the schedule a zero loss."""

    def __init__(self, mb: MicroBatch, kernel: TokenStatsKernel, sensitivity: bool):
        self.mb, self.kernel, self.sensitivity = mb, kernel, sensitivity
        self.stats: Optional[TokenStats] = None

    def __call__(self, logits: torch.Tensor):
        o = self.kernel(logits.float() if logits.dtype == torch.float16 else logits, self.mb,
                        entropy_grad=False, sensitivity=self.sensitivity)
        self.stats = TokenStats.from_output(o, self.mb.loss_mask.shape, self.sensitivity)
        return logits.new_zeros(()), {}


@torch.no_grad()
def forward_token_stats(model, micro_batches: List[MicroBatch], kernel: TokenStatsKernel,
                        groups: ParallelGroups, sensitivity: bool,
                        replay: Optional[RoutingReplay] = None) -> List[TokenStats]:
    """Each micro-batch's ``TokenStats`` ``[B, L]``, identical on every rank of its replica.
    ``replay``: route as ``replay`` says (the engine's routes where recorded), and record it."""
    collectors = [TokenStatsCollector(mb, kernel, sensitivity) for mb in micro_batches]
    if replay is None:
        run_schedule(model, micro_batches, collectors, forward_only=True)
    else:
        with replay.recording(micro_batches):
            run_schedule(model, micro_batches, collectors, forward_only=True, before_forward=replay.feed)
    if groups.is_last_stage:
        stats = [c.stats for c in collectors]
    else:
        stats = [TokenStats.zeros(mb.loss_mask.shape, sensitivity, groups.device) for mb in micro_batches]
    broadcast_from_last_stage([t for s in stats for t in s.tensors()], groups)
    return stats


def fill_old_logprobs(model, ref_model, batches: List[List[MicroBatch]], kernel: TokenStatsKernel,
                      groups: ParallelGroups, sensitivity: bool = True,
                      replay: Optional[RoutingReplay] = None) -> StepStats:
    """Fill ``old_logp``, ``entropy`` (and ``sum_p2``/``sum_p2_logp``, ``ref_logp`` when
    ``ref_model``) of every micro-batch; return the global entropy, token count and mismatch.
    ``replay`` (MoE routing replay): the policy's pass routes as it says and records its routing
    in every micro-batch's ``replay``; the reference model routes itself.

    Reductions are over the data x context-parallel group: every rank gets the same values.
    """
    flat = [mb for mini in batches for mb in mini]
    model.eval()
    for mb, s in zip(flat, forward_token_stats(model, flat, kernel, groups, sensitivity, replay)):
        mb.old_logp, mb.entropy = s.logprobs, s.entropy
        mb.sum_p2, mb.sum_p2_logp = s.sum_p2, s.sum_p2_logp
    if ref_model is not None:
        for mb, s in zip(flat, forward_token_stats(ref_model, flat, kernel, groups, False)):
            mb.ref_logp = s.logprobs
    model.train()
    g = groups
    mask = cat_padded([mb.loss_mask for mb in flat], False)
    ent = global_token_mean(cat_padded([mb.entropy for mb in flat]), mask, dp_group=g.dp_cp_group)
    n = torch.tensor([float(mask.sum())], dtype=torch.float64, device=g.device)
    dist.all_reduce(n, group=g.dp_cp_group)
    stats = StepStats(entropy=ent, num_tokens=int(n.item()))
    mismatch = engine_mismatch(flat, g.dp_cp_group, g.device)
    if mismatch is not None:
        stats.mismatch_mean, stats.mismatch_max = mismatch
    return stats
