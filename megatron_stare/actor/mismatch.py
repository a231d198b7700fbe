"""How far the rollout engine's log-probs are from the trainer's, over the whole batch."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_stare.algorithms.off_policy import OffPolicyCorrection, off_policy_weights
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


def masked_fraction(micro_batches: Sequence[MicroBatch], correction: OffPolicyCorrection,
                    group: Optional[dist.ProcessGroup], cp_group: Optional[dist.ProcessGroup],
                    device) -> Optional[float]:
    """Fraction of the response tokens of every rank of ``group`` (data x context parallel) that
    ``correction`` masks (``algorithms/off_policy.py``; ``cp_group`` for its per-sequence rules);
    None unless every micro-batch has engine log-probs."""
    if not all(mb.engine_logp is not None for mb in micro_batches):
        return None
    out = torch.zeros(2, dtype=torch.float64, device=device)
    for mb in micro_batches:
        w = off_policy_weights(mb.old_logp, mb.engine_logp, mb.loss_mask, correction, cp_group)
        valid = mb.loss_mask.bool()
        out += torch.stack([(w.masked & valid).sum(dtype=torch.float64), valid.sum(dtype=torch.float64)]).to(device)
    dist.all_reduce(out, group=group)
    return float(out[0] / out[1].clamp(min=1))
