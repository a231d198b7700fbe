"""The actor on one CUDA GPU (skipped without CUDA or megatron-core): bf16 with Megatron's
distributed optimizer (fp32 main params) against the fp32 update of the same batch, and the
distributed-optimizer checkpoint round trip (Adam moments, fp32 main params, weights restored
bit for bit; the resumed steps continue the uninterrupted run). Sequence parallel needs TP > 1,
so on one GPU it is covered only by the CPU tests."""

import contextlib
import os

import pytest
import torch

from megatron_stare.testing.actor_case import run_actor_case
from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.resume_case import run_resume_case

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]
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


def _bf16(rank, world):
    return run_actor_case(rank, world, 1, 1, dtype=torch.bfloat16, distributed_optimizer=True, lr=1e-4)


def _fp32(rank, world):
    return run_actor_case(rank, world, 1, 1, lr=1e-4)


@needs_cuda
def test_bf16_distributed_optimizer_update_matches_fp32():
    with _nccl() as world:
        bf16 = run_on_ranks(_bf16, world)[0]
        fp32 = run_on_ranks(_fp32, world)[0]
    assert all(torch.isfinite(torch.tensor(bf16["loss"])))
    assert abs(bf16["loss"][0] - fp32["loss"][0]) <= 2e-2 * max(1.0, abs(fp32["loss"][0]))
    assert abs(bf16["grad_norm"][0] - fp32["grad_norm"][0]) <= 5e-2 * fp32["grad_norm"][0]
    common = set(bf16["selected"]) & set(fp32["selected"])
    assert len(common) >= 0.8 * len(fp32["selected"])
    for name, w in fp32["weights"].items():
        assert (bf16["weights"][name].float().cpu() - w.cpu()).abs().max().item() < 5e-2, name


@needs_cuda
def test_bf16_distributed_optimizer_checkpoint_round_trip(tmp_path):
    root, kw = str(tmp_path), dict(dtype=torch.bfloat16, lr=1e-4)
    with _nccl() as world:
        full = run_on_ranks(run_resume_case, world, root, phase="full", **kw)[0]
        got = run_on_ranks(run_resume_case, world, root, phase="resume", **kw)[0]
    for name, w in full["weights_at_save"].items():
        assert torch.equal(got["weights_at_load"][name].cpu(), w.cpu()), name
    for name, state in full["optimizer_state"].items():
        for key, t in state.items():
            assert torch.equal(got["optimizer_state"][name][key], t), f"{name}.{key} not restored"
    # CUDA kernels need not be bitwise deterministic run to run: the continuation agrees closely.
    for a, b in zip(full["steps"][2:], got["steps"]):
        assert abs(a["loss"][0] - b["loss"][0]) <= 1e-2 * max(1.0, abs(a["loss"][0]))
