"""The torch attention's context parallel for real, on 2 gloo ranks: each rank holds
Megatron's load-balanced chunks of every sequence, keys and values are all-gathered (and their
gradients reduce-scattered) over the CP group, and every rank's output rows and input
gradients equal the dense float64 reference over whole sequences. Through the Megatron module,
in both layouts it receives: padded rows (sbhd) and a packed row (thd, cu_seqlens)."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed

HEADS, GROUPS, DIM = 4, 2, 8


def _cp_attention_case(rank, world):
    import torch.distributed as dist
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_stare.models.torch_attention import (PackedRowParams, SegmentLayout, TorchDotProductAttention,
                                                       attention_reference)

    cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                            num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0)
    group = dist.new_group(list(range(world)))
    attn = TorchDotProductAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(cp=group),
                                    block_elements=HEADS * 40)  # small tiles: split and merge blocks
    scale = 1 / math.sqrt(DIM)
    errors = {}

    def run(name, slots, to_local, from_local_out, **kw):
        g = torch.Generator().manual_seed(len(slots))
        total = sum(slots)
        q, k, v = (torch.randn(total, h, DIM, generator=g, dtype=torch.float64, requires_grad=True)
                   for h in (HEADS, GROUPS, GROUPS))
        w = torch.randn(total, HEADS, DIM, generator=g, dtype=torch.float64)
        ref = attention_reference(q, k, v, slots, scale)
        ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
        idx = SegmentLayout(tuple(slots), world, rank).global_index()
        local = [x.detach()[idx].clone().requires_grad_() for x in (q, k, v)]
        out = from_local_out(attn(*(to_local(x) for x in local), None, **kw))
        grads = torch.autograd.grad((out * w[idx]).sum(), local)
        errors[name] = max([(out - ref.detach()[idx]).abs().max().item()] +
                           [(a - b[idx]).abs().max().item() for a, b in zip(grads, ref_grads)])

    # sbhd: 3 rows of 24 tokens, each rank holds 12 of each row (chunks r and 3-r of 6).
    b, s = 3, 24 // world
    run("sbhd", [24] * b, lambda x: x.view(b, s, *x.shape[1:]).transpose(0, 1),
        lambda o: o.transpose(0, 1).reshape(b * s, HEADS, DIM))
    # thd: sequences of 5, 1, 18 and 2 tokens in slots padded to 2*cp (the last also pads the row).
    seq_lens, slots = [5, 1, 18, 2], [8, 4, 20, 8]
    run("thd", slots, lambda x: x, lambda o: o.view(-1, HEADS, DIM),
        packed_seq_params=PackedRowParams.of(seq_lens, slots, "cpu"))
    return errors


def test_context_parallel_attention_on_two_ranks_matches_dense_reference():
    for errors in run_on_ranks(_cp_attention_case, 2):
        assert set(errors) == {"sbhd", "thd"}
        assert max(errors.values()) <= 1e-12, errors
