"""A server engine's requests, cut short by a preemption signal (``step_interrupt.py``).

``run_requests`` sends a batch's HTTP requests from a thread pool and, while it waits, asks the
engine's ``interrupted()`` every ``POLL_S``. Once it is True, the requests not yet sent are
dropped, the engine's ``abort`` makes the server end the ones in flight (vLLM: ``/pause`` in
its abort mode, then ``/resume``, so an attached server is left serving; SGLang:
``/abort_request`` for all), their threads return (whatever the aborted replies say is not
read), and ``StepInterrupted`` is raised: the step's start is what the trainer saves.
"""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Callable, List, TypeVar

from megatron_stare.runtime.preemption import StepInterrupted

__all__ = ["ABORT_WAIT_S", "POLL_S", "run_requests"]

T = TypeVar("T")
#: How often a waiting batch asks whether to stop (seconds).
POLL_S = 0.1
#: How long the aborted requests' threads get to return before the pool is left behind.
ABORT_WAIT_S = 10.0


def run_requests(n: int, call: Callable[[int], T], *, max_workers: int, interrupted: Callable[[], bool],
                 abort: Callable[[], None]) -> List[T]:
    """``[call(i) for i in range(n)]`` on up to ``max_workers`` threads, in order; the first
    failing call's error is raised (after the others are done), as ``Executor.map`` does."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(n, max_workers)))
    cut = False
    try:
        futs = [pool.submit(call, i) for i in range(n)]
        while True:
            done, pending = wait(futs, timeout=POLL_S, return_when=FIRST_EXCEPTION)
            if not pending or any(not f.cancelled() and f.exception() is not None for f in done):
                break
            if interrupted():
                cut = True
                for f in pending:
                    f.cancel()
                abort()
                wait(futs, timeout=ABORT_WAIT_S)
                raise StepInterrupted("generate")
        return [f.result() for f in futs]
    finally:
        pool.shutdown(wait=not cut, cancel_futures=True)
