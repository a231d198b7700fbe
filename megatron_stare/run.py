"""``python -m megatron_stare.run``: the training command - torchrun with the trainer, exiting with
the run's own code.

    python -m megatron_stare.run --nproc-per-node 2 --config examples/tiny_cpu.yaml a.b=c ...

Everything before ``--config`` goes to torchrun (``--standalone`` unless a rendezvous is given),
everything from ``--config`` on to ``python -m megatron_stare.train``. torchrun runs in this
process; what this adds to it:

- **Exit codes.** torchrun exits 1 whatever its workers return; this exits with the run's code,
  which each node's local rank 0 writes to ``$MEGATRON_STARE_STATUS_FILE`` (``preemption.py``):
  0 done, 2 a user error (its one line was printed), 75 preempted after saving, 130 Ctrl-C. A
  real failure keeps torchrun's failure summary and exits 1; no ``SignalException`` traceback.
- **Ctrl-C.** SIGINT is this process's, not torchrun's (``--signals-to-handle`` leaves it out):
  torchrun would shut the workers down, and a second copy of the signal (a terminal and a shell
  both sending it) would end torchrun mid-shutdown and orphan them. A press is forwarded to
  every worker once (copies within ``REPEAT_WINDOW_S`` are one press): the workers save at the
  next step boundary and exit 130. A second press later than that is forwarded too (the workers
  stop at once), and workers still alive ``KILL_AFTER_S`` later are killed with their process
  groups. SIGTERM / SIGUSR1 stay torchrun's (it forwards them: preemption, exit 75).
- **A colocated engine's death.** A colocated ``vllm`` engine lives in its rank's process and a
  colocated ``sglang`` server is its rank's child: either dies with its rank (and the rank with
  it). Each rank that hosts one records it (``note_engine``, beside the status file); when the
  run fails, one line per failed rank that hosted one names the engine with the rank's end
  (``rank 1 (pid N) ended by SIGKILL; its colocated vllm engine (in the rank's process) ended
  with it: ...``). The rerun resumes from the last complete checkpoint. (A restart inside the
  rank would need the engine rebuilt in a process whose collectives are intact: with vLLM's
  ``external_launcher`` the engine shares the trainer's process group, so a rank whose engine
  died is a rank to replace, which is torchrun's elastic restart, not the rank's own doing.)
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from typing import List, Mapping, Optional, Sequence, Tuple

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from megatron_stare.runtime.preemption import (ENGINES_SUFFIX, INTERRUPTED_EXIT_CODE, REPEAT_WINDOW_S, STATUS_FILE_ENV,
                                              read_engines)

#: torchrun's signals: its defaults and SIGUSR1 (launch/common.sh), without SIGINT (ours).
TORCHRUN_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT,SIGUSR1"
#: Seconds after a second Ctrl-C before workers still alive are killed.
KILL_AFTER_S = 3.0
_RENDEZVOUS_FLAGS = ("--standalone", "--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr",
                     "--master_addr")
USAGE = "usage: python -m megatron_stare.run [torchrun options] --config X.yaml [a.b=c ...]"
def engine_deaths(failures: Mapping[int, object], engines: Mapping[int, dict]) -> List[str]:
    """One line per failed rank (``ChildFailedError.failures``: rank -> ``ProcessFailure``) that
    hosted a colocated engine."""
    lines = []
    for rank in sorted(failures):
        rec, f = engines.get(rank), failures[rank]
        if rec is None:
            continue
        code = getattr(f, "exitcode", None)
        how = (f"ended by {f.signal_name()}" if isinstance(code, int) and code < 0
               else f"exited with code {code}")
        lines.append(f"rank {rank} (pid {getattr(f, 'pid', rec['pid'])}) {how}; its colocated {rec['engine']} "
                     f"engine ({rec['where']}) ended with it: rerun the same command to resume from the last "
                     f"complete checkpoint")
    return lines


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(torchrun's arguments, the trainer's) split at ``--config``; ValueError without one."""
    for i, a in enumerate(argv):
        if a == "--config" or a.startswith("--config="):
            return list(argv[:i]), list(argv[i:])
    raise ValueError("no --config: the trainer needs a YAML config (see examples/)")


def torchrun_argv(launcher: Sequence[str], trainer: Sequence[str]) -> List[str]:
    """torchrun's command line for ``launcher`` options and the trainer's ``trainer`` arguments."""
    out = list(launcher)
    if not any(a.split("=")[0] in _RENDEZVOUS_FLAGS for a in out):
        out.insert(0, "--standalone")
    if not any(a.split("=")[0] in ("--signals-to-handle", "--signals_to_handle") for a in out):
        out += ["--signals-to-handle", TORCHRUN_SIGNALS]
    return [*out, "-m", "megatron_stare.train", *trainer]


def children(pid: int) -> List[int]:
    """The live child processes of ``pid`` (from /proc): torchrun's workers."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


class Interrupts:
    """The SIGINT handler: forwards each press to the workers (see the module docstring)."""

    def __init__(self) -> None:
        self.presses = 0
        self.workers: List[int] = []
        """The workers the presses went to."""
        self._last: Optional[float] = None

    def handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last <= REPEAT_WINDOW_S:
            return  # a copy of the same press
        self._last = now
        self.presses += 1
        workers = children(os.getpid())
        self.workers = sorted(set(self.workers) | set(workers))
        if not workers:
            raise KeyboardInterrupt  # no worker started yet: nothing to save
        for pid in workers:
            _signal(pid, signal.SIGINT)
        if self.presses > 1:
            timer = threading.Timer(KILL_AFTER_S, _kill_groups, (workers,))
            timer.daemon = True
            timer.start()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _kill_groups(pids: Sequence[int]) -> None:
    """SIGKILL each worker's process group (a worker is a session leader: its children too)."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_status(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\n" + USAGE)
        return 0
    try:
        launcher, trainer = split_argv(argv)
    except ValueError as e:
        print(f"{USAGE}\nerror: {e}", file=sys.stderr)
        return 2
    fd, status = tempfile.mkstemp(prefix="megatron-stare-status.")
    os.close(fd)
    os.environ[STATUS_FILE_ENV] = status
    interrupts = Interrupts()
    previous = signal.signal(signal.SIGINT, interrupts.handle)
    failure = None
    try:
        torchrun.main(torchrun_argv(launcher, trainer))
        code = 0
    except SignalException as e:  # torchrun forwarded it and waited for the workers
        code = 128 + int(e.sigval)
    except ChildFailedError as e:
        code, failure = 1, e
    except KeyboardInterrupt:
        code = INTERRUPTED_EXIT_CODE
    finally:
        signal.signal(signal.SIGINT, previous)
        if interrupts.presses > 1:  # stopped at once: nothing of the workers' groups lives on
            _kill_groups(interrupts.workers)
        written = _read_status(status)
        engines = read_engines(status)
        for leftover in (status, status + ENGINES_SUFFIX):
            if os.path.exists(leftover):
                os.unlink(leftover)
    if written is not None:
        return written
    if interrupts.presses:
        return INTERRUPTED_EXIT_CODE
    if failure is not None:
        print(str(failure), file=sys.stderr)  # torchrun's failure summary
        for line in engine_deaths(failure.failures, engines):
            print(line, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
