"""The actor's update in bf16 with Megatron's distributed optimizer (GPU only; skipped without
CUDA). Compared with the fp32 update of the same batch within bf16 tolerance."""

import os

import pytest
import torch

from megatron_stare.testing.actor_case import run_actor_case
from megatron_stare.testing.distributed import run_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def _bf16(rank, world):
    return run_actor_case(rank, world, 1, 1, dtype=torch.bfloat16, distributed_optimizer=True, lr=1e-4)


def _fp32(rank, world):
    return run_actor_case(rank, world, 1, 1, lr=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_distributed_optimizer_update_matches_fp32():
    os.environ["MEGATRON_STARE_TEST_BACKEND"] = "nccl"
    try:
        world = min(torch.cuda.device_count(), 2)
        bf16 = run_on_ranks(_bf16, world)[0]
        fp32 = run_on_ranks(_fp32, world)[0]
    finally:
        os.environ.pop("MEGATRON_STARE_TEST_BACKEND", None)
    assert all(torch.isfinite(torch.tensor(bf16["loss"])))
    assert abs(bf16["loss"][0] - fp32["loss"][0]) <= 2e-2 * max(1.0, abs(fp32["loss"][0]))
    assert abs(bf16["grad_norm"][0] - fp32["grad_norm"][0]) <= 5e-2 * fp32["grad_norm"][0]
    common = set(bf16["selected"]) & set(fp32["selected"])
    assert len(common) >= 0.8 * len(fp32["selected"])
    for name, w in fp32["weights"].items():
        assert (bf16["weights"][name].float().cpu() - w.cpu()).abs().max().item() < 5e-2, name
