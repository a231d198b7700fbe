"""The math kernels on a CUDA device (skipped without CUDA): the vocab-parallel op (whose tiles are
whole chunks there) against a float64 CPU reference, and the exact selection on CUDA tensors
against the same call on CPU."""

import pytest
import torch

from megatron_stare.ops.fused_linear import fused_linear_logprobs_entropy
from megatron_stare.ops.selection import topk_thresholds
from megatron_stare.ops.vocab_parallel import vocab_parallel_logprobs_entropy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype,gtol", [(torch.float32, 1e-5), (torch.bfloat16, 4e-3)])
def test_vocab_parallel_on_cuda_matches_fp64_reference(dtype, gtol):
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(300, 1000, generator=g, dtype=torch.float64) * 3
    t = torch.randint(0, 1000, (300,), generator=g)
    g1, g2 = torch.randn(300, generator=g, dtype=torch.float64), torch.randn(
        300, generator=g, dtype=torch.float64)
    x = x64.to(dtype).cuda().requires_grad_()
    out = vocab_parallel_logprobs_entropy(x, t.cuda(), entropy_grad=True, chunk_size=128)
    (gx,) = torch.autograd.grad((out.logprobs * g1.cuda().float()).sum()
                                + (out.entropy * g2.cuda().float()).sum(), x)
    xr = x.detach().cpu().double().requires_grad_()
    lp = torch.log_softmax(xr, -1)
    ref_lp, ref_h = lp.gather(1, t[:, None]).squeeze(1), -(lp.exp() * lp).sum(1)
    (rx,) = torch.autograd.grad((ref_lp * g1).sum() + (ref_h * g2).sum(), xr)
    torch.testing.assert_close(out.logprobs.cpu().double(), ref_lp.detach(), atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(out.entropy.cpu().double(), ref_h.detach(), atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(gx.cpu().double(), rx, atol=gtol * rx.abs().max().item(), rtol=gtol)

    h = torch.randn(64, 32, generator=g).cuda().requires_grad_()
    w = (torch.randn(500, 32, generator=g) * 0.3).cuda().requires_grad_()
    a = fused_linear_logprobs_entropy(h, w, t[:64].clamp(max=499).cuda(), vocab_chunk_size=128)
    b = vocab_parallel_logprobs_entropy(h @ w.T, t[:64].clamp(max=499).cuda())
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=2e-5, rtol=0)


def test_selection_on_cuda_equals_cpu():
    g = torch.Generator().manual_seed(1)
    v = (torch.randn(50000, generator=g).abs() * 1000).round() / 1000  # many ties
    keys = torch.randperm(50000, generator=g)
    items = [(v, keys, 4321), (v[:3000], keys[:3000], lambda n: n // 7)]
    for kw in ({}, dict(eager=16, gather_max=0), dict(eager=16, gather_max=512)):
        cpu = topk_thresholds(items, **kw)
        gpu = topk_thresholds([(a.cuda(), b.cuda(), k) for a, b, k in items], **kw)
        assert gpu == cpu, kw
