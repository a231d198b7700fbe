"""A server process a rank spawns and owns: its own session, a clean environment, a kill of its
process group only.

Why each part (the colocated ``sglang`` engine hosts SGLang this way; ``docs/cluster-paths.md``):

- **Environment** (``server_environ``): torchrun's worker variables are dropped. The server is no
  torchrun worker; torch's ``tcp://`` rendezvous inside it reads ``TORCHELASTIC_USE_AGENT_STORE``
  as "torchrun's agent hosts every store" and makes even rank 0 a store client, so its start-up
  would wait for a store nobody hosts until the timeout.
- **Session** (``start_new_session``, through ``server_guard``): torchrun forwards a preemption
  signal to the worker's process group; a server in that group would die with the rank's first
  SIGTERM, before the rank saved. In a session of its own it keeps serving until the rank ends
  it. Nothing the server does to signal handlers, the event-loop policy, the multiprocessing
  start method or its environment reaches the rank: those are its own process's.
- **Shutdown** (``shutdown``): SIGTERM, then SIGKILL, to the server's process group alone; the
  rank's other children (an asynchronous checkpoint's writer, its file workers, the reaper) are
  not in it. The guard ends the group if the rank dies without shutting it down.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
import shlex
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Dict, Mapping, Sequence, Tuple

from megatron_stare.rollout.http import EngineFailure
from megatron_stare.rollout.server_guard import guarded

__all__ = ["ServerCommand", "SpawnedServer", "TORCHRUN_VARS", "end_group", "port_free", "server_environ"]

log = logging.getLogger(__name__)

CONSOLE_ONLY_ENV: set = set()
"""Environment variables the console set for this process only (``trainer.console``), which a
spawned server must not inherit: it logs on its own terms, into its log file."""

#: A torchrun worker's own variables (besides every ``TORCHELASTIC_*``), which a spawned server
#: must not inherit.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ServerCommand:
    """A server's command line and the environment it needs on top of the caller's."""

    argv: Tuple[str, ...]
    env: Dict[str, str]

    def shell(self) -> str:
        """One line for a launch script: ``VAR=... python -m ...``."""

        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()),
                         *(shlex.quote(a) for a in self.argv)])


def server_environ(env: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """``env`` without torchrun's worker variables and the console's own: what a spawned server
    inherits (it logs on its own terms, into its log file)."""
    return {k: v for k, v in env.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")
            and k not in CONSOLE_ONLY_ENV}


def end_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """End the process group ``proc`` leads (started with ``start_new_session``): SIGTERM, then
    SIGKILL after ``grace_s``; the caller's other children are not in it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class SpawnedServer:
    """``argv`` started as a server in a session of its own (``server_guard`` leads it), with
    ``server_environ()`` plus ``env``, its output in a log file; ``wait_ready`` polls
    ``health_url``. ``shutdown`` (also at exit) ends its process group only."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], health_url: str) -> None:
        self.name, self.health_url, self.keep_log = name, health_url, False
        self._log = tempfile.NamedTemporaryFile(prefix=f"{name}_", suffix=".log", delete=False)
        log.info("starting %s (log: %s)", name, self._log.name)
        self.proc = subprocess.Popen(guarded(argv), env={**server_environ(), "OMP_NUM_THREADS": "1", **env},
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.shutdown)

    @property
    def log_name(self) -> str:
        return self._log.name

    def log_tail(self, n: int = 40) -> str:
        with open(self._log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def failure(self, what: str) -> EngineFailure:
        """``what`` went wrong: one line naming the server, then its log's tail (the log is kept)."""
        self.keep_log = True
        return EngineFailure(f"{self.name} (pid {self.proc.pid}) {what}; its log tail ({self._log.name}, kept):\n"
                             f"{self.log_tail()}")

    def exit_code(self, wait_s: float = 2.0):
        """The server's exit code, or None while it runs (a dying server gets ``wait_s`` to go)."""
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def wait_ready(self, timeout_s: float) -> None:
        """Until ``health_url`` answers 200; EngineFailure if the server exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.failure(f"exited with code {self.proc.returncode} during start-up")
            try:
                with urllib.request.urlopen(self.health_url, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        raise self.failure(f"not ready after {timeout_s:.0f}s")

    def shutdown(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.shutdown)
        end_group(proc, grace_s)
        self._log.close()
        if not self.keep_log:
            os.unlink(self._log.name)


def port_free(host: str, port: int) -> bool:
    """Whether ``port`` of ``host`` can be bound now (a restarted server takes its old port back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
