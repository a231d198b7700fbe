"""Test helpers around tiny HF checkpoints: logits from Megatron and from transformers.

The checkpoints themselves are built by ``megatron_stare.models.tiny`` (production code: the
demo and the tiny launch script use them too); its names are re-exported here for the tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
import torch.distributed as dist

from megatron_stare.models.tiny import DEFAULT_VOCAB, SPECIAL_TOKENS, build_tiny_hf_model

__all__ = ["DEFAULT_VOCAB", "SPECIAL_TOKENS", "build_tiny_hf_model", "hf_logits", "megatron_logits"]


@torch.no_grad()
def megatron_logits(model, groups, spec, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits ``[b, s, V]`` (padding rows trimmed) of ``tokens`` ``[b, s]``
    on every rank: forward-only through Megatron's pipeline schedule, all-gathered over TP,
    broadcast from the last pipeline stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, seq = tokens.shape
    result = {}

    def forward_step(data_iter, m):
        t = next(data_iter)
        out = m(t, torch.arange(seq).unsqueeze(0).expand_as(t), None)

        def collect(output):
            result["logits"] = output.detach().clone()
            return output.sum() * 0.0, {}

        return out, collect

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]),
                                model=[model], num_microbatches=1, seq_length=seq,
                                micro_batch_size=b, forward_only=True)
    lay = groups.layout
    vshard = spec.padded_vocab_size(lay.tp) // lay.tp
    local = result.get("logits", torch.zeros(b, seq, vshard))
    if lay.tp > 1:
        parts = [torch.empty_like(local) for _ in range(lay.tp)]
        dist.all_gather(parts, local.contiguous(), group=groups.tp_group)
        local = torch.cat(parts, dim=-1)
    if lay.pp > 1:
        dist.broadcast(local, src=groups.pp_last_rank, group=groups.pp_group)
    return local[..., : spec.vocab_size]


def hf_logits(hf_dir: Union[str, Path], tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits ``[b, s, V]`` of ``tokens`` for the checkpoint in ``hf_dir``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits.float()
