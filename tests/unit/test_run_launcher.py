"""``python -m megatron_stare.run`` (the README's training command): its torchrun command line,
and how it forwards Ctrl-C to the workers (one press per second, a second press kills)."""

import os
import subprocess
import sys
import time

import pytest

from megatron_stare import run

CHILD = ("import signal, sys, time\n"
         "signal.signal(signal.SIGINT, lambda *a: print('SIGINT', flush=True))\n"
         "print('ready', flush=True)\n"
         "time.sleep(60)\n")


def test_command_line():
    launcher, trainer = run.split_argv(["--nproc-per-node", "2", "--config", "x.yaml", "a.b=1"])
    assert launcher == ["--nproc-per-node", "2"] and trainer == ["--config", "x.yaml", "a.b=1"]
    assert run.torchrun_argv(launcher, trainer) == [
        "--standalone", "--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGHUP,SIGQUIT,SIGUSR1",
        "-m", "megatron_stare.train", "--config", "x.yaml", "a.b=1"]
    multi = run.torchrun_argv(["--nnodes=2", "--signals-to-handle", "SIGTERM"], ["--config", "x.yaml"])
    assert "--standalone" not in multi and multi.count("--signals-to-handle") == 1
    with pytest.raises(ValueError, match="no --config"):
        run.split_argv(["--nproc-per-node", "2"])
    assert run.main(["a.b=1"]) == 2


def test_ctrl_c_is_forwarded_once_per_press_then_kills(monkeypatch):
    """Copies of one press reach the worker once; a second press reaches it too, and
    ``KILL_AFTER_S`` later its process group is killed."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)  # as torchrun starts its workers
    try:
        assert child.stdout.readline() == "ready\n"
        monkeypatch.setattr(run, "KILL_AFTER_S", 0.3)
        assert child.pid in run.children(os.getpid())
        monkeypatch.setattr(run, "children", lambda pid: [child.pid])  # not this test process's others
        presses = run.Interrupts()
        presses.handle(2, None)
        presses.handle(2, None)  # the terminal's copy and a shell's, within the second
        assert child.stdout.readline() == "SIGINT\n" and presses.presses == 1
        presses._last -= run.REPEAT_WINDOW_S + 0.1
        presses.handle(2, None)
        assert child.stdout.readline() == "SIGINT\n" and presses.presses == 2
        t0 = time.monotonic()
        assert child.wait(timeout=10) == -9 and time.monotonic() - t0 < 5
    finally:
        child.kill()
        child.wait()
