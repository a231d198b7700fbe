"""Typed state that crosses module boundaries: rollout samples and micro-batches (padded rows,
optionally with the packed row the model runs on)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

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
    loss_mask: Optional[List[int]] = None
    """Per response token: 1 trained on (the model's tokens), 0 not (a multi-turn trajectory's
    tool / environment tokens, which still go through the forward pass). None: all 1."""
    routed_experts: Optional[Tensor] = None
    """MoE routing replay: ``[n, num_moe_layers, topk]`` int16, the experts chosen for the last
    ``n`` of the sample's ``num_tokens - 1`` input positions (``GenerationResult.routed_experts``);
    None: the trainer routes itself."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class PackedRow:
    """The model's view of a packed micro-batch: its sequences end to end in one row (this
    context-parallel rank's part of it), and where each token lands in the ``[B, L]`` fields.

    Sequence ``i`` fills a slot of ``slot_lens[i]`` tokens: its ``seq_lens[i]`` tokens, then
    padding (to a multiple of ``2*cp`` under CP; the last slot also pads the row to the multiple
    sequence parallel needs). Under CP each slot is cut into ``2*cp`` chunks and this rank holds
    chunks ``cp_rank`` and ``2*cp-1-cp_rank`` of every slot, as transformer-engine's THD layout.
    """

    input_ids: Tensor
    """``[1, t]`` this rank's tokens of the row."""
    position_ids: Tensor
    """``[1, t]`` each token's position within its sequence."""
    targets: Tensor
    """``[1, t]`` the next token of each (0 at padding)."""
    index: Tensor
    """``[B, L]`` int64: the row position of each cell of the micro-batch's ``[B, L]`` fields
    (0 for cells past a sequence's end, which are masked)."""
    seq_lens: Tuple[int, ...]
    """Tokens of each sequence (global, before the CP split)."""
    slot_lens: Tuple[int, ...]
    """Slot of each sequence in the row (global, before the CP split)."""

    def to(self, device) -> "PackedRow":
        for name, value in vars(self).items():
            if isinstance(value, Tensor):
                setattr(self, name, value.to(device, non_blocking=True))
        return self


@dataclass
class MicroBatch:
    """A micro-batch of whole sequences, one right-padded row each: ``[B, L]`` unless noted.

    Position ``t`` of ``targets`` is token ``t + 1`` of the sequence, predicted from position
    ``t``; ``loss_mask`` marks the targets that are response tokens. Padding is at the end, so
    causal attention keeps it out of every real position. Under context parallelism each row
    holds this rank's chunks of its sequence. With ``packed`` the model runs on the packed row
    instead and its per-token results are gathered into this layout (``PackedRow.index``); the
    losses, plans and selections read the ``[B, L]`` fields either way.
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
    packed: Optional[PackedRow] = None
    """The packed row the model runs on (``parallel.pack_sequences``); None: the padded rows."""
    seq_lens: Optional[Tensor] = None
    """``[B]`` int64: input positions of each sequence (the rest of its row is padding)."""
    routes: Optional[Tensor] = None
    """``[B, L, num_moe_layers, topk]`` int16: the engine's experts for each input position
    (``Sample.routed_experts``; -1 where it routed none, and at padding); r3 routing replay."""
    replay: Optional[Tensor] = None
    """``[tokens, stage MoE layers, topk]`` int16: the routing the log-prob pass recorded on this
    pipeline stage, in the routers' token order (``actor/routing_replay.py``); r2 / r3."""

    def to(self, device) -> "MicroBatch":
        """Move every tensor field (and the packed row) to ``device`` (in place); returns self."""
        for name, value in vars(self).items():
            if isinstance(value, Tensor):
                setattr(self, name, value.to(device, non_blocking=True))
        if self.packed is not None:
            self.packed.to(device)
        return self

    @property
    def shape(self):
        """``(B, L)`` of the per-token fields."""
        return tuple(self.input_ids.shape)

    @property
    def model_shape(self):
        """``(batch, length)`` of what the model runs on: ``(1, t)`` packed, else ``shape``."""
        return tuple(self.packed.input_ids.shape) if self.packed is not None else self.shape

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def pad_stack(rows: List[Tensor], width: int, value=0) -> Tensor:
    """Stack ``[n_i, *rest]`` tensors right-padded to ``width``: ``[len(rows), width, *rest]``."""
    out = torch.full((len(rows), width, *rows[0].shape[1:]), value, dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
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
