"""Diagnostics of the update read from the loss plans: entropy dynamics and STARE selections.

Nothing here re-derives a selection: the STARE thresholds come from each mini-batch's
``LossPlan`` (``plan.stare``), the same object the loss functions apply.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.actor.loss_plans import mini_batch_input
from megatron_stare.config.algorithm import AlgorithmConfig, StareConfig
from megatron_stare.algorithms.diagnostics import entropy_dynamics
from megatron_stare.algorithms.losses import LossPlan, MiniBatchInput
from megatron_stare.algorithms.stare import stare_weights
from megatron_stare.runtime.parallel import ParallelGroups
from megatron_stare.types import MicroBatch, cat_padded

DYNAMICS_KEYS = ("pred_dH", "cov", "frac_pos_high", "frac_pos_low", "frac_neg_high", "frac_neg_low")


def selected_token_keys(mb: MicroBatch, plan: LossPlan, cfg: StareConfig) -> Tensor:
    """``[k]`` global keys of the tokens of ``mb`` that ``plan``'s STARE selection reweights."""
    w = stare_weights(-mb.old_logp, mb.advantages, mb.loss_mask, mb.token_keys, cfg,
                      plan.stare_state, plan.stare)
    return mb.token_keys[w.pos_selected | w.neg_selected]


def gather_selected_keys(selected: List[Tensor], groups: ParallelGroups) -> List[int]:
    """Sorted union of every DP/CP rank's selected keys, on every rank (test-sized batches)."""
    local = torch.cat(selected).tolist() if selected else []
    obj = [None] * dist.get_world_size(groups.dp_cp_group)
    dist.all_gather_object(obj, local, group=groups.dp_cp_group)
    keys = sorted({k for part in obj for k in part})
    shared = [keys if groups.is_last_stage else None]
    if groups.layout.pp > 1:
        dist.broadcast_object_list(shared, src=groups.pp_last_rank, group=groups.pp_group)
    return shared[0]


def stare_omega(mini: MiniBatchInput, plan: LossPlan, algo: AlgorithmConfig) -> Optional[Tensor]:
    """STARE weights ``[N, T]`` of the mini-batch under ``plan``; None (all ones) unless the
    loss is STARE with the gate on. In microbatch scope (no global selection in the plan) this
    is the top-k over this rank's whole mini-batch, an approximation of the per-micro-batch loss."""
    state = plan.stare_state
    if algo.policy_loss != "stare" or state is None or not state.gate_on:
        return None
    return stare_weights(-mini.old_logp, mini.advantages, mini.mask, mini.token_keys, algo.stare,
                         state, plan.stare).omega


@torch.no_grad()
def entropy_diagnostics(batches: Sequence[Sequence[MicroBatch]], plans: Sequence[LossPlan],
                        algo: AlgorithmConfig, group: Optional[dist.ProcessGroup]) -> Dict[str, float]:
    """Entropy-dynamics diagnostics of the step (algorithms.md): predicted entropy change
    ``pred_dH = mean_t(omega*A*S)`` with the plans' STARE weights, the log-prob/advantage
    covariance and the four advantage-surprisal quadrant fractions; global over ``group``
    (data x context parallel), token-weighted over mini-batches. Needs the sensitivity sums of
    the log-prob pass."""
    totals: Dict[str, float] = {}
    n_all = 0.0
    for micro_batches, plan in zip(batches, plans):
        mini = mini_batch_input(micro_batches)
        cat = lambda name: cat_padded([getattr(m, name) for m in micro_batches])  # noqa: E731
        d = entropy_dynamics(mini.old_logp, mini.advantages, mini.mask, cat("entropy"), cat("sum_p2"),
                             cat("sum_p2_logp"), stare_omega(mini, plan, algo), dp_group=group)
        for k in DYNAMICS_KEYS:
            totals[k] = totals.get(k, 0.0) + getattr(d, k) * d.num_tokens
        n_all += d.num_tokens
    return {f"dynamics/{k}": v / max(n_all, 1.0) for k, v in totals.items()}
