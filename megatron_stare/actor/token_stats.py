"""Logits of one micro-batch -> per-token statistics over the tensor-parallel vocab shards."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.ops.vocab_parallel import LogProbOutput, vocab_parallel_logprobs_entropy
from megatron_stare.types import MicroBatch


@dataclass(frozen=True)
class TokenStatsKernel:
    """``vocab_parallel_logprobs_entropy`` bound to the model's vocabulary and the rollout's
    temperature; called on the ``[B, L, V/tp]`` logits of one micro-batch."""

    tp_group: Optional[dist.ProcessGroup]
    valid_vocab_size: int
    temperature: float
    chunk_size: int

    def __call__(self, logits: Tensor, mb: MicroBatch, *, entropy_grad: bool,
                 sensitivity: bool) -> LogProbOutput:
        """``LogProbOutput`` with flat ``[B*L]`` tensors (identical on every TP rank).

        ``logits``: ``[B, L, V/tp]``, or ``[1, t, V/tp]`` of a packed row, whose per-token results
        are gathered into the ``[B, L]`` layout (``PackedRow.index``; the gather carries the
        gradient back to the row).
        """
        b, l, v = logits.shape
        targets = mb.targets if mb.packed is None else mb.packed.targets
        o = vocab_parallel_logprobs_entropy(
            logits.reshape(b * l, v), targets.reshape(-1), tp_group=self.tp_group,
            valid_vocab_size=self.valid_vocab_size, temperature=self.temperature,
            with_entropy=True, entropy_grad=entropy_grad, with_sensitivity=sensitivity,
            chunk_size=self.chunk_size)
        if mb.packed is None:
            return o
        index = mb.packed.index.reshape(-1)
        return dataclasses.replace(o, **{f.name: getattr(o, f.name)[index] for f in dataclasses.fields(o)
                                         if isinstance(getattr(o, f.name), Tensor)})


@dataclass
class TokenStats:
    """Forward-only statistics of one micro-batch, all ``[B, L]`` float (no grad)."""

    logprobs: Tensor
    entropy: Tensor
    sum_p2: Optional[Tensor] = None
    """``sum_j p_j^2`` (sensitivity pass only)."""
    sum_p2_logp: Optional[Tensor] = None
    """``sum_j p_j^2 log p_j`` (sensitivity pass only)."""

    @classmethod
    def from_output(cls, o: LogProbOutput, shape, sensitivity: bool) -> "TokenStats":
        if sensitivity:
            return cls(o.logprobs.reshape(shape), o.entropy.reshape(shape), o.sum_p2.reshape(shape),
                       o.sum_p2_logp.reshape(shape))
        return cls(o.logprobs.reshape(shape), o.entropy.reshape(shape))

    @classmethod
    def zeros(cls, shape, sensitivity: bool, device) -> "TokenStats":
        """Placeholders for a pipeline stage without logits (filled by the broadcast)."""
        z = lambda: torch.zeros(shape, device=device)  # noqa: E731
        return cls(z(), z(), z(), z()) if sensitivity else cls(z(), z())

    def tensors(self) -> List[Tensor]:
        return [t for t in (self.logprobs, self.entropy, self.sum_p2, self.sum_p2_logp) if t is not None]
