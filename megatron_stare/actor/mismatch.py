"""How far the rollout engine's log-probs are from the trainer's, over the whole batch."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_stare.actor.tis import ratio_band_mask
from megatron_stare.types import MicroBatch


def engine_mismatch(micro_batches: Sequence[MicroBatch], group: Optional[dist.ProcessGroup],
                    device) -> Optional[Tuple[float, float]]:
    """(mean, max) of ``|engine_logp - old_logp|`` over the response tokens of every rank of
    ``group`` (data x context parallel); None unless every micro-batch has engine log-probs."""
    if not all(mb.engine_logp is not None for mb in micro_batches):
        return None
    diff = torch.cat([(mb.engine_logp - mb.old_logp).abs()[mb.loss_mask] for mb in micro_batches]).double()
    agg = torch.stack([diff.sum(), torch.tensor(float(diff.numel()), dtype=torch.float64, device=device)])
    dist.all_reduce(agg, group=group)
    mx = diff.max() if diff.numel() else torch.zeros((), dtype=torch.float64, device=device)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    return float(agg[0] / agg[1].clamp(min=1)), float(mx)


def band_masked_fraction(micro_batches: Sequence[MicroBatch], band: Tuple[float, float],
                         group: Optional[dist.ProcessGroup], device) -> Optional[float]:
    """Fraction of the response tokens of every rank of ``group`` whose ratio
    ``exp(old_logp - engine_logp)`` lies outside ``band`` (the tokens the off-policy mask leaves
    out of the loss, ``actor/tis.py``); None unless every micro-batch has engine log-probs."""
    if not all(mb.engine_logp is not None for mb in micro_batches):
        return None
    out = sum(float((~ratio_band_mask(mb.old_logp, mb.engine_logp, band))[mb.loss_mask].sum())
              for mb in micro_batches)
    agg = torch.tensor([out, float(sum(int(mb.loss_mask.sum()) for mb in micro_batches))],
                       dtype=torch.float64, device=device)
    dist.all_reduce(agg, group=group)
    return float(agg[0] / agg[1].clamp(min=1))
