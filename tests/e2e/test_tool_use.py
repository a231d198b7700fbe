"""End to end on CPU: multi-turn tool use. torchrun, 2 ranks, TP=2, STARE, the ``hf`` engine and
the calculator environment, from the supervised warm start of ``demo/tool_use.py``: tool-use
accuracy over the last fifth of the steps beats the first fifth; a tool that times out (a real
wall-clock deadline, on a deterministic subset of calls) is an error observation and the run
goes on; a killed run resumed from its checkpoint reproduces the uninterrupted run's metrics."""

import statistics
import sys
from pathlib import Path

import pytest

from megatron_stare.trainer.metrics import read_metrics
from tests.e2e.harness import _comparable, _finish, _popen

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory):
    from megatron_stare.study.sft import SftSettings
    from megatron_stare.demo.tool_use import MAX_NEW_TOKENS, ToolUseSettings, prepare

    out = tmp_path_factory.mktemp("tool_use")
    # A partial start (sampled tool-use accuracy >= 0.3, well below 1): room for RL to improve.
    sft = SftSettings(max_steps=400, batch_size=32, stop_accuracy=0.3, eval_every=20, probe_prompts=16,
                      max_new_tokens=MAX_NEW_TOKENS)
    stats = prepare(ToolUseSettings(out=str(out), sft_rows=1000, rl_rows=64, sft=sft), log=lambda _: None)
    assert 0.3 <= stats.accuracy < 0.9, stats
    return out


def _run(warm_start, run_dir, fault=None, expect=0):
    from megatron_stare.demo.tool_use import CONFIG, trainer_overrides

    entry = (["-m", "megatron_stare.train"] if fault is None
             else [str(Path(__file__).with_name("_fault_train.py")), "--fault", fault])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *entry,
           "--config", str(CONFIG), *trainer_overrides(str(warm_start)),
           f"checkpoint.dir={run_dir / 'ckpt'}", f"logging.dir={run_dir / 'logs'}",
           f"trainer.total_steps={STEPS}", "checkpoint.save_every=10", "trainer.prompts_per_step=8",
           "rollout.multi_turn.env=megatron_stare.testing.envs:HangingCalculatorEnv",
           "rollout.multi_turn.env_options.time_limit_s=0.05"]
    return _finish(_popen(cmd, run_dir), cmd, run_dir, expect)


@pytest.fixture(scope="module")
def uninterrupted(warm_start, tmp_path_factory):
    run = tmp_path_factory.mktemp("tool_full")
    _run(warm_start, run)
    return read_metrics(str(run / "logs" / "metrics.jsonl"))


def test_tool_use_accuracy_rises(uninterrupted):
    rows = uninterrupted
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    fifth = STEPS // 5
    first = statistics.fmean(r["reward/accuracy"] for r in rows[:fifth])
    last = statistics.fmean(r["reward/accuracy"] for r in rows[-fifth:])
    assert last > first, [r["reward/accuracy"] for r in rows]
    assert all(r["stare/gate"] in (0.0, 1.0) for r in rows)
    # A step whose rewards vary has a gradient; one where every response is wrong (or every one
    # right) has zero advantages, so no policy-gradient loss and no gradient (CI once drew a
    # step with accuracy 0 on a loaded machine, where the 0.05 s tool deadline also bites more).
    for r in rows:
        if 0 < r["reward/accuracy"] < 1:
            assert r["grad_norm"] > 0, r
        else:
            assert r["grad_norm"] == 0 and r["pg_loss_token_mean"] == 0, r
    # The model calls the tool, then answers: two turns, observation tokens not trained on.
    assert all(1.5 < r["multiturn/turns_mean"] <= 2 for r in rows)
    assert all(0 < r["multiturn/trained_token_frac"] < 1 for r in rows)
    # Calls whose first number is divisible by 7 time out: error observations, and the run went on.
    assert any(r["multiturn/tool_success_rate"] < 1 for r in rows)
    assert all(r["multiturn/tool_success_rate"] > 0.5 for r in rows)


def test_kill_and_resume_reproduce_the_run(warm_start, uninterrupted, tmp_path):
    """Both ranks die as step 13 starts (after the step-10 save); the resumed run's metrics equal
    the uninterrupted run's, environment observations (timeouts included) and all."""
    out = _run(warm_start, tmp_path, fault="kill@13", expect=None)
    assert out.returncode != 0
    assert [r["step"] for r in read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))] == list(range(1, 13))
    out = _run(warm_start, tmp_path)
    assert "resumed from" in out.stdout and "step_00000010" in out.stdout
    assert _comparable(read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))) == _comparable(uninterrupted)
