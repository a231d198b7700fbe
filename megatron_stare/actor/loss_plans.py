"""One ``LossPlan`` per optimizer mini-batch: the global denominators and selections.

A plan is computed once per mini-batch, before any backward, from this rank's whole mini-batch
(all its micro-batches) and collectives over the data x context-parallel group; every rank then
holds the same plan. The update's loss functions and the diagnostics both read it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from megatron_stare.algorithms.losses import LossPlan, MiniBatchInput, PolicyLoss
from megatron_stare.algorithms.stare import StareState
from megatron_stare.runtime.parallel import ParallelGroups
from megatron_stare.types import MicroBatch, cat_padded


def mini_batch_input(micro_batches: Sequence[MicroBatch]) -> MiniBatchInput:
    """This rank's whole mini-batch, rows concatenated and right-padded: ``[N, T]``; ``old_logp``
    None before an update that fills it (no log-prob pass: only a loss whose plan reads no
    old log-probs gets there)."""
    return MiniBatchInput(
        old_logp=(cat_padded([mb.old_logp for mb in micro_batches])
                  if all(mb.old_logp is not None for mb in micro_batches) else None),
        advantages=torch.cat([mb.advantages for mb in micro_batches]),
        mask=cat_padded([mb.loss_mask for mb in micro_batches], False),
        token_keys=cat_padded([mb.token_keys for mb in micro_batches]),
        entropy=(cat_padded([mb.entropy for mb in micro_batches])
                 if all(mb.entropy is not None for mb in micro_batches) else None))


def plan_mini_batch(loss_fn: PolicyLoss, micro_batches: Sequence[MicroBatch], groups: ParallelGroups,
                    step: int, stare_state: Optional[StareState]) -> LossPlan:
    """The plan of one mini-batch (collective over ``groups.dp_cp_group``)."""
    lay = groups.layout
    return loss_fn.plan(mini_batch_input(micro_batches), dp_group=groups.dp_cp_group,
                        cp_group=groups.cp_group if lay.cp > 1 else None,
                        step=step, stare_state=stare_state)


def plan_step(loss_fn: PolicyLoss, batches: Sequence[Sequence[MicroBatch]], groups: ParallelGroups,
              step: int, stare_state: Optional[StareState]) -> List[LossPlan]:
    """The plans of every mini-batch of the step, in order."""
    return [plan_mini_batch(loss_fn, mbs, groups, step, stare_state) for mbs in batches]
