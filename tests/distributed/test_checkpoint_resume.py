"""Training checkpoints with Megatron's distributed optimizer, on gloo CPU ranks.

- Exact resume: a fresh process that loads the step-2 checkpoint reproduces the uninterrupted
  run's steps 3-4 bit for bit (bf16 weights, fp32 main params, Adam moments, LR schedule, RNG).
  Leaving the optimizer's parameter state out of the load, or Adam's step counts as
  megatron-core's torch-Adam load leaves them, breaks that, and the test sees it.
- Weights-only resume: the fp32 main params follow the loaded weights (without the refresh they
  stay at the optimizer's init, and the first step would write init + update over the weights).
- Resharding: a DP1 checkpoint resumes at DP2 with the same weights, Adam moments and main params
  (gathered to canonical names), and continues like the DP1 run; a TP2 checkpoint of the
  distributed optimizer resumes at TP1xPP2 and at TP1xDP2 likewise (fully reshardable format).
"""

import pytest
import torch

from megatron_stare.checkpoint.dist_ckpt import CheckpointMeta, check_optimizer_compatible
from megatron_stare.runtime.parallel import ParallelLayout
from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.resume_case import run_resume_case

pytestmark = pytest.mark.distributed

SAVE_AT, LR = 2, 1e-4


def assert_resumes_exactly(full, resumed):
    assert resumed["steps"] == full["steps"][SAVE_AT:], "the resumed steps differ"
    for name, w in full["weights"].items():
        assert torch.equal(w, resumed["weights"][name]), f"{name} differs after the resumed steps"


@pytest.fixture(scope="module")
def bf16_dp2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bf16_dp2"))
    full = run_on_ranks(run_resume_case, 2, root, phase="full", dtype=torch.bfloat16, lr=LR)
    return root, full[0]


def test_resume_with_distributed_optimizer_is_exact(bf16_dp2):
    root, full = bf16_dp2
    for got in run_on_ranks(run_resume_case, 2, root, phase="resume", dtype=torch.bfloat16, lr=LR):
        for name, state in full["optimizer_state"].items():
            for key, t in state.items():
                assert torch.equal(t, got["optimizer_state"][name][key]), f"{name}.{key} not restored"
        assert_resumes_exactly(full, got)
    # Without the parameter state (moments, fp32 main params), or with Adam's step counts as
    # megatron-core's torch-Adam load leaves them (shared, reset to 0), the check fails.
    for kind in ("param_state", "adam_steps"):
        broken = run_on_ranks(run_resume_case, 2, root, phase="resume", dtype=torch.bfloat16, lr=LR,
                              break_load=kind)[0]
        with pytest.raises(AssertionError):
            assert_resumes_exactly(full, broken)


def test_the_running_config_chooses_adams_kernel_not_the_checkpoint(bf16_dp2):
    """The checkpoint was saved by the fused kernel (``optimizer.fused_adam``, the default); a run
    resumed with the loop keeps the loop (the load would otherwise copy the saved groups' flags),
    and its steps agree with the fused run's up to rounding."""
    root, full = bf16_dp2
    assert full["adam_kernels"] == [(True, False)]
    loop = run_on_ranks(run_resume_case, 2, root, phase="resume", dtype=torch.bfloat16, lr=LR, fused_adam=False)[0]
    assert loop["adam_kernels"] == [(None, None)]  # torch's default: the per-tensor loop on CPU
    for a, b in zip(full["steps"][SAVE_AT:], loop["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3, abs=1e-5)
    for name, w in full["weights"].items():  # bf16 weights: at most a few ulps apart
        torch.testing.assert_close(loop["weights"][name].float(), w.float(), rtol=2e-2, atol=1e-3)
    broken = run_on_ranks(run_resume_case, 2, root, phase="resume", dtype=torch.bfloat16, lr=LR, fused_adam=False,
                          break_load="adam_kernels")[0]
    assert broken["adam_kernels"] == [(True, False)]


def _main_params_follow_weights(r):
    for name, w in r["weights_at_load"].items():
        assert torch.equal(r["optimizer_state"][name]["param"], w), f"{name}: stale fp32 main param"


def test_weights_only_resume_refreshes_the_main_params(bf16_dp2):
    root, full = bf16_dp2
    kw = dict(phase="resume", dtype=torch.bfloat16, lr=LR, load_optimizer=False, weights_seed=1)
    fresh = run_on_ranks(run_resume_case, 2, root, **kw)[0]
    stale = run_on_ranks(run_resume_case, 2, root, break_load="main_params", **kw)[0]
    for name, w in full["weights_at_save"].items():
        assert torch.equal(fresh["weights_at_load"][name], w)
    _main_params_follow_weights(fresh)
    with pytest.raises(AssertionError):
        _main_params_follow_weights(stale)
    # Two steps move the resumed weights by about 2*lr (plus bf16 rounding); stale main params
    # throw them back to the other init.
    drift = lambda r: max((r["weights"][n] - w).abs().max().item()  # noqa: E731
                          for n, w in r["weights_at_load"].items())
    assert drift(fresh) < 0.02 < drift(stale)


def test_dp1_checkpoint_resumes_at_dp2_with_the_same_state(tmp_path):
    root = str(tmp_path)
    full = run_on_ranks(run_resume_case, 1, root, phase="full", lr=LR)[0]
    for got in run_on_ranks(run_resume_case, 2, root, phase="resume", lr=LR):
        for name, w in full["weights_at_save"].items():
            assert torch.equal(got["weights_at_load"][name], w), name
        for name, state in full["optimizer_state"].items():
            for key, t in state.items():
                assert torch.equal(t, got["optimizer_state"][name][key]), f"{name}.{key}"
        for a, b in zip(full["steps"][SAVE_AT:], got["steps"]):
            assert abs(a["loss"][0] - b["loss"][0]) <= 1e-5 * abs(a["loss"][0])
            assert abs(a["grad_norm"][0] - b["grad_norm"][0]) <= 1e-5 * a["grad_norm"][0]
        for name, w in full["weights"].items():
            assert (w - got["weights"][name]).abs().max().item() <= 1e-6, name


def _assert_same_state_and_next_step(full, got):
    for name, w in full["weights_at_save"].items():
        assert torch.equal(got["weights_at_load"][name], w), name
    for name, state in full["optimizer_state"].items():
        assert set(state) == {"param", "exp_avg", "exp_avg_sq"}, name
        for key, t in state.items():
            assert torch.equal(t, got["optimizer_state"][name][key]), f"{name}.{key}"
    assert len(got["steps"]) == len(full["steps"][SAVE_AT:]) > 0
    for a, b in zip(full["steps"][SAVE_AT:], got["steps"]):
        assert abs(a["loss"][0] - b["loss"][0]) <= 1e-5 * abs(a["loss"][0])
        assert abs(a["grad_norm"][0] - b["grad_norm"][0]) <= 1e-5 * a["grad_norm"][0]
    for name, w in full["weights"].items():
        assert (w - got["weights"][name]).abs().max().item() <= 1e-6, name


@pytest.fixture(scope="module")
def tp2_distributed(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp2_distopt"))
    return root, run_on_ranks(run_resume_case, 2, root, phase="full", tp=2, steps=SAVE_AT + 1, lr=LR)[0]


@pytest.mark.parametrize("layout", [{"pp": 2}, {"tp": 1}], ids=["tp1pp2", "tp1dp2"])
def test_tp2_distributed_optimizer_checkpoint_resumes_at_another_layout(tp2_distributed, layout):
    root, full = tp2_distributed
    for got in run_on_ranks(run_resume_case, 2, root, phase="resume", steps=SAVE_AT + 1, lr=LR, **layout):
        _assert_same_state_and_next_step(full, got)
    if "pp" not in layout:
        return
    # Without the parameter state the moments stay at their fresh zeros: the check sees it.
    broken = run_on_ranks(run_resume_case, 2, root, phase="resume", steps=SAVE_AT + 1, lr=LR,
                          break_load="param_state", **layout)[0]
    with pytest.raises(AssertionError):
        _assert_same_state_and_next_step(full, broken)


@pytest.mark.parametrize("saved,fmt,tp,needle", [
    ("model_space", "distributed:fully_reshardable", 1, "set parallel.distributed_optimizer"),
    ("distributed:fully_reshardable", "model_space", 1, "set parallel.distributed_optimizer"),
    ("distributed:dp_reshardable", "distributed:fully_reshardable", 2, "needs the same tp/pp"),
])
def test_incompatible_optimizer_state_is_one_clear_error(saved, fmt, tp, needle):
    meta = CheckpointMeta(spec={}, saved_layout={"tp": 1, "pp": 1, "dp": 1}, extra={"optimizer_format": saved})
    with pytest.raises(ValueError, match=needle):
        check_optimizer_compatible(meta, fmt, ParallelLayout(tp=tp, dp=2), "ckpt/optimizer")
    check_optimizer_compatible(meta, saved, ParallelLayout(tp=1, dp=4), "ckpt/optimizer")  # DP may change


def test_fully_reshardable_optimizer_state_loads_at_any_tp_pp():
    meta = CheckpointMeta(spec={}, saved_layout={"tp": 2, "pp": 1, "dp": 1},
                          extra={"optimizer_format": "distributed:fully_reshardable"})
    for lay in (ParallelLayout(tp=1, pp=2), ParallelLayout(tp=1, dp=2), ParallelLayout(tp=4, pp=2, dp=2)):
        check_optimizer_compatible(meta, "distributed:fully_reshardable", lay, "ckpt/optimizer")
