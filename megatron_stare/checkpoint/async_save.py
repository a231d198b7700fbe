"""Background checkpoints (``checkpoint.async_save``): megatron-core's asynchronous distributed
save, at most one in flight, a checkpoint "latest" only after its finalization on every rank.

A save (``checkpoint.save_checkpoint(..., background=saves)``) runs in two halves:

1. **At the step boundary, on the critical path:** megatron-core plans the save (its collectives),
   the small files are written (``common.pt``, ``rank_<r>.pt``, ``trainer_state.json``), and each
   rank's tensors are staged to host memory (``preload_fn``: a device-to-host copy on GPU; on CPU
   a view's storage is cloned, the rest is taken as is) into megatron-core's ``AsyncRequest``
   for the model and the optimizer, merged into one. ``AsyncCallsQueue`` forks a writer process
   for it (``TemporalAsyncCaller``: the fork is the snapshot of the state at that boundary; the
   trainer's later updates do not reach it), and the step goes on.
2. **In the background:** the writer process runs megatron-core's writes (forking its file
   workers, ``FileSystemWriterAsync``), which hash the bytes as they write them
   (``checkpoint_writer``), while the next step generates and trains. It runs at a lower
   priority (``WRITER_NICENESS``): where cores are short, the step's own threads go first.
3. **Finalization** (``poll`` at every step boundary, collective: one ``[1]`` all-reduce while a
   save is pending; ``wait`` before the next save, at a preemption and at the end of the run):
   once every rank's writer is done, megatron-core gathers the write results and writes its
   metadata, the ``.partial`` sub-directories are completed, the manifest written from the
   writers' digests, and the directory renamed ``step_<N>``: only now is it the latest
   checkpoint (``checkpoint.latest_complete``). A write error (a full disk in a worker) is found
   here and raised on every rank as the same ``CheckpointError`` line as a synchronous save's
   (``checkpoint._cause``, ``_save_agreed``); the partial directory is removed, the previous
   checkpoint stays the latest.

A rank that dies (SIGKILL) mid-write takes its writer process and the writer's workers with it
(``checkpoint_writer.die_with_parent``); a rank that leaves with an error while a save is
pending kills its writer at exit (the save was never finalized: nothing of it is used). Either
way the ``.partial`` directory is left and ignored, and the previous checkpoint stays the latest.

Memory: the staged copy is a second host copy of this rank's share of the state on GPU; on CPU
the fork shares the pages copy-on-write (the trainer's next updates copy what they touch).
"""

from __future__ import annotations

import atexit
import os
import queue
import signal
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple
from megatron_stare.checkpoint.writer import WORKER_KILLED_EXIT, die_with_parent, watch_workers

__all__ = ["BackgroundSaves"]

#: How much lower the background writer process and its workers run than the rank (``os.nice``).
WRITER_NICENESS = 10


def _write_all(calls: List[Tuple[Callable, tuple, dict]]) -> None:
    """The writer process: megatron-core's write function of each part, in order (each puts its
    results on megatron-core's results queue, in the same order the finalizers read them)."""

    die_with_parent()
    watch_workers()
    # Below the trainer, whose next step this write overlaps (its file workers inherit it).
    os.nice(WRITER_NICENESS)
    for fn, args, kwargs in calls:
        fn(*args, **kwargs)


def merge_requests(requests: List[Any], finalize: Callable[[], None]):
    """One ``AsyncRequest`` doing the writes of ``requests`` (megatron-core's, one per
    distributed checkpoint) in one writer process, finalized by ``finalize`` alone. The
    tensors are staged now (``preload_fn``: device to host, in this process before the fork)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    calls = []
    for r in requests:
        if r.async_fn is None:  # nothing to write on this rank
            continue
        args = list(r.async_fn_args)
        if r.preload_fn is not None:
            args[1] = r.preload_fn()  # the write buckets, on the host
        calls.append((r.async_fn, tuple(args), dict(r.async_fn_kwargs)))
    return AsyncRequest(_write_all if calls else None, (calls,), [finalize])


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _drain_results_queue() -> None:
    """Drop write results no finalizer read (a failed finalization skips the later parts')."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    q = getattr(filesystem_async, "_results_queue", None)
    while q is not None:
        try:
            q.get_nowait()
        except (queue.Empty, EOFError, OSError):
            return


class BackgroundSaves:
    """The run's background checkpoint saves, at most one in flight; collective methods.

    ``enabled`` False: ``save_checkpoint`` saves synchronously and ignores this object.
    ``done(path)`` is called on every rank when a save is finalized (``console.saved``).
    """

    def __init__(self, enabled: bool, done: Callable[[Path], Any] = lambda path: path) -> None:
        self.enabled, self.done = bool(enabled), done
        self.queue = None
        self.pending: Optional[int] = None  # the step of the save in flight
        self._finish: Optional[Callable[[Optional[str]], Path]] = None
        self._root: Optional[Path] = None
        self._parts: List[Tuple[Any, Callable[[], Path]]] = []
        self._writer = None  # this rank's writer process of the save in flight (its exit code)
        if self.enabled:
            atexit.register(self.abort)  # runs before multiprocessing's exit hook joins the writer

    def start(self, step: int, root: Path, parts: List[Tuple[Any, Callable[[], Path]]],
              finish: Callable[[Optional[str]], Path]) -> None:
        """Schedule the writes of ``parts`` (``(AsyncRequest, finish_part)`` per distributed
        checkpoint: ``dist_ckpt.save_sharded(..., background=True)``); at finalization each part
        is finished, then ``finish(problem)`` completes the checkpoint (``checkpoint._complete``)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.wait()
        if self.queue is None:
            self.queue = AsyncCallsQueue(persistent=False)  # a forked writer per save
        self._parts, self._finish, self._root = parts, finish, root
        self.queue.schedule_async_request(merge_requests([r for r, _ in parts], self._finalize))
        self._writer = getattr(self.queue.async_calls[-1].async_caller, "process", None)
        self.pending = step

    def _finalize(self) -> None:
        """megatron-core's finalization of the merged request, on every rank: each part's
        finalizers (write results, metadata) and completion, then the checkpoint's."""
        from megatron_stare.checkpoint.core import SAVE_ERRORS, _cause

        parts, finish, problem = self._parts, self._finish, None
        self._parts, self._finish = [], None
        killed = self._killed_writer()  # collective, so on every rank whatever fails after it
        try:
            for request, finish_part in parts:
                for fn in request.finalize_fns:
                    fn()
                finish_part()
        except SAVE_ERRORS as e:  # megatron raises a worker's failure alike on every rank
            problem = killed or _cause(e, self._root)
            _drain_results_queue()
        self.done(finish(problem))

    def _killed_writer(self) -> Optional[str]:
        """Collective: which rank's writer died before it reported (killed by a signal - the OOM
        killer's SIGKILL, most often - or exited non-zero), as ``checkpoint.WRITER_DIED`` and the
        detail, or None. megatron-core sees only an empty results queue on that rank."""
        import torch.distributed as dist

        from megatron_stare.checkpoint.core import WRITER_DIED

        code = self._writer.exitcode if self._writer is not None else None
        self._writer = None
        codes = [None] * dist.get_world_size()
        dist.all_gather_object(codes, code)
        rank, code = next(((r, c) for r, c in enumerate(codes) if c), (None, None))
        if rank is None:
            return None
        if code < 0:
            who = f"rank {rank}'s writer process was killed by {_signal_name(-code)}"
        elif WORKER_KILLED_EXIT < code <= WORKER_KILLED_EXIT + 64:
            who = f"a file worker of rank {rank}'s writer was killed by {_signal_name(code - WORKER_KILLED_EXIT)}"
        else:
            who = f"rank {rank}'s writer process exited with code {code}"
        return f"{WRITER_DIED}: {who} before the write finished"

    def poll(self) -> None:
        """Collective: finalize the save in flight if every rank's writer is done; else return."""
        if self.pending is not None:
            self._finalize_calls(blocking=False)

    def wait(self) -> None:
        """Collective: wait for the save in flight (if any) and finalize it."""
        if self.pending is not None:
            self._finalize_calls(blocking=True)

    def _finalize_calls(self, blocking: bool) -> None:
        try:
            if self.queue.maybe_finalize_async_calls(blocking=blocking):
                self.pending = None
        except BaseException:
            self.pending = None  # a failed save is over (its error names it)
            raise

    def close(self) -> None:
        """Collective: finalize the save in flight (the run's end, a preemption)."""
        self.wait()

    def abort(self) -> None:
        """Not collective: kill the writer of a save that will never be finalized (this rank is
        leaving with an error); a no-op once finalized."""
        if self.pending is not None and self.queue is not None:
            for call in self.queue.async_calls:
                process = getattr(call.async_caller, "process", None)
                if process is not None and process.is_alive():
                    process.kill()
                    process.join()
            self.queue.async_calls.clear()
            self.pending = None
