"""megatron-core's checkpoint-writer processes: they hash what they write, and die with their parent.

megatron-core 0.16.1's ``FileSystemWriterAsync.write_preloaded_data`` writes each tensor file
(``__<rank>_<n>.distcp``, nearly all of a checkpoint's bytes) in a forked worker process, for the
synchronous save (workers forked by the rank) and the background one (``async_save.py``:
workers forked by a writer process the rank forked). Two things are added to those processes,
through the one name they open their file with (``filesystem_async.open``, which shadows the
builtin in that module only; ``install()``):

- **Content hashes as written.** The file object is wrapped so every ``write`` also feeds a
  SHA-256; on close (after megatron-core's ``fsync``) the digest and the byte count go into a
  sidecar ``<file>.sha256``. The manifest (``checkpoint_manifest.write_manifest``) takes the digest
  from there instead of reading the file back, and removes the sidecar. torch's writer writes
  each file front to back (``_write_item`` through a write-only ``NoCloseWriter``; ``tell`` only):
  should any other file method be used (``seek``, ...), no sidecar is written and the file is
  read back as before. Verification on load reads the files themselves (the sidecars are gone).
- **Writers ignore the preemption signals** torchrun sends to the rank's process group (which
  they share): they would run the rank's recording handlers otherwise, or raise
  ``KeyboardInterrupt`` mid-write on a second Ctrl-C.
- **No writer outlives its rank.** A forked process does not carry the reaper's mark
  (``reaper.py`` finds processes by their environment *at exec*, which a fork shares with its
  parent's exec), so each writer asks the kernel to SIGKILL it when its parent dies
  (``PR_SET_PDEATHSIG``): a rank killed mid-write takes its writer process, and that one its
  workers, down within milliseconds. The parent is the one recorded just before the fork (an
  ``os.register_at_fork`` hook): if it is already gone when the child looks, the child exits.
- **A file worker killed alone does not hang the save.** megatron-core's writer waits on its
  workers' results queue with no timeout: a worker the OOM killer took never reports, and the
  writer (so the rank's finalization) would wait forever. The background writer watches its
  children (``watch_workers``: ``waitid`` with ``WNOWAIT``, which looks at a dead child without
  reaping it, so megatron-core's own joins still work) and, on a worker killed by a signal,
  exits at once with ``WORKER_KILLED_EXIT + signal``: the finalization names it on every rank.
  The synchronous save forks its workers from the rank itself, which waits for them the same way
  (``count_queue.join()``, no timeout). There the write is wrapped (``_watched_multiproc``): a
  thread watches the workers this write forked, and on one killed by a signal it interrupts the
  rank's wait (a signal to the main thread whose handler raises), kills the write's other
  workers, and hands megatron-core the failure as the write's result, as a worker's own error
  would be. megatron-core's gather of the write results then raises it on every rank (one
  ``CheckpointError`` line naming the worker and the signal), instead of the rank hanging and the
  others waiting for it in that gather.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Collection, List, Optional
import ctypes

#: The sidecar a writer leaves beside each file it wrote: ``{"size": n, "sha256": hex}``.
HASH_SUFFIX = ".sha256"
#: Methods a hashed file may be used through without losing track of its bytes.
_SAFE = frozenset({"tell", "flush", "fileno", "name", "closed", "mode", "writable", "isatty"})

#: A background writer's exit code when one of its file workers was killed: this + the signal.
WORKER_KILLED_EXIT = 160
#: How often the background writer looks at its file workers, in seconds.
WATCH_INTERVAL_S = 0.25

_fork_parent: Optional[int] = None  # the pid that forked this process (set in the parent, inherited)
_rank_pid: Optional[int] = None  # the process that installed the hooks: never a writer itself


class HashingFile:
    """A binary file opened for writing whose ``write`` calls also feed a SHA-256 (``digest``
    after ``close``: the bytes in write order, i.e. the file's contents when it is written
    sequentially). Any method not known to keep that true marks the file as not hashed."""

    def __init__(self, f, path: str) -> None:
        self._f, self._path, self._sha, self.size, self.sequential = f, path, hashlib.sha256(), 0, True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self._sha.update(view)
        self.size += view.nbytes
        return self._f.write(view)

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.close()
        if self.sequential and self.size == os.path.getsize(self._path):
            # Written in place: a torn sidecar does not parse, and the file is then read back.
            with builtins.open(self._path + HASH_SUFFIX, "w") as s:
                json.dump({"size": self.size, "sha256": self._sha.hexdigest()}, s)

    def __enter__(self) -> "HashingFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):
        if name not in _SAFE:
            self.sequential = False
        return getattr(self._f, name)


def written_sha256(path: Path) -> Optional[str]:
    """The SHA-256 the writer computed for ``path`` while writing it, or None (no sidecar, or
    one that does not match the file's size)."""
    try:
        entry = json.loads(Path(str(path) + HASH_SUFFIX).read_text())
        return entry["sha256"] if int(entry["size"]) == Path(path).stat().st_size else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def die_with_parent() -> None:
    """In a forked writer: ignore the preemption signals (the rank decides: it waits for its
    writers, then stops) and be SIGKILLed when the parent that forked this process dies (Linux);
    exit at once if that parent is gone already. A no-op in the rank itself (should a future
    megatron-core write in-process)."""
    if os.getpid() == _rank_pid:
        return
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if _fork_parent is not None and os.getppid() != _fork_parent:
        os._exit(1)


def _children() -> List[int]:
    """The pids of this process's children (those its main thread forked; Linux), or []."""
    try:
        return [int(c) for c in Path(f"/proc/self/task/{os.getpid()}/children").read_text().split()]
    except OSError:
        return []


def _killed_child(exclude: Collection[int] = ()) -> Optional[int]:
    """The signal that killed a child of this process that is not yet reaped, or None (Linux);
    children in ``exclude`` are not looked at."""
    for pid in _children():
        if pid in exclude:
            continue
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        if info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            return info.si_status
    return None


def watch_workers() -> None:
    """In a background writer: a daemon thread that ends this process with
    ``WORKER_KILLED_EXIT + signal`` once one of its file workers is killed (its other workers
    die with it: ``die_with_parent``). A no-op off Linux."""
    if not sys.platform.startswith("linux") or not hasattr(os, "waitid"):
        return

    def watch():
        while True:
            time.sleep(WATCH_INTERVAL_S)
            sig = _killed_child()
            if sig is not None:
                os._exit(WORKER_KILLED_EXIT + sig)

    threading.Thread(target=watch, name="checkpoint-worker-watch", daemon=True).start()


class WorkerKilled(Exception):
    """Raised in the rank's main thread, inside a synchronous write, when a worker was killed."""


#: The signal the watch sends the rank's main thread to end its wait (unused elsewhere).
_INTERRUPT = signal.SIGUSR2


def _watched_multiproc(write):
    """megatron-core's ``write_preloaded_data_multiproc``, watched when the rank's main thread
    runs it itself (the synchronous save; see the module docstring). Elsewhere (in a background
    writer, which ``watch_workers`` watches; in another thread, where no signal handler can be
    set) it is ``write`` as is."""

    def run(transform_list, use_msc, rank, write_buckets, global_results_queue):
        if (os.getpid() != _rank_pid or threading.current_thread() is not threading.main_thread()
                or not sys.platform.startswith("linux") or not hasattr(os, "waitid")):
            return write(transform_list, use_msc, rank, write_buckets, global_results_queue)
        before, killed, stop, main = set(_children()), [], threading.Event(), threading.get_ident()

        def interrupt(signum, frame):
            if killed and not stop.is_set():
                raise WorkerKilled(killed[0])

        def watch():
            while not stop.wait(WATCH_INTERVAL_S):
                sig = _killed_child(exclude=before)
                if sig is not None:
                    killed.append(sig)
                    signal.pthread_kill(main, _INTERRUPT)
                    return

        previous = signal.signal(_INTERRUPT, interrupt)
        watcher = threading.Thread(target=watch, name="checkpoint-worker-watch", daemon=True)
        watcher.start()
        try:
            write(transform_list, use_msc, rank, write_buckets, global_results_queue)
        except WorkerKilled as e:
            stop.set()
            for pid in set(_children()) - before:  # this write's other workers: their files are abandoned
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            global_results_queue.put(RuntimeError(
                f"a file worker of rank {rank} was killed by {_signal_name(e.args[0])} before the write finished"))
        finally:
            stop.set()
            watcher.join()
            signal.signal(_INTERRUPT, previous)

    run.__wrapped__ = write
    return run


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _writer_open(file, mode="r", *args, **kwargs):
    """``open`` as megatron-core's writer worker sees it (it opens only its output file)."""
    f = builtins.open(file, mode, *args, **kwargs)
    if mode != "wb":
        return f
    die_with_parent()
    return HashingFile(f, os.fspath(file))


def _remember_parent() -> None:
    global _fork_parent
    _fork_parent = os.getpid()


def install() -> None:
    """Route megatron-core's writer workers through ``_writer_open``; idempotent."""
    global _rank_pid
    if _rank_pid is not None:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.open = _writer_open
    cls = filesystem_async.FileSystemWriterAsync
    cls.write_preloaded_data_multiproc = staticmethod(_watched_multiproc(cls.write_preloaded_data_multiproc))
    os.register_at_fork(before=_remember_parent)
    _rank_pid = os.getpid()
