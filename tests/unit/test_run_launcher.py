"""``python -m megatron_stare.run`` (the README's training command): its torchrun command line,
and how it forwards Ctrl-C to the workers (one press per second, a second press kills)."""

import os
import subprocess
import sys
import time

import pytest

from megatron_stare import run
from megatron_stare.runtime.preemption import note_engine

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


def test_a_colocated_engines_death_is_named_with_its_rank(tmp_path, monkeypatch):
    """Ranks record their colocated engines beside the status file; when the run fails, the
    launcher says which engine ended with which rank, and how the rank ended (torchrun's
    ``ProcessFailure``), one line per such rank; a failed rank with no engine adds nothing."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    status = tmp_path / "status"
    monkeypatch.setenv(run.STATUS_FILE_ENV, str(status))
    for rank, engine, where in [(0, "sglang", "server pid 4242, log /tmp/sglang_x.log"),
                                (1, "vllm", "in the rank's process")]:
        monkeypatch.setenv("RANK", str(rank))
        note_engine(engine, where)  # what each rank's trainer does (runtime/preemption.py)
    engines = run.read_engines(str(status))
    assert sorted(engines) == [0, 1] and engines[1]["pid"] == os.getpid()
    failures = {1: ProcessFailure(local_rank=1, pid=777, exitcode=-9, error_file=str(tmp_path / "none")),
                0: ProcessFailure(local_rank=0, pid=776, exitcode=1, error_file=str(tmp_path / "none")),
                2: ProcessFailure(local_rank=2, pid=778, exitcode=-15, error_file=str(tmp_path / "none"))}
    assert run.engine_deaths(failures, {**engines, 3: engines[1]}) == [
        "rank 0 (pid 776) exited with code 1; its colocated sglang engine (server pid 4242, log "
        "/tmp/sglang_x.log) ended with it: rerun the same command to resume from the last complete checkpoint",
        "rank 1 (pid 777) ended by SIGKILL; its colocated vllm engine (in the rank's process) ended with it: "
        "rerun the same command to resume from the last complete checkpoint"]
