"""Preemption: SIGTERM or SIGUSR1 makes the run checkpoint and exit 75; SIGINT (Ctrl-C) does the
same and exits 130. A signal during a step's rollout (generate, score) stops it at once and saves
the step's start (``step_interrupt.py``); in any other phase the step finishes and saves at the
boundary, as below.

A signal handler only records the signal. At every step boundary the ranks all-reduce (MAX) what
they recorded (``Preemption.agreed``), so every rank takes the same decision at the same step,
even when the signal reached only some of them, or reached them at different moments: a rank's
own decision could split the job (one rank saving, another waiting in the next step's
collective). The trainer then saves the step it has finished (unless it is saved already) and
exits with ``PREEMPTED_EXIT_CODE``; rerunning the same command resumes exactly.

How the signal reaches every rank (the launch scripts arrange it; see launch/common.sh):

- SLURM sends ``--signal=B:USR1@<lead>`` to the batch shell only, ``<lead>`` seconds before the
  time limit; the batch script relays it to ``srun``, which forwards it to each node's task, the
  launch shell, which relays it to torchrun.
- torchrun (torch 2.13, ``torch/distributed/elastic``) installs handlers only for the signals of
  ``--signals-to-handle`` (default SIGTERM,SIGINT,SIGHUP,SIGQUIT). Any other signal takes its
  default action: a SIGUSR1 kills torchrun (exit 138) and leaves the workers running, orphaned
  and never told. The launch scripts therefore add SIGUSR1.
- On a handled signal torchrun stops monitoring, sends the same signal to every worker's
  process group (``os.killpg``; each worker is a session leader, so its children that did not
  start their own session get it too), waits ``--shutdown-timeout`` seconds (default 30, or
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), then SIGKILLs the workers left. It then exits 1, whatever
  the workers returned: the launch shell maps a preempted run back to exit 75 through the
  status file named by ``STATUS_FILE_ENV`` (written by each node's local rank 0).

Ctrl-C: a terminal sends SIGINT to its foreground process group, and a launcher forwards it
again, so one press can arrive several times: copies within ``REPEAT_WINDOW_S`` of the first
count as one press. A second press later than that stops the process at once (the handler
raises ``KeyboardInterrupt``; ``train.main`` turns it into one line and exit 130, nothing saved:
the last complete checkpoint is what remains). ``python -m megatron_stare.run`` (the README's
command) forwards each press to the workers itself, so torchrun never sees SIGINT.

The grace period is the smaller of torchrun's shutdown timeout and the scheduler's warning lead;
a step plus a save must fit in it. If it does not, the SIGKILL lands mid-step or mid-save, and
the last complete checkpoint is what remains: saves are atomic (``checkpoint.py``).
Children the trainer starts that must outlive a preemption signal (reward workers) ignore
these signals; their parent ends them.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Dict, Optional, Sequence

from megatron_stare.runtime import notices

if TYPE_CHECKING:  # reward workers import this module and need no torch
    import torch
    import torch.distributed as dist

#: The signals that request a checkpoint-and-exit.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
#: Exit code of a run that stopped on a preemption signal after saving (sysexits' EX_TEMPFAIL:
#: "try again later"); rerun the same command to resume.
PREEMPTED_EXIT_CODE = 75
#: Exit code of a run stopped by Ctrl-C (SIGINT), saved or not: the shell's 128 + SIGINT.
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
#: SIGINTs within this many seconds of the first are copies of one press (terminal + launcher).
REPEAT_WINDOW_S = 1.0


class StepInterrupted(BaseException):
    """A preemption signal stopped a step's rollout (generate, gather or score) before the step's
    first optimizer update: the trainer's state is still the step's start (``step_interrupt.py``).
    A ``BaseException``, as ``KeyboardInterrupt``: ``except Exception`` (a reward's error
    handling, an engine's retry) must not swallow it."""

    def __init__(self, phase: str = "") -> None:
        super().__init__(phase)
        self.phase = phase


def exit_code(sig: Optional[int]) -> int:
    """The exit code of a run stopped by ``sig``: 130 for SIGINT, else 75."""
    return INTERRUPTED_EXIT_CODE if sig == signal.SIGINT else PREEMPTED_EXIT_CODE
#: When set, each node's local rank 0 writes its exit code to this file on a preempted exit, for
#: the launch shell (torchrun itself exits 1 whatever its workers return).
STATUS_FILE_ENV = "MEGATRON_STARE_STATUS_FILE"


class Preemption:
    """Records preemption signals; ``agreed()`` is the collective stop decision.

    ``install()`` must run in the main thread (Python's signal handlers live there); ``close()``
    restores the previous handlers. Usable as a context manager.
    """

    def __init__(self) -> None:
        self.received: Optional[int] = None
        """The first preemption signal this process received (its number), or None."""
        self.stopped_by: Optional[signal.Signals] = None
        """The signal the ranks agreed to stop on (``agreed``), or None."""
        self.received_at: Optional[float] = None
        """``time.monotonic()`` when ``received`` was recorded."""
        self.raise_now = False
        """Set around a call that can only be cut from the handler (an inline reward call): the
        handler then raises ``StepInterrupted`` after recording (``step_interrupt.py``)."""
        self.on_signal = None
        """Called with the signal number when the first one is recorded (``step_interrupt.py``
        notes the phase it came in); runs in the handler: it must only record."""
        self._first_interrupt: Optional[float] = None
        self._previous: Dict[int, object] = {}

    @classmethod
    def install(cls, signals: Sequence[signal.Signals] = PREEMPTION_SIGNALS) -> "Preemption":
        p = cls()
        for s in signals:
            p._previous[s] = signal.signal(s, p._record)
        return p

    def _record(self, signum: int, frame) -> None:
        # Only a flag: a handler runs between two bytecodes of the main thread, which may be in
        # the middle of a print or a collective; everything else happens at the step boundary or
        # at an interruptible phase's exit. The one exception: ``raise_now``, set only around a
        # call nothing else can cut (an inline reward call).
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_interrupt is None:
                self._first_interrupt = now
            elif now - self._first_interrupt > REPEAT_WINDOW_S:
                raise KeyboardInterrupt  # a second press: stop now
        self.note(signum)
        if self.raise_now:
            raise StepInterrupted()

    def note(self, signum: int) -> None:
        """Record ``signum`` unless a signal is recorded already (the handler; or a watcher
        thread that heard of it first: ``step_interrupt.py``)."""
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()
            if self.on_signal is not None:
                self.on_signal(signum)

    def agreed(self, group: Optional["dist.ProcessGroup"] = None,
               device: Optional["torch.device"] = None) -> Optional[signal.Signals]:
        """Collective over ``group``: the signal any rank received (the largest number), or None.

        One ``[1]`` int64 all-reduce (MAX) per call; every rank returns the same value.
        """
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        value = int(flag.item())
        self.stopped_by = signal.Signals(value) if value else None
        return self.stopped_by

    def exit_code(self) -> int:
        """The exit code of a run stopped by the agreed signal (``exit_code``)."""
        return exit_code(self.stopped_by)

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> "Preemption":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ignore_preemption_signals() -> None:
    """For child processes whose parent owns their lifetime (reward workers): torchrun's
    ``killpg`` and SLURM's step-wide signals reach them too, and their default action (exit)
    would lose the step in flight."""
    for s in PREEMPTION_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def write_status(code: int) -> None:
    """Write ``code`` to ``$MEGATRON_STARE_STATUS_FILE`` from this node's local rank 0 (if set)."""
    path = os.environ.get(STATUS_FILE_ENV)
    if path and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        with open(path, "w") as f:
            f.write(f"{code}\n")


def leave(code: int) -> int:
    """The process's exit with ``code``: a preempted rank (75, 130), its state saved and its
    files closed, runs the ``atexit`` handlers and ends at once (``os._exit``): the
    interpreter's teardown would spend seconds of the grace period in garbage collections that
    walk every object of torch, Megatron and the model (measured: 5-7 s on a busy 2-core host).
    Any other code is returned, for ``sys.exit``."""
    if code not in (PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE):
        return code
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def interrupted_again() -> int:
    """A second Ctrl-C stopped the process mid-step: one line (rank 0), the status file, 130."""
    if int(os.environ.get("RANK", "0")) == 0:
        notices.note("interrupted again: stopped without saving; the last complete checkpoint is kept",
                     err=True)
    write_status(INTERRUPTED_EXIT_CODE)
    return INTERRUPTED_EXIT_CODE


#: Beside the status file: one JSON line per rank that hosts a colocated engine (``note_engine``).
ENGINES_SUFFIX = ".engines"


def note_engine(engine: str, where: str) -> None:
    """Record that this rank hosts a colocated ``engine`` (``where``: in its process, or a
    server's pid and log), for the launcher's line if the rank dies (``run.py`` reports it)."""
    path = os.environ.get(STATUS_FILE_ENV)
    if not path:
        return
    line = json.dumps({"rank": int(os.environ.get("RANK", "0")), "pid": os.getpid(), "engine": engine,
                       "where": where})
    with open(path + ENGINES_SUFFIX, "a") as f:  # one short append per rank: whole lines
        f.write(line + "\n")


def read_engines(path: str) -> Dict[int, dict]:
    """``note_engine``'s records by global rank (none if the file is absent)."""
    out: Dict[int, dict] = {}
    try:
        with open(path + ENGINES_SUFFIX) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    out[int(rec["rank"])] = rec
                except (ValueError, KeyError, TypeError):
                    pass
    except OSError:
        pass
    return out
