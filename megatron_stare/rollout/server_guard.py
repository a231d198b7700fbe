"""Run a server and end it, with everything it started, when the process that spawned it dies.

    python -m megatron_stare.rollout.server_guard -- ARGV...

A spawned server runs in a session of its own (so that ``shutdown`` ends exactly its process
group). That also cuts it loose from the rank that spawned it: when the rank dies without running
its ``atexit`` hooks (SIGKILL, torchrun's kill after its shutdown timeout, the OOM killer), the
server - holding its GPUs - would live on, orphaned. So the rank starts this guard as the session
leader instead, and the guard starts the server in the same process group. The guard checks
every ``POLL_S`` seconds that its parent is still the process that started it; once the parent is
gone it kills the whole group (the server and the processes it spawned, SIGTERM then SIGKILL).
A ``SIGTERM`` to the group (``shutdown``) reaches the guard and the server alike; the guard waits
for the server. The guard ends the way the server ended: the same exit code, or the same signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import List, Optional, Sequence

__all__ = ["POLL_S", "guarded", "main"]

#: How often the guard looks for its parent, in seconds.
POLL_S = 0.5
#: After the parent's death: how long the group gets between SIGTERM and SIGKILL, in seconds.
GRACE_S = 10.0


def guarded(argv: Sequence[str]) -> List[str]:
    """``argv`` wrapped in the guard (run it with ``start_new_session=True``)."""
    return [sys.executable, "-m", "megatron_stare.rollout.server_guard", "--", *argv]


def _end_as(code: int) -> int:
    """Exit like the server: its code, or the signal that killed it."""
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught anyway
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _kill_group(sig: int) -> None:
    """``sig`` to the guard's process group (the guard survives a SIGTERM to it, not a SIGKILL)."""
    if sig != signal.SIGKILL:
        signal.signal(sig, signal.SIG_IGN)
    try:
        os.killpg(os.getpgid(0), sig)
    except ProcessLookupError:
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m megatron_stare.rollout.server_guard -- ARGV...", file=sys.stderr)
        return 2
    parent = os.getppid()
    server = subprocess.Popen(args)  # same process group as the guard
    terminated = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))  # shutdown(): wait for the server
    while True:
        code = server.poll()
        if code is not None:
            return _end_as(code)
        if os.getppid() != parent and not terminated:  # the spawning rank is gone
            print(f"[server_guard] the process that started the server (pid {parent}) is gone: ending the "
                  f"server (pid {server.pid}) and its process group", file=sys.stderr, flush=True)
            _kill_group(signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
            while server.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            _kill_group(signal.SIGKILL)
            return 1
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
