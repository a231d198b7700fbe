"""Loss aggregation with exact global denominators, and additive metric sums.

The contract (why the result does not depend on the parallel layout):

1. Before the backward passes of an optimizer mini-batch, every rank calls
   ``compute_loss_denominators(mask_of_its_whole_minibatch, dp_group=..., cp_group=...)``
   once. Counts are all-reduced, so every rank holds the same ``LossDenominators``.
2. Each micro-batch's loss is ``sum over its valid tokens (or sequences) / global denominator``.
   Summed over all micro-batches and all ranks this is exactly the mini-batch's global loss, so
   the summed gradient is exactly the gradient of the global loss, for any micro-batch size,
   data-parallel degree or context-parallel split.
3. Frameworks rescale what they are given. megatron-core (0.16), when the loss function returns
   the 2-tuple ``(loss, reduced)``: the schedule multiplies each micro-batch loss by
   ``cp_size / num_microbatches`` and DDP scales the reduced gradients by ``1 / (dp_size*cp_size)``.
   ``backward_scale`` is the factor the caller multiplies the micro-batch loss by (inside the loss
   function, before Megatron sees it) so that the reduced gradient is the SUM above; for those
   defaults it is ``dp_size * num_microbatches`` (the cp factors cancel). Do not use Megatron's
   3-tuple/per-token path with these losses: it renormalises by its own token count.

Groups: ``dp_group`` is the group over which the mini-batch's tokens are partitioned (with context
parallelism, the combined data×context-parallel group); ``cp_group`` the context-parallel group
whose ranks hold different chunks of the same sequences (None without CP).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron_stare.config.dotted import registrar
from torch import Tensor


def all_reduce_sum(t: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Sum ``t`` in place over ``group``; no-op when ``group`` is None or not distributed."""
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _is_first_cp_rank(cp_group: Optional[dist.ProcessGroup]) -> bool:
    return cp_group is None or dist.get_rank(group=cp_group) == 0


def sequence_token_counts(mask: Tensor, cp_group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Valid tokens per sequence, ``[B]`` float64, summed over the context-parallel chunks.

    Needed for ``seq-mean-token-mean`` under context parallelism (pass it as
    ``PolicyLossInput.seq_num_tokens``); without CP it is ``mask.sum(-1)``.
    """
    counts = mask.sum(-1, dtype=torch.float64)
    return all_reduce_sum(counts, cp_group)


@dataclass(frozen=True)
class LossDenominators:
    """Global counts of one optimizer mini-batch; identical on every rank."""

    num_tokens: float
    """Valid response tokens in the whole mini-batch (all micro-batches, DP and CP ranks)."""
    num_seqs: float
    """Sequences with at least one valid token in the whole mini-batch."""


def compute_loss_denominators(
    mask: Tensor,
    *,
    dp_group: Optional[dist.ProcessGroup] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
) -> LossDenominators:
    """Count the mini-batch globally; call once per mini-batch, before any backward.

    mask: ``[N, T]`` bool, this rank's rows of the WHOLE mini-batch (all its micro-batches; with CP
    this rank's chunk of each row). One all-reduce over ``cp_group`` (per-row counts, only with CP)
    and one over ``dp_group`` (tokens and sequences).
    """
    row_tokens = sequence_token_counts(mask, cp_group)
    # Every CP rank holds the same rows: count the sequences on the first CP rank only.
    seqs = (row_tokens > 0).sum(dtype=torch.float64) if _is_first_cp_rank(cp_group) else row_tokens.new_zeros(())
    local_tokens = mask.sum(dtype=torch.float64)
    totals = all_reduce_sum(torch.stack([local_tokens, seqs]), dp_group)
    return LossDenominators(num_tokens=float(totals[0]), num_seqs=float(totals[1]))


def global_token_mean(x: Tensor, mask: Tensor, *, dp_group: Optional[dist.ProcessGroup] = None) -> float:
    """Token-mean of ``x`` ``[N, T]`` over the valid tokens of all ranks of ``dp_group`` (float64).

    E.g. the STARE controller's input: the old-log-prob-pass entropy of the whole training batch.
    NaN when there is no valid token (the controller then keeps its state).
    """
    valid = mask.bool()
    total = torch.where(valid, x.detach().to(torch.float64), torch.zeros((), dtype=torch.float64, device=x.device))
    sums = all_reduce_sum(torch.stack([total.sum(), valid.sum(dtype=torch.float64)]), dp_group)
    n = float(sums[1])
    return float(sums[0]) / n if n > 0 else float("nan")


def backward_scale(*, grad_reduce_divisor: float, schedule_divisor: float = 1.0) -> float:
    """Factor to multiply each micro-batch loss by before ``backward`` (see the module docstring).

    ``grad_reduce_divisor``: the net factor the gradient reduction divides by (an averaging DDP
    over dp ranks: ``dp_size``; Megatron with CP: ``dp_size*cp_size`` divided by the ``cp_size`` its
    schedule multiplied in, i.e. ``dp_size``; a summing reducer: 1). ``schedule_divisor``: what the
    pipeline schedule divides each loss by (Megatron 2-tuple loss: ``num_microbatches``).
    """
    return float(grad_reduce_divisor) * float(schedule_divisor)


# ---------------------------------------------------------------------------------------------
# Aggregation modes: x [B, T] token values (already zero at invalid tokens), mask [B, T]
# -> scalar contribution of this micro-batch.
AggFn = Callable[[Tensor, Tensor, LossDenominators, Tensor, Optional[float]], Tensor]
AGG_MODES: Dict[str, AggFn] = {}


register_agg_mode = registrar(AGG_MODES, "aggregation mode")


def _safe(d: float) -> float:
    # An empty mini-batch contributes 0 (with a graph), not NaN.
    return d if d > 0 else 1.0


@register_agg_mode("token-mean")
def _token_mean(x, mask, den, seq_tokens, const):
    return x.sum() / _safe(den.num_tokens)


@register_agg_mode("seq-mean-token-mean")
def _seq_mean_token_mean(x, mask, den, seq_tokens, const):
    per_seq = x.sum(-1) / seq_tokens.clamp(min=1).to(x.dtype)
    return per_seq.sum() / _safe(den.num_seqs)


@register_agg_mode("seq-mean-token-sum")
def _seq_mean_token_sum(x, mask, den, seq_tokens, const):
    return x.sum() / _safe(den.num_seqs)


@register_agg_mode("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(x, mask, den, seq_tokens, const):
    # Dr.GRPO: mean over sequences of (token sum / constant), the constant e.g. the max length.
    if const is None or const <= 0:
        raise ValueError("algorithm.seq_mean_norm_const must be > 0 for loss_agg_mode 'seq-mean-token-sum-norm'")
    return x.sum() / (_safe(den.num_seqs) * const)


def aggregate(
    x: Tensor,
    mask: Tensor,
    mode: str,
    denominators: LossDenominators,
    *,
    seq_num_tokens: Optional[Tensor] = None,
    norm_const: Optional[float] = None,
) -> Tensor:
    """This micro-batch's share of the mini-batch aggregate of token values ``x`` ``[B, T]``.

    Summing the returned scalars over all micro-batches and ranks gives the global aggregate.
    ``seq_num_tokens`` ``[B]``: full-sequence valid counts (only needed with CP); default
    ``mask.sum(-1)``.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"algorithm.loss_agg_mode must be one of {sorted(AGG_MODES)}, got {mode!r}")
    if seq_num_tokens is None:
        seq_num_tokens = mask.sum(-1)
    # where, not x*mask: padded positions may hold inf/NaN (0*NaN = NaN), and get zero grad.
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return AGG_MODES[mode](x, mask, denominators, seq_num_tokens, norm_const)


# ---------------------------------------------------------------------------------------------
@dataclass
class MetricSums:
    """Additive metric accumulators ``name -> (sum, count)`` (float64 scalars).

    Merge over micro-batches, ``all_reduce`` over ranks (one collective), then ``means()`` gives
    exact global means (sum / count), independent of the layout.
    """

    sums: Dict[str, Tensor] = field(default_factory=dict)
    counts: Dict[str, Tensor] = field(default_factory=dict)

    def add(self, name: str, total, count) -> None:
        # Kept on their device (no host sync per micro-batch); moved once in all_reduce/means.
        total = torch.as_tensor(total).detach().to(torch.float64)
        count = torch.as_tensor(count).detach().to(torch.float64)
        if name in self.sums:
            self.sums[name] = self.sums[name] + total.to(self.sums[name].device)
            self.counts[name] = self.counts[name] + count.to(self.counts[name].device)
        else:
            self.sums[name], self.counts[name] = total, count

    def merge(self, other: "MetricSums") -> "MetricSums":
        for name in other.sums:
            self.add(name, other.sums[name], other.counts[name])
        return self

    def all_reduce(self, group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None) -> "MetricSums":
        """Sum over ``group`` in place (on ``device``: CPU for gloo, CUDA for NCCL).

        Every rank must hold the same names; the losses add every name on every call, even when
        a micro-batch has no tokens, so this holds.
        """
        names: List[str] = sorted(self.sums)
        if not names:
            return self
        device = device if device is not None else self.sums[names[0]].device
        flat = torch.stack([self.sums[n].to(device) for n in names] + [self.counts[n].to(device) for n in names])
        flat = all_reduce_sum(flat, group).cpu()
        for i, n in enumerate(names):
            self.sums[n], self.counts[n] = flat[i], flat[len(names) + i]
        return self

    def means(self) -> Dict[str, float]:
        return {n: float(self.sums[n] / self.counts[n]) if self.counts[n] > 0 else 0.0 for n in sorted(self.sums)}
