"""The torch attention (``models/torch_attention.py``) against a dense float64 reference:
causal rows, packed sequences (cu_seqlens with length-1 sequences), grouped-query attention,
Megatron's load-balanced context-parallel split simulated in one process, gradients, the block
plan's bounds, the Megatron module's layouts, and the peak memory of a 16k-token row."""

import math
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from megatron_stare.models.torch_attention import (PackedRowParams, SegmentLayout, TorchDotProductAttention,
                                                   attention_reference, block_attention, layout_from_packed,
                                                   plan_blocks)


def qkv(total, heads=4, groups=2, dim=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(total, h, dim, generator=g, dtype=dtype, requires_grad=True)  # noqa: E731
    return make(heads), make(groups), make(groups)


def check_against_reference(slots, cp=1, heads=4, groups=2, block_elements=1 << 24, tol=1e-12):
    """Every simulated CP rank's output rows and the summed gradients equal the dense reference."""
    total = sum(slots)
    q, k, v = qkv(total, heads, groups)
    scale = 1 / math.sqrt(q.shape[-1])
    ref = attention_reference(q, k, v, slots, scale)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    loss, rows = 0.0, []
    for rank in range(cp):
        layout = SegmentLayout(tuple(slots), cp, rank)
        idx = layout.global_index()
        out = block_attention(q[idx], k, v, layout, scale=scale, block_elements=block_elements)
        assert (out.detach() - ref.detach()[idx]).abs().max() <= tol
        loss = loss + (out * w[idx]).sum()
        rows.append(idx)
    assert sorted(torch.cat(rows).tolist()) == list(range(total)), "the CP split lost or repeated a token"
    for got, want in zip(torch.autograd.grad(loss, (q, k, v)), ref_grads):
        assert (got - want).abs().max() <= tol


def test_causal_rows_match_dense_reference():
    check_against_reference([16, 16, 16])  # sbhd: one sequence per row


def test_packed_sequences_never_attend_across_a_boundary():
    slots = [7, 1, 1, 13, 2, 1, 30]
    check_against_reference(slots)
    check_against_reference(slots, block_elements=4 * 24)  # split long runs, merge short ones
    # Changing one sequence changes no other sequence's output.
    q, k, v = (x.detach() for x in qkv(sum(slots)))
    layout = SegmentLayout(tuple(slots))
    base = block_attention(q, k, v, layout, scale=0.3)
    v2 = v.clone()
    v2[9] += 1.0  # the first token of the fourth sequence, tokens 9..21
    moved = (block_attention(q, k, v2, layout, scale=0.3) - base).abs().amax(dim=(1, 2)) > 0
    assert moved.nonzero().flatten().tolist() == list(range(9, 22))


def test_grouped_query_attention_uses_head_groups_like_megatron():
    check_against_reference([9, 4], heads=6, groups=3)
    check_against_reference([9, 4], heads=6, groups=1)
    # Query head h uses key/value head h // (heads/groups): permuting the KV heads must matter.
    q, k, v = (x.detach() for x in qkv(8, 4, 2))
    layout = SegmentLayout((8,))
    a = block_attention(q, k, v, layout, scale=0.3)
    b = block_attention(q, k.flip(1), v.flip(1), layout, scale=0.3)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_split_simulated_in_one_process(cp):
    unit = 2 * cp
    check_against_reference([unit, 5 * unit, 2 * unit], cp=cp)
    check_against_reference([unit, 5 * unit, 2 * unit], cp=cp, block_elements=4 * 9)


def test_layout_refuses_slots_that_do_not_split_over_cp():
    with pytest.raises(ValueError, match="multiples of 2\\*cp = 4"):
        SegmentLayout((4, 6), cp=2)


def test_block_plan_covers_queries_once_and_bounds_masked_tiles():
    layout = SegmentLayout((4, 400, 8, 8, 4, 1200), cp=2, cp_rank=1)
    heads, budget = 4, 4 * 5000
    plan = plan_blocks(layout, heads, budget)
    covered = [i for b in plan.blocks for i in range(b.q0, b.q1)]
    assert covered == list(range(layout.local_tokens))
    for b in plan.blocks:
        if b.causal:
            assert b.q1 - b.q0 == b.k1 - b.k0
        else:
            assert (b.q1 - b.q0) * (b.k1 - b.k0) <= budget // heads or b.q1 - b.q0 == 1
    assert any(not b.causal for b in plan.blocks) and len(plan.blocks) > 3
    # Without CP each sequence is one causal block, whatever its length.
    assert all(b.causal for b in plan_blocks(SegmentLayout((5000, 3000)), heads, budget).blocks)


def _module(cp_group=None, **overrides):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    kw = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
              attention_dropout=0.0)
    cfg = TransformerConfig(**{**kw, **overrides})
    return TorchDotProductAttention(cfg, 1, AttnMaskType.causal, "self",
                                    pg_collection=SimpleNamespace(cp=cp_group))


def test_megatron_module_takes_sbhd_and_thd_layouts():
    attn = _module()
    s, b = 10, 3
    q, k, v = (x.detach() for x in qkv(s * b))
    scale = 1 / math.sqrt(8)
    to_sbhd = lambda x: x.view(b, s, *x.shape[1:]).transpose(0, 1)  # noqa: E731
    out = attn(to_sbhd(q), to_sbhd(k), to_sbhd(v), None)
    assert out.shape == (s, b, 32)
    ref = attention_reference(q, k, v, [s] * b, scale)
    assert torch.allclose(out, to_sbhd(ref).reshape(s, b, 32), atol=1e-12)
    seq_lens, slot_lens = [3, 1, 20], [3, 1, 26]
    params = PackedRowParams.of(seq_lens, slot_lens, "cpu")
    assert params.cu_seqlens_q.tolist() == [0, 3, 4, 24] and params.cu_seqlens_q_padded.tolist() == [0, 3, 4, 30]
    assert layout_from_packed(params, 1, 0) == layout_from_packed(
        SimpleNamespace(cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_q_padded=params.cu_seqlens_q_padded), 1, 0)
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (30, 32)
    assert torch.allclose(out, attention_reference(q, k, v, slot_lens, scale).reshape(30, 32), atol=1e-12)


def test_megatron_module_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="no attention dropout"):
        _module(attention_dropout=0.1)
    attn = _module()
    q, k, v = (x.detach().view(4, 1, *x.shape[1:]) for x in qkv(4))
    with pytest.raises(ValueError, match="no attention mask"):
        attn(q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool))


MEMORY_PROBE = textwrap.dedent("""
    import torch
    from megatron_stare.models.torch_attention import SegmentLayout, block_attention
    def status(key):  # kB from /proc/self/status
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
    torch.set_num_threads(1)
    L, heads, groups, dim = 16384, 4, 2, 16
    for cp, rank in ((1, 0), (2, 1)):  # a whole causal row; a CP chunk that needs mask tiles
        layout = SegmentLayout((L,), cp, rank)
        q = torch.randn(layout.local_tokens, heads, dim, requires_grad=True)
        k, v = (torch.randn(L, groups, dim, requires_grad=True) for _ in range(2))
        open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from now
        before = status("VmRSS:")
        block_attention(q, k, v, layout, scale=0.25).sum().backward()
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
        print((status("VmHWM:") - before) // 1024)
""")


def test_a_16k_token_row_fits_in_a_few_hundred_mib():
    """Forward and backward over one 16k-token sequence, whole and as a CP chunk: the peak RSS
    grows by tens of MiB (measured: 36 and 65), where the dense scores alone would be
    heads * L^2 * 4 bytes = 4 GiB."""
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    peaks = [int(x) for x in out.stdout.split()]
    assert len(peaks) == 2 and max(peaks) < 512, peaks
