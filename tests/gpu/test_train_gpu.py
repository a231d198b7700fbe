"""The trainer on one CUDA GPU (skipped without CUDA or megatron-core): torchrun with one rank,
TP1, bf16 weights with Megatron's distributed optimizer, the `hf` engine on the GPU; two STARE
steps with a checkpoint, then a resume that continues from it for a third step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_stare.trainer.metrics import read_metrics

from megatron_stare.models.gpt import transformer_engine_error

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _train(assets, run_dir, *overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "megatron_stare.train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"),
           f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
           f"checkpoint.dir={run_dir / 'ckpt'}", f"logging.dir={run_dir / 'logs'}",
           "parallel.tp=1", "parallel.distributed_optimizer=true", "model.dtype=bfloat16",
           "checkpoint.save_every=1", "trainer.prompts_per_step=4", "rollout.n=4",
           "rollout.max_new_tokens=8", "algorithm.stare.target_entropy=10.0", "logging.tensorboard=false",
           "reward.fn=megatron_stare.testing.rewards:parity_reward", "optimizer.lr=1e-3",
           # Without transformer-engine the torch attention must be chosen explicitly (no fallback).
           f"model.attention_backend={'auto' if transformer_engine_error() is None else 'torch'}", *overrides]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "4"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_tp1_distributed_optimizer_training_steps(tmp_path):
    pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/gpu_check.sh installs it)")
    from megatron_stare.rewards.synthetic import make_task, write_jsonl
    from megatron_stare.testing.hf_models import build_tiny_hf_model

    build_tiny_hf_model("qwen2", tmp_path / "model", num_layers=2)
    write_jsonl(make_task("add", 16, seed=0, digits=1), tmp_path / "train.jsonl")
    run = tmp_path / "run"
    _train(tmp_path, run, "trainer.total_steps=2")
    rows = read_metrics(str(run / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() and r["grad_norm"] > 0
               for r in rows)
    assert (run / "ckpt" / "step_00000002" / "optimizer").is_dir()
    out = _train(tmp_path, run, "trainer.total_steps=3")
    assert "resumed from" in out.stdout and "step_00000002" in out.stdout
    assert [r["step"] for r in read_metrics(str(run / "logs" / "metrics.jsonl"))] == [1, 2, 3]
