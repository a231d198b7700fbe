"""``trainer.offload`` on CUDA (skipped without a GPU or megatron-core): the offload frees the
stated device memory (``torch.cuda.memory_allocated`` drops by at least what the level must
free, counted from the model and optimizer), the host copies are pinned, and the update after
offload and reload equals one without, bit-exact (``testing/offload_case.py`` over NCCL, DP =
the GPUs up to 2, the distributed optimizer, bf16). And ``model.attention_backend=auto`` on CUDA
is transformer-engine, or one line naming TE's import error; the torch attention's masked GQA
blocks run without SDPA's math kernel."""

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


@contextlib.contextmanager
def _nccl():
    os.environ["MEGATRON_STARE_TEST_BACKEND"] = "nccl"
    try:
        yield min(torch.cuda.device_count(), 2)
    finally:
        os.environ.pop("MEGATRON_STARE_TEST_BACKEND", None)


@needs_cuda
@pytest.mark.parametrize("level", ["all", "optimizer"])
def test_offload_frees_the_stated_gpu_memory_and_steps_bit_exact(level):
    from megatron_stare.testing.distributed import run_on_ranks
    from megatron_stare.testing.offload_case import run_offload_case

    with _nccl() as world:
        ranks = run_on_ranks(run_offload_case, world, 1, 1, level=level, distributed_optimizer=True)
    for r in ranks:
        assert r["expected"] > 0 and r["cuda_drop"] >= r["expected"], (r["cuda_drop"], r["expected"])
        assert r["freed"] >= r["expected"] and r["pinned"]
        bad = [k for k in r["plain"] if not torch.equal(r["plain"][k], r["offload"][k])]
        assert not bad, bad[:5]


@needs_cuda
def test_auto_attention_is_te_or_one_line_naming_the_import_error():
    from megatron_stare.models.gpt import resolve_attention, transformer_engine_error

    err = transformer_engine_error()
    if err is None:
        assert resolve_attention("auto") == "te"
    else:
        with pytest.raises(ValueError) as e:
            resolve_attention("auto")
        assert err in str(e.value) and "\n" not in str(e.value) and "model.attention_backend=torch" in str(e.value)
    assert resolve_attention("torch") == "torch"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_masked_gqa_blocks_run_without_the_math_kernel(dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_stare.models.torch_attention import SegmentLayout, attention_reference, block_attention

    slots = [37, 5, 3, 300, 64]  # short sequences share a block-diagonal (masked) tile
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(slots), h, 64, generator=g, dtype=torch.float64) for h in (8, 2, 2))
    ref = attention_reference(q, k, v, slots, 1 / math.sqrt(64))
    qc, kc, vc = (x.to("cuda", dtype).requires_grad_() for x in (q, k, v))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # no math kernel
        out = block_attention(qc, kc, vc, SegmentLayout(tuple(slots)), scale=1 / math.sqrt(64))
        out.float().sum().backward()
    err = (out.double().cpu() - ref).abs().max() / ref.abs().max()
    assert err <= (1e-4 if dtype == torch.float32 else 3e-2)
