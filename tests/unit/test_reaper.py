"""The reaper (``megatron_stare/runtime/reaper.py``): what a process started dies with it, however it dies."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from megatron_stare.runtime.reaper import marked_processes

# A "rank": starts the watchdog, then a subprocess child (in its own session, as the engine
# servers are), a multiprocessing Manager (as megatron-core's checkpoint writer does, with the
# resource tracker) and a child that ignores SIGTERM; then it dies as the test says.
RANK = r"""
import multiprocessing as mp, os, signal, subprocess, sys, time
from megatron_stare.runtime.reaper import install
install()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
q = mp.get_context("spawn").Manager().Queue()
print("ready", flush=True)
if sys.argv[1] == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(3)  # a plain exit without ending the children (an exception past every handler)
"""


# A rank that ends right after starting its watchdog (a config error just past install()): it is
# gone before the watchdog's interpreter has started, so the watchdog never sees it as its parent.
RANK_AT_ONCE = r"""
import sys
from megatron_stare.runtime.reaper import install
install()
sys.exit(2)
"""


def _wait_gone(run: str, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while (left := marked_processes("REAPER_TEST_RUN", run)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_a_dead_rank_leaves_no_process(how):
    run = uuid.uuid4().hex
    env = {**os.environ, "REAPER_TEST_RUN": run}
    proc = subprocess.run([sys.executable, "-c", RANK, how], env=env, capture_output=True, text=True, timeout=120)
    assert "ready" in proc.stdout, proc.stderr
    assert proc.returncode == (-signal.SIGKILL if how == "sigkill" else 3)
    left = _wait_gone(run, 10.0)
    assert not left, f"processes of the dead rank remain: {left}"


def test_a_rank_that_exits_at_once_leaves_no_watchdog(tmp_path):
    run = uuid.uuid4().hex
    env = {**os.environ, "REAPER_TEST_RUN": run}  # the watchdog inherits it, so it is looked for too
    # Output to a file, not a pipe: the watchdog inherits the rank's stdio, and a pipe would keep
    # subprocess.run waiting for a watchdog that never ends instead of reaching the assertion.
    with open(tmp_path / "rank.log", "w") as log:
        proc = subprocess.run([sys.executable, "-c", RANK_AT_ONCE], env=env, stdout=log, stderr=log, timeout=60)
    assert proc.returncode == 2, (tmp_path / "rank.log").read_text()
    left = _wait_gone(run, 5.0)
    assert not left, f"the dead rank's watchdog remains: {left}"
