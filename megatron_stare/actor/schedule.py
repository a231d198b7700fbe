"""Megatron's forward(-backward) schedule over micro-batches, and the last pipeline stage's
results shared with every stage.

A packed micro-batch runs as one row ``[1, t]`` with its ``PackedSeqParams`` (thd), which
every stage's attention and RoPE read; a padded one as its rows ``[B, L]``.

Only the last stage has logits, so only its loss functions run; per-token results and metrics
computed there are broadcast over the pipeline group so that every rank holds the same values.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_stare.models.torch_attention import PackedRowParams
from megatron_stare.runtime.parallel import ParallelGroups
from megatron_stare.types import MicroBatch

#: Megatron's ``loss_func``: output tensor of the last stage -> (loss, reduced dict).
LossFunc = Callable[[torch.Tensor], tuple]


def _routes_experts(m) -> bool:
    """A mixture-of-experts stage whose router can be told the row's padding: megatron splits
    the mask for sequence parallel on the first pipeline stage only, so later stages under
    sequence parallel route their padding (counted by the router losses)."""
    inner = m
    while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
        inner = inner.module
    cfg = getattr(inner, "config", None)
    if not getattr(cfg, "num_moe_experts", None):
        return False
    return bool(getattr(inner, "pre_process", True)) or not cfg.sequence_parallel


def _row_padding(row) -> torch.Tensor:
    """``[1, t]`` bool, True at the packed row's padding (slot padding, the row's multiple):
    megatron's MoE ``padding_mask``, which keeps padding out of the router's losses (else the
    padding to the TP multiple would be routed and counted by the aux and z-losses).

    A token is padding where its position in its slot is past its sequence's length; this CP
    rank holds ``slot / cp`` positions of each slot (all of them at CP1)."""
    cp = sum(row.slot_lens) // row.input_ids.shape[1]
    kept = torch.tensor(row.slot_lens) // cp
    seq_len = torch.repeat_interleave(torch.tensor(row.seq_lens), kept).to(row.position_ids.device)
    return (row.position_ids[0] >= seq_len).unsqueeze(0)


def run_schedule(model, micro_batches: Sequence[MicroBatch], loss_funcs: Sequence[LossFunc],
                 forward_only: bool, before_forward: Optional[Callable[[MicroBatch], None]] = None):
    """Run ``model`` over ``micro_batches`` with Megatron's schedule; ``loss_funcs[i]`` gets the
    last stage's output of micro-batch ``i`` (called on the last stage only). ``before_forward``:
    called with each micro-batch before its forward on this stage (routing replay's ``feed``)."""

    def forward_step(data_iter, m):
        mb, loss_func = next(data_iter)
        if before_forward is not None:
            before_forward(mb)
        if mb.packed is None:
            return m(mb.input_ids, mb.position_ids, None), loss_func
        row = mb.packed
        params = PackedRowParams.of(row.seq_lens, row.slot_lens, row.input_ids.device)
        extra = {}
        if _routes_experts(m):
            extra["padding_mask"] = _row_padding(row)
        return m(row.input_ids, row.position_ids, None, packed_seq_params=params, **extra), loss_func

    # Lengths differ between micro-batches: the p2p of every stage boundary sends its shape
    # first (``variable_seq_lengths``), so these are only Megatron's nominal sizes.
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(list(zip(micro_batches, loss_funcs))),
        model=[model], num_microbatches=len(micro_batches),
        seq_length=max(mb.model_shape[1] for mb in micro_batches),
        micro_batch_size=max(mb.model_shape[0] for mb in micro_batches), forward_only=forward_only)


def broadcast_from_last_stage(tensors: List[torch.Tensor], groups: ParallelGroups) -> None:
    """Overwrite ``tensors`` (same shapes on every stage) with the last pipeline stage's values."""
    if groups.layout.pp == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0, device=groups.device)
    dist.broadcast(flat, src=groups.pp_last_rank, group=groups.pp_group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


def share_from_last_stage(obj: Any, groups: ParallelGroups) -> Any:
    """The last stage's ``obj`` (any picklable value) on every pipeline stage."""
    if groups.layout.pp == 1:
        return obj
    box = [obj if groups.is_last_stage else None]
    dist.broadcast_object_list(box, src=groups.pp_last_rank, group=groups.pp_group)
    return box[0]
