"""The forward-only log-prob pass: micro-batches in, per-token statistics out.

``forward_token_stats`` runs a model (the policy or the reference) over micro-batches through
Megatron's schedule and returns each micro-batch's ``TokenStats`` on every pipeline stage.
``fill_old_logprobs`` stores them in the micro-batches and returns the step's global
``StepStats`` (the controller's entropy, the token count and the engine mismatch).
``logprob_pass_reason`` says when the pass is needed at all: with one optimizer step per batch
and a loss that plans without them, the update's forward fills the same fields
(``update.LossContext.fill_old``), and ``step_stats`` reads them afterwards.
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
from megatron_stare.algorithms.losses import PolicyLoss
from megatron_stare.runtime.parallel import ParallelGroups
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
        fill_reference_logprobs(ref_model, flat, kernel, groups)
    model.train()
    return step_stats(flat, groups)


def fill_reference_logprobs(ref_model, flat: List[MicroBatch], kernel: TokenStatsKernel,
                            groups: ParallelGroups) -> None:
    """Fill ``ref_logp`` of every micro-batch with the reference model's forward-only pass."""
    for mb, s in zip(flat, forward_token_stats(ref_model, flat, kernel, groups, False)):
        mb.ref_logp = s.logprobs


def step_stats(flat: List[MicroBatch], groups: ParallelGroups) -> StepStats:
    """The step's global entropy, token count and engine mismatch from the micro-batches'
    filled ``old_logp``/``entropy``; reductions over the data x context-parallel group."""
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


def share_update_stats(flat: List[MicroBatch], groups: ParallelGroups) -> None:
    """After an update that filled the pass's fields from its forward (``LossContext.fill_old``,
    last pipeline stage only): the same values on every stage."""
    if groups.layout.pp == 1:
        return
    if not groups.is_last_stage:
        for mb in flat:
            s = TokenStats.zeros(mb.loss_mask.shape, True, groups.device)
            mb.old_logp, mb.entropy, mb.sum_p2, mb.sum_p2_logp = s.tensors()
    broadcast_from_last_stage([t for mb in flat for t in (mb.old_logp, mb.entropy, mb.sum_p2, mb.sum_p2_logp)],
                              groups)


def logprob_pass_reason(mode: str, loss_fn: PolicyLoss, *, mini_batches: int, ppo_epochs: int,
                        gepo: bool, routing_replay: str) -> Optional[str]:
    """Why the step needs the separate forward-only pass; None when the update's forward can
    stand in for it (``mode`` 'auto', trainer.logprob_pass).

    It can when the batch gets exactly one optimizer step (one mini-batch, one epoch): the
    update's one forward then runs at the weights the pass would run at, so its detached
    log-probs ARE the old log-probs (ratio exactly 1, the clip inactive, as in TRL and verl with
    one update per batch) and its entropy and sensitivity sums are the pass's. It cannot when
    anything reads those values before the first backward: a loss whose plan selects tokens by
    them (STARE's gate and selection, Clip-Cov, KL-Cov, forking tokens), GEPO's group shaping, or
    MoE routing replay (the pass records the routes the update replays).
    """
    if mode == "always":
        return "trainer.logprob_pass is 'always'"
    if mini_batches != 1 or ppo_epochs != 1:
        return f"{mini_batches} mini-batch(es) x {ppo_epochs} epoch(s): later steps are off the sampling policy"
    if loss_fn.plan_reads_old_logprobs:
        return f"loss '{loss_fn.cfg.policy_loss}' selects tokens by them before the update"
    if gepo:
        return "GEPO shapes the advantages by them before the update"
    if routing_replay != "none":
        return f"routing replay {routing_replay} records in that pass the routes the update replays"
    return None
