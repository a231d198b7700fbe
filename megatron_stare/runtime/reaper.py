"""No process outlives its rank: a watchdog that ends what a rank started, however the rank dies.

A rank starts helper processes it does not fully control: megatron-core's checkpoint-writer
Manager (a ``multiprocessing`` server it keeps for the process's life, ``checkpoint/dist_ckpt.py``),
the ``multiprocessing`` resource tracker, reward workers (``rewards/pool.py``) and engine servers
(``rollout/engines/vllm_server/server.py``, in a session of their own). On a clean exit each is ended by its
owner; a rank that dies of SIGKILL (the OOM killer, torchrun's kill after its shutdown timeout)
runs no ``atexit`` hook, and the Manager - which ignores the preemption signals by design - lived
on after such runs.

``install()`` (first thing in the trainer's ``main``) marks the rank's environment with
``MEGATRON_STARE_OWNER=<uuid>``, which every process it starts afterwards inherits (spawn,
``subprocess``, the servers' own children alike), and starts this module as a watchdog in a
session of its own (no signal to the rank's process group reaches it). The watchdog checks every
``POLL_S`` seconds that its parent is still the rank; once it is gone it sends SIGTERM to every
process carrying the mark, SIGKILL after ``GRACE_S`` to what is left, and exits: a few seconds
after the rank, nothing of it remains.

The rank is known by the pid in the token, not by the parent the watchdog first sees: a rank that
ends before the watchdog's interpreter has started (a config error right after ``install()``)
has already handed it to init, and a watchdog that took ``getppid()`` then as "the rank" would
wait forever. ``getppid() == pid`` holds exactly while the rank lives, and a reused pid cannot
pass it: an orphan is adopted by a process that already exists (init, a subreaper), never by a
new one that got the dead rank's pid.

    python -m megatron_stare.runtime.reaper TOKEN     (started by install(); not for people)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from typing import List, Optional, Sequence

__all__ = ["MARK", "install", "marked_processes"]

#: The environment variable that marks a rank's processes.
MARK = "MEGATRON_STARE_OWNER"
#: How often the watchdog checks its parent, in seconds.
POLL_S = 0.2
#: After the rank's death: how long its processes get between SIGTERM and SIGKILL, in seconds.
GRACE_S = 1.5


def marked_processes(name: str, value: str, exclude: Sequence[int] = ()) -> List[int]:
    """Pids of the processes whose environment holds ``name=value`` (read from /proc)."""
    needle = f"\0{name}={value}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in b"\0" + f.read() + b"\0":
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def install() -> Optional[int]:
    """Mark this process's future children and start the watchdog; its pid (None off Linux).
    Idempotent within a process: a second call keeps the first watchdog."""
    if not os.path.isdir("/proc") or os.environ.get(MARK, "").endswith(f":{os.getpid()}"):
        return None
    # The pid in the token keeps a rank started by another rank (tests) from inheriting its mark.
    token = f"{uuid.uuid4().hex}:{os.getpid()}"
    os.environ[MARK] = token
    proc = subprocess.Popen([sys.executable, "-m", "megatron_stare.runtime.reaper", token], start_new_session=True,
                            stdin=subprocess.DEVNULL)
    return proc.pid


def _end_all(token: str) -> None:
    me = (os.getpid(),)
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5.0)):
        for pid in marked_processes(MARK, token, me):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while marked_processes(MARK, token, me) and time.monotonic() < deadline:
            time.sleep(0.05)


def main(argv: Optional[Sequence[str]] = None) -> int:
    (token,) = sys.argv[1:] if argv is None else argv
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # ends only after the rank, whatever the rank is sent
    rank = int(token.rpartition(":")[2])  # install()'s pid: the watchdog's parent while it lives
    while os.getppid() == rank:
        time.sleep(POLL_S)
    _end_all(token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
