"""Checkpoints of the tiny Qwen3-MoE actor (``MOE_SPEC``, two STARE steps, then a checkpoint,
then two more):

- at EP2 with the distributed optimizer (sharded over the data-parallel group for the dense
  weights, the expert-data-parallel group for the experts) the resume is exact: weights, fp32
  main params and Adam moments identical at load, the remaining steps identical;
- across EP layouts (EP2 -> EP1 and EP1 -> EP2, with the distributed optimizer and with the
  plain one) the resume is exact too: weights, fp32 main params and Adam moments identical at
  load (megatron-core keys and nests the experts' state differently at EP1, where they share
  the dense optimizer: ``checkpoint/optimizer_reshard.py`` converts), and the remaining steps equal
  those of the run that stayed at the saved layout within fp32 round-off (the experts' gradients
  are reduced in another order: measured 2e-8 relative in the grad norm, 4e-9 in the weights).
"""

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.resume_case import run_resume_case

pytestmark = pytest.mark.distributed

LR, SAVE_AT = 1e-4, 2
MOE = {"moe": True, "lr": LR}


def _same_weights(saved, loaded):
    assert saved.keys() == loaded.keys()
    for name, w in saved.items():
        assert torch.equal(loaded[name], w), name


def _same_optimizer_state(saved, loaded):
    assert any(".experts.local_experts.7." in n for n in saved)
    assert saved.keys() == loaded.keys()
    for name, state in saved.items():
        assert set(state) == {"param", "exp_avg", "exp_avg_sq"}, (name, set(state))
        for key, t in state.items():
            assert torch.equal(t, loaded[name][key]), f"{name}.{key}"


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """(checkpoint root, the uninterrupted run's rank-0 record) per (ep, distributed optimizer)."""
    cache = {}

    def get(ep, distributed_optimizer=True):
        if (ep, distributed_optimizer) not in cache:
            root = str(tmp_path_factory.mktemp(f"moe_ep{ep}_{int(distributed_optimizer)}"))
            full = run_on_ranks(run_resume_case, 2, root, phase="full", ep=ep,
                                distributed_optimizer=distributed_optimizer, **MOE)[0]
            cache[ep, distributed_optimizer] = root, full
        return cache[ep, distributed_optimizer]

    return get


def test_ep2_resume_with_distributed_optimizer_is_exact(saved_runs):
    root, full = saved_runs(2)
    for got in run_on_ranks(run_resume_case, 2, root, phase="resume", ep=2, **MOE):
        _same_weights(full["weights_at_save"], got["weights_at_load"])
        _same_optimizer_state(full["optimizer_state"], got["optimizer_state"])
        for a, b in zip(full["steps"][SAVE_AT:], got["steps"]):
            assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        _same_weights(full["weights"], got["weights"])


@pytest.mark.parametrize("saved_ep,load_ep,distopt", [(2, 1, True), (1, 2, True), (2, 1, False)],
                         ids=["ep2_to_ep1", "ep1_to_ep2", "ep2_to_ep1_plain_adam"])
def test_resume_across_ep_layouts_is_exact(saved_runs, saved_ep, load_ep, distopt):
    root, full = saved_runs(saved_ep, distopt)
    # Other initial weights than the saved run's: what is compared can only come from the file.
    for got in run_on_ranks(run_resume_case, 2, root, phase="resume", ep=load_ep, weights_seed=1,
                            distributed_optimizer=distopt, **MOE):
        _same_weights(full["weights_at_save"], got["weights_at_load"])
        _same_optimizer_state(full["optimizer_state"], got["optimizer_state"])
        assert len(got["steps"]) == len(full["steps"]) - SAVE_AT
        for a, b in zip(full["steps"][SAVE_AT:], got["steps"]):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
        for name, w in full["weights"].items():
            assert (got["weights"][name] - w).abs().max().item() <= 1e-7, name
