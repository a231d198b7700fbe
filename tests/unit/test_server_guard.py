"""The server guard (``rollout/server_guard.py``) with real processes: a server outlives nothing.

The "server" is a Python process that starts a child of its own (as vLLM's API server starts its
engine core) and writes both pids; the "rank" is a process that spawns the guarded server the way
``VLLMServerEngine`` does (``start_new_session=True``) and is then SIGKILLed: the guard ends the
server and its child. Exit codes and signals pass through the guard; a SIGTERM to the group (the
engine's ``shutdown``) ends both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_stare.rollout.server_guard import guarded

SERVER = """
import json, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(json.dumps([__import__("os").getpid(), child.pid]))
time.sleep(600)
"""

RANK = """
import subprocess, sys, time
proc = subprocess.Popen(sys.argv[2:], start_new_session=True)
open(sys.argv[1], "w").write(str(proc.pid))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (dead, not yet reaped by its parent) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def _wait_for(path: Path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    time.sleep(0.05)
    return path.read_text()


def _wait_gone(pids, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_killed_rank_takes_its_server_and_the_servers_children_down(tmp_path):
    pids_file, guard_file = tmp_path / "server.json", tmp_path / "guard.pid"
    server = [sys.executable, "-c", SERVER, str(pids_file)]
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(guard_file), *guarded(server)])
    try:
        server_pid, child_pid = json.loads(_wait_for(pids_file))
        guard_pid = int(_wait_for(guard_file))
        assert all(_alive(p) for p in (guard_pid, server_pid, child_pid))
        time.sleep(1.0)
        assert all(_alive(p) for p in (guard_pid, server_pid, child_pid))  # the guard waits while the rank lives
        rank.kill()  # SIGKILL: no atexit hook runs
        rank.wait()
        assert _wait_gone([server_pid, child_pid, guard_pid], timeout=20), "the server outlived its rank"
    finally:
        rank.kill()
        for p in json.loads(pids_file.read_text() or "[]") if pids_file.is_file() else []:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("script,expect", [("import sys; sys.exit(3)", 3),
                                           ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9)])
def test_the_guard_ends_as_the_server_ended(script, expect):
    proc = subprocess.run(guarded([sys.executable, "-c", script]), start_new_session=True, timeout=60)
    assert proc.returncode == expect


def test_a_sigterm_to_the_group_ends_guard_and_server(tmp_path):
    pids_file = tmp_path / "server.json"
    proc = subprocess.Popen(guarded([sys.executable, "-c", SERVER, str(pids_file)]), start_new_session=True)
    server_pid, child_pid = json.loads(_wait_for(pids_file))
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=20) == -signal.SIGTERM  # the server died of it; the guard says so
    assert _wait_gone([server_pid, child_pid], timeout=20)
