"""Ctrl-C on a launch script (launch/train_tiny_cpu.sh): the scripts run torchrun inside
``python -m megatron_stare.run``, so a press gives the trainer's one line and exit 130, as the
README's command does, not torchrun's ``SignalException`` traceback; the step is saved and no
process of the run is left."""

import os
import re
import signal
import time

import pytest

# The same tiny model and data as the trainer's e2e tests (a fixture of this module's own).
from tests.e2e.harness import ROOT, _complete, _finish, _overrides, _popen, _steps, assets  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_ctrl_c_on_a_launch_script_is_one_line_and_exit_130(assets, tmp_path):
    cmd = ["bash", str(ROOT / "launch" / "train_tiny_cpu.sh"), *_overrides(assets, tmp_path)]
    proc = _popen(cmd, tmp_path, env={"TINY_DIR": str(assets), "PYTHONWARNINGS": "ignore"})
    metrics = tmp_path / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and metrics.read_text().strip()):  # step 1 is done
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends: the script's whole process group
    out = _finish(proc, cmd, tmp_path, expect=130, timeout=300)
    about = [ln for ln in (out.stdout + out.stderr).splitlines() if re.search(r"SIGINT|Ctrl-C|interrupt", ln)]
    assert len(about) == 1, about
    stopped = int(re.search(r"preempted by SIGINT after step (\d+): saved .*\(exit 130\)", about[0]).group(1))
    assert stopped in (1, 2, 3) and _steps(tmp_path) == list(range(1, stopped + 1))
    assert _complete(tmp_path) == f"step_{stopped:08d}"
    assert "Traceback" not in out.stderr and "SignalException" not in out.stderr, out.stderr[-3000:]
