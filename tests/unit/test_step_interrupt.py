"""Preemption inside a step (``step_interrupt.py``), piece by piece: the server engines' request
batch (``rollout/interruptible.py``), the reward pool (workers and inline), and the ranks'
agreement when the signal reaches only the rank that does not generate (real gloo, a real
SIGTERM, the relay through the rendezvous store). The whole path, end to end on 2 ranks:
``tests/e2e/test_train_resume.py``; colocated vLLM: ``tests/unit/test_rollout_vllm.py``."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_stare.config import RewardConfig
from megatron_stare.preemption import Preemption, StepInterrupted
from megatron_stare.rewards.pool import RewardPool
from megatron_stare.rollout.interruptible import run_requests
from megatron_stare.rollout.phases import GENERATE, SCORE
from megatron_stare.step_interrupt import StepInterrupts
from megatron_stare.testing.distributed import run_on_ranks

SLOW = "megatron_stare.testing.rewards:slow_parity_reward"


def test_server_requests_are_aborted_once_interrupted():
    """Requests that only return once the server aborts them: ``abort`` is called once, the
    batch raises ``StepInterrupted`` within a poll or two; without a signal, results in order and
    the first error raised."""
    aborted = threading.Event()
    calls = []
    t0 = time.monotonic()

    def call(i):
        calls.append(i)
        aborted.wait(30)
        return i

    with pytest.raises(StepInterrupted):
        run_requests(8, call, max_workers=3, interrupted=lambda: time.monotonic() - t0 > 0.3,
                     abort=aborted.set)
    assert aborted.is_set() and time.monotonic() - t0 < 3 and len(calls) == 3  # the rest never sent
    assert run_requests(5, lambda i: i * i, max_workers=2, interrupted=lambda: False, abort=None) == [0, 1, 4, 9, 16]

    def fails(i):
        if i == 2:
            raise ValueError("boom")
        return i

    with pytest.raises(ValueError, match="boom"):
        run_requests(4, fails, max_workers=2, interrupted=lambda: False, abort=None)


def test_reward_workers_stop_waiting_when_interrupted():
    """Workers scoring 5 s per response: ``wait`` raises within a poll of the request, drops the
    responses not yet sent, and the pool still closes."""
    pool = RewardPool(RewardConfig(fn=SLOW, num_workers=1, timeout_s=60))
    try:
        fut = pool.submit(["ab"] * 4, [""] * 4)
        t0 = time.monotonic()
        pool.interrupt = SimpleNamespace(requested=lambda: time.monotonic() - t0 > 0.5)
        with pytest.raises(StepInterrupted):
            pool.wait(fut)
        assert time.monotonic() - t0 < 2 and not pool._pending
    finally:
        pool.close()


def _interrupts(pool):
    tr = SimpleNamespace(preemption=Preemption.install(), engine=None, pool=pool,
                         cfg=SimpleNamespace(checkpoint=SimpleNamespace(dir=None)),
                         groups=SimpleNamespace(device=torch.device("cpu")))
    return StepInterrupts(tr)


def test_inline_reward_call_is_cut_by_the_signal():
    """Inline scoring (``num_workers=0``): a SIGTERM 0.5 s into a 5 s reward call raises out of
    the call (the handler, inside the scoring phase) and the phase stops; outside an interruptible
    phase the same signal is only recorded."""
    pool = RewardPool(RewardConfig(fn=SLOW, num_workers=0, timeout_s=60))
    si = _interrupts(pool)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        with pytest.raises(StepInterrupted):
            with si.phase(SCORE):
                pool.submit(["ab", "abc"], ["", ""])
        assert time.monotonic() - t0 < 2.5
        assert si.pre.stopped_by == signal.SIGTERM and si.heard[0] == "score of step 0"
    finally:
        si.close()
        si.pre.close()
        pool.close()


def _relay(rank, world):
    """Rank 0 'generates' (polls ``requested()`` between 10 ms decode steps, for up to 30 s);
    rank 1 has nothing to generate and waits in the agreement; rank 1 alone gets SIGTERM 1 s in."""
    pool = RewardPool(RewardConfig(fn="megatron_stare.testing.rewards:parity_reward", num_workers=0))
    si = _interrupts(pool)
    t0, steps, stopped = time.monotonic(), 0, False
    if rank == 1:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    try:
        with si.phase(GENERATE):
            while rank == 0 and steps < 3000:
                if si.requested():
                    raise StepInterrupted("generate")
                time.sleep(0.01)
                steps += 1
    except StepInterrupted:
        stopped = True
    finally:
        si.close()
        si.pre.close()
    return stopped, time.monotonic() - t0, si.pre.received, int(si.pre.stopped_by or 0), steps


@pytest.mark.distributed
def test_a_signal_on_the_waiting_rank_stops_the_generating_one():
    """The waiting rank is blocked in a gloo all-reduce when its SIGTERM comes: the relay thread
    hears it (the wakeup fd), publishes it in the store, rank 0's relay finds it, rank 0 stops
    between decode steps, and both ranks leave the agreement with SIGTERM, seconds before the
    30 s 'generation' would have ended."""
    (s0, t0, r0, a0, n0), (s1, t1, r1, a1, _) = run_on_ranks(_relay, 2, timeout=120)
    assert s0 and s1 and a0 == a1 == signal.SIGTERM
    assert r0 == r1 == signal.SIGTERM  # rank 0 heard it from the store
    assert n0 < 3000 and t0 < 5 and t1 < 5, (t0, t1, n0)
