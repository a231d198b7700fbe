"""The e2e harness shared by the trainer's end-to-end tests: the tiny model and data (``assets``),
the command lines, starting a run in its own session with a mark every process of it inherits,
waiting for it and checking that no process of it is left, and reading what it wrote."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megatron_stare.trainer.metrics import read_metrics
from megatron_stare.runtime.reaper import marked_processes

ROOT = Path(__file__).resolve().parents[2]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# The vLLM runs sample at temperature 0.7: engine and trainer log-probs agree at any temperature.
VLLM_ARGS = ("rollout.engine=vllm", "rollout.temperature=0.7")
# Asynchronous: a vLLM-CPU server the driver spawns, one step of staleness, 3-token segments.
ASYNC_ARGS = ("rollout.engine=vllm-server", "rollout.temperature=0.7", "trainer.staleness=1",
              "trainer.partial_rollout_tokens=3")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_stare.rewards.synthetic import make_task, write_jsonl
    from megatron_stare.testing.hf_models import build_tiny_hf_model

    d = tmp_path_factory.mktemp("e2e")
    build_tiny_hf_model("qwen2", d / "model", num_layers=2)
    write_jsonl(make_task("add", 32, seed=0, digits=1), d / "train.jsonl")
    write_jsonl(make_task("add", 4, seed=1, digits=1), d / "eval.jsonl")
    return d


def _overrides(assets, run_dir):
    return [f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
            f"data.eval_path={assets / 'eval.jsonl'}", f"checkpoint.dir={run_dir / 'ckpt'}",
            f"logging.dir={run_dir / 'logs'}", "trainer.total_steps=4", "checkpoint.save_every=2",
            "trainer.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=8",
            "algorithm.stare.target_entropy=10.0", "trainer.eval_every=2", "logging.tensorboard=false",
            # A custom reward by dotted path that an untrained model can earn: real advantages.
            "reward.fn=megatron_stare.testing.rewards:parity_reward", "optimizer.lr=1e-3"]


_MARK = "MEGATRON_STARE_E2E_RUN"
#: How long after a run ends its processes may take to go (the ranks' reapers: reaper.py).
LEFTOVER_WAIT_S = 10.0


def _popen(cmd, run_dir, env=None, drop=()):
    """Start ``cmd`` in its own session, output to ``run_dir/std{out,err}.txt``; every process of
    the run inherits ``$MEGATRON_STARE_E2E_RUN=<uuid>`` (see ``_assert_no_leftovers``). Variables
    starting with a prefix in ``drop`` are removed from the environment."""
    run_dir.mkdir(parents=True, exist_ok=True)
    mark = uuid.uuid4().hex
    base = {k: v for k, v in os.environ.items() if not k.startswith(tuple(drop))} if drop else os.environ
    with open(run_dir / "stdout.txt", "w") as fo, open(run_dir / "stderr.txt", "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True, cwd=ROOT, start_new_session=True,
                                env={**base, "OMP_NUM_THREADS": "1", **(env or {}), _MARK: mark})
    proc.mark = mark
    return proc


def _assert_no_leftovers(mark):
    """No process of the run (found by the mark it inherited) outlives it by more than a few
    seconds, however its ranks died: torchrun starts each worker in its own session, and a rank
    killed mid-run would orphan its helpers (megatron-core's checkpoint-writer Manager, the
    resource tracker, reward workers, engine servers) but for its reaper."""
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while (left := marked_processes(_MARK, mark, exclude=(os.getpid(),))) and time.monotonic() < deadline:
        time.sleep(0.2)
    cmdlines = []
    for pid in left:
        try:
            cmdlines.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ')[:200]!r}")
        except OSError:
            pass
    assert not cmdlines, f"processes of the run remain {LEFTOVER_WAIT_S:.0f} s after it ended: {cmdlines}"


def _finish(proc, cmd, run_dir, expect, timeout=900):
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # a hung run is a failure; it must not hang the suite too
        raise
    out = subprocess.CompletedProcess(cmd, code, (run_dir / "stdout.txt").read_text(),
                                      (run_dir / "stderr.txt").read_text())
    _assert_no_leftovers(proc.mark)
    if expect is not None:
        assert out.returncode == expect, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def _run(assets, run_dir, *overrides, nproc=2, env=None, expect=0, fault=None, linger=None):
    """torchrun the trainer (``fault``, ``linger``: through tests/e2e/_fault_train.py, see there)."""
    entry = (["-m", "megatron_stare.train"] if fault is None
             else [str(Path(__file__).with_name("_fault_train.py")), "--fault", fault,
                   *(["--linger", linger] if linger else [])])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *entry, "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), *_overrides(assets, run_dir),
           *overrides]
    return _finish(_popen(cmd, run_dir, env), cmd, run_dir, expect)


def _readme_cmd(assets, run_dir, *overrides):
    """The README's training command (``python -m megatron_stare.run``, 2 ranks) for this run."""
    return [sys.executable, "-m", "megatron_stare.run", "--nproc-per-node", "2", "--config",
            str(ROOT / "examples" / "tiny_cpu.yaml"), *_overrides(assets, run_dir), *overrides]


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "timeline/", "sync/"))} for r in rows]



def _assert_failed_naming_rank(out, rank, ended):
    """torchrun's failure summary names the dead rank; the other rank did not hang (it went
    within torchrun's 30 s shutdown timeout of the death, not the 30 min collective timeout)."""
    assert out.returncode != 0
    assert re.search(rf"rank\s*:\s*{rank} \(local_rank: {rank}\)\s+exitcode\s*:\s*-9", out.stderr), \
        out.stderr[-3000:]
    died = float(re.search(rf"\[fault\] rank {rank} dies at ([\d.]+)", out.stderr).group(1))
    assert ended - died < 45, f"the job took {ended - died:.0f}s to end after rank {rank} died"


def _steps(run_dir):
    return [r["step"] for r in read_metrics(str(run_dir / "logs" / "metrics.jsonl"))]


def _complete(run_dir):
    from megatron_stare.checkpoint.core import latest_complete

    return latest_complete(run_dir / "ckpt").name
