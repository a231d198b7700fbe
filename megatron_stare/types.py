"""Typed state that crosses module boundaries: rollout samples and padded micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import Tensor

#: Token keys are ``sample_id * KEY_STRIDE + response_position``: unique, and independent of how
#: samples are dealt over ranks and micro-batches (the tie-break of the exact selections).
KEY_STRIDE = 1 << 24


@dataclass
class Sample:
    """One response of the step's rollout batch."""

    sample_id: int
    """Index in the step's global batch; the layout-independent identity of the sample."""
    group_id: int
    """Prompt index within the step (the GRPO group)."""
    prompt_ids: List[int]
    response_ids: List[int]
    reward: float = 0.0
    advantage: float = 0.0
    engine_logprobs: Optional[List[float]] = None
    """Per response token log-prob reported by the rollout engine (for mismatch metrics / TIS)."""
    finish_reason: str = "stop"
    metadata: Dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MicroBatch:
    """A right-padded micro-batch of whole sequences, ``[B, L]`` unless noted.

    Position ``t`` of ``targets`` is token ``t + 1`` of the sequence, predicted from position
    ``t``; ``loss_mask`` marks the targets that are response tokens. Padding is at the end, so
    causal attention keeps it out of every real position.
    """

    input_ids: Tensor
    position_ids: Tensor
    targets: Tensor
    loss_mask: Tensor
    token_keys: Tensor
    """int64 global token keys (``KEY_STRIDE``); 0 where masked."""
    advantages: Tensor
    """``[B]`` trajectory advantages."""
    sample_ids: Tensor
    """``[B]`` int64."""
    group_ids: Optional[Tensor] = None
    """``[B]`` int64 prompt-group index within the step (GEPO's groups)."""
    engine_logp: Optional[Tensor] = None
    # Filled by the log-prob pass:
    old_logp: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    sum_p2: Optional[Tensor] = None
    sum_p2_logp: Optional[Tensor] = None
    ref_logp: Optional[Tensor] = None

    def to(self, device) -> "MicroBatch":
        """Move every tensor field to ``device`` (in place); returns self."""
        for name, value in vars(self).items():
            if isinstance(value, Tensor):
                setattr(self, name, value.to(device, non_blocking=True))
        return self

    @property
    def shape(self):
        return tuple(self.input_ids.shape)

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def pad_stack(rows: List[Tensor], width: int, value=0) -> Tensor:
    """Stack 1-D tensors right-padded to ``width``: ``[len(rows), width]``."""
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def cat_padded(tensors: List[Tensor], value=0) -> Tensor:
    """Concatenate ``[B_i, L_i]`` tensors along rows, right-padding to the largest ``L_i``."""
    width = max(t.shape[1] for t in tensors)
    out = torch.full((sum(t.shape[0] for t in tensors), width), value, dtype=tensors[0].dtype,
                     device=tensors[0].device)
    row = 0
    for t in tensors:
        out[row: row + t.shape[0], : t.shape[1]] = t
        row += t.shape[0]
    return out
