"""The torch attention on one CUDA GPU, without transformer-engine (skipped without CUDA or
megatron-core): blocked attention over packed sequences and simulated context-parallel chunks in
fp32 and bf16 against the CPU float64 reference, whole sequences against torch's flash kernel,
the peak memory of a 16k-token row, and one actor update packed against padded on CUDA."""

import contextlib
import math
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _megatron():
    pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/gpu_check.sh installs it)")


#: Tolerance against the float64 reference, relative to the largest reference value.
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("slots,cp", [([37, 1, 2, 300, 64], 1), ([8, 4, 300 + 4, 64], 2)], ids=["packed", "cp2"])
def test_block_attention_on_cuda_matches_cpu_float64_reference(dtype, slots, cp):
    from megatron_stare.models.torch_attention import SegmentLayout, attention_reference, block_attention

    g = torch.Generator().manual_seed(0)
    total, scale = sum(slots), 1 / math.sqrt(64)
    q, k, v = (torch.randn(total, h, 64, generator=g, dtype=torch.float64, requires_grad=True) for h in (8, 2, 2))
    w = torch.randn(total, 8, 64, generator=g, dtype=torch.float64)
    ref = attention_reference(q, k, v, slots, scale)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    kc, vc = (x.detach().to("cuda", dtype).requires_grad_() for x in (k, v))
    qc = q.detach().to("cuda", dtype).requires_grad_()
    loss = 0.0
    for rank in range(cp):
        layout = SegmentLayout(tuple(slots), cp, rank)
        idx = layout.global_index()
        out = block_attention(qc[idx.cuda()], kc, vc, layout, scale=scale, block_elements=8 * 4096)
        err = (out.double().cpu() - ref.detach()[idx]).abs().max() / ref.detach().abs().max()
        assert err <= TOL[dtype], (rank, err.item())
        loss = loss + (out.double() * w[idx].cuda()).sum()
    for got, want in zip(torch.autograd.grad(loss, (qc, kc, vc)), ref_grads):
        assert ((got.double().cpu() - want).abs().max() / want.abs().max()) <= TOL[dtype]


@needs_cuda
def test_whole_sequences_match_torch_flash_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_stare.models.torch_attention import SegmentLayout, block_attention

    slots = [1000, 24, 3000]
    q, k, v = (torch.randn(sum(slots), h, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 8, 8))
    got = block_attention(q, k, v, SegmentLayout(tuple(slots)), scale=128 ** -0.5)
    start = 0
    for n in slots:
        sl = lambda x: x[start:start + n].transpose(0, 1).unsqueeze(0)  # noqa: E731
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            want = torch.nn.functional.scaled_dot_product_attention(sl(q), sl(k), sl(v), is_causal=True)
        assert (got[start:start + n] - want[0].transpose(0, 1)).abs().max().item() <= 1e-2
        start += n


@needs_cuda
@pytest.mark.parametrize("cp,rank", [(1, 0), (2, 1)], ids=["whole_row", "cp2_chunk"])
def test_a_16k_token_row_stays_far_below_dense_scores(cp, rank):
    from megatron_stare.models.torch_attention import SegmentLayout, block_attention

    L = 16384
    layout = SegmentLayout((L,), cp, rank)
    q = torch.randn(layout.local_tokens, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(L, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    block_attention(q, k, v, layout, scale=128 ** -0.5).float().sum().backward()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    dense = 8 * L * L * 4 / 2 ** 20  # fp32 scores of all heads: 8 GiB
    assert peak < dense / 8, f"peak {peak:.0f} MiB against {dense:.0f} MiB of dense scores"


@contextlib.contextmanager
def _nccl():
    os.environ["MEGATRON_STARE_TEST_BACKEND"] = "nccl"
    try:
        yield
    finally:
        os.environ.pop("MEGATRON_STARE_TEST_BACKEND", None)


@needs_cuda
@pytest.mark.distributed
def test_actor_packed_equals_padded_on_cuda():
    from megatron_stare.testing.actor_case import run_actor_variants
    from megatron_stare.testing.distributed import run_on_ranks

    with _nccl():
        packed, padded = run_on_ranks(run_actor_variants, 1, 1, 1, [{}, {"pack_sequences": False}])[0]
    assert packed["tokens"] < padded["tokens"]
    assert packed["logp"].keys() == padded["logp"].keys()
    assert max(abs(packed["logp"][k] - v) for k, v in padded["logp"].items()) <= 1e-4
    assert abs(packed["loss"][0] - padded["loss"][0]) <= 1e-4 * max(1.0, abs(padded["loss"][0]))
    assert abs(packed["grad_norm"][0] - padded["grad_norm"][0]) <= 1e-4 * padded["grad_norm"][0]
    assert packed["selected"] == padded["selected"]
