"""The SLURM recipe's preemption lead against the planner's save-time estimate."""

import json
import re
from pathlib import Path

import pytest

from megatron_stare.models.sizes import param_counts
from megatron_stare.plan.save_estimate import check_lead, estimate_save, signal_lead_s

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm_32b.sbatch"


def _32b_estimate(**kw):
    hf = json.loads((ROOT / "examples" / "configs" / "qwen2.5-32b.json").read_text())
    nodes = int(re.search(r"^#SBATCH\s+--nodes=(\d+)", SBATCH.read_text(), re.M).group(1))
    return estimate_save(param_counts(hf).total, nodes, **kw)


def test_32b_checkpoint_size_is_bf16_weights_plus_fp32_adam():
    est = _32b_estimate()
    assert 420 < est.total_bytes / 2**30 < 435  # 61 GiB bf16 weights + 366 GiB fp32 main params, moments


def test_slurm_recipe_lead_covers_the_estimated_save():
    grace = int(re.search(r"PREEMPT_GRACE_S:-(\d+)", SBATCH.read_text()).group(1))
    lead = signal_lead_s(SBATCH)
    assert lead is not None, "launch/slurm_32b.sbatch has no #SBATCH --signal=...@N"
    assert check_lead(lead, grace, _32b_estimate()) is None
    # A file system a tenth as fast would not fit the grace: the check says so in one line.
    slow = check_lead(lead, grace, _32b_estimate(node_gibps=0.2))
    assert slow is not None and "PREEMPT_GRACE_S=600" in slow and "\n" not in slow


@pytest.mark.parametrize("lead,grace", [(600, 600), (30, 0)])
def test_lead_shorter_than_grace_plus_slurm_slack_is_named(lead, grace):
    problem = check_lead(lead, grace, estimate_save(1e6, 1))
    assert problem is not None and f"--signal lead {lead} s" in problem
