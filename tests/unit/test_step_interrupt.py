"""Preemption inside a step (``step_interrupt.py``), piece by piece: the server engines' request
batch (``rollout/interruptible.py``), the reward pool (workers and inline). The whole path on 2
ranks, the relay of a signal that reaches only the rank that does not generate included:
``tests/e2e/test_train_resume.py``; colocated vLLM: ``tests/unit/test_rollout_vllm.py``."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_stare.config.load import RewardConfig
from megatron_stare.runtime.preemption import Preemption, StepInterrupted
from megatron_stare.rewards.pool import RewardPool
from megatron_stare.rollout.interruptible import run_requests
from megatron_stare.runtime.phases import SCORE
from megatron_stare.trainer.step_interrupt import StepInterrupts

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
    responses not yet sent, and the pool closes at once."""
    pool = RewardPool(RewardConfig(fn=SLOW, num_workers=1, timeout_s=60))
    try:
        fut = pool.submit(["ab"] * 4, [""] * 4)
        t0 = time.monotonic()
        pool.interrupt = SimpleNamespace(requested=lambda: time.monotonic() - t0 > 0.5)
        with pytest.raises(StepInterrupted):
            pool.wait(fut)
        assert time.monotonic() - t0 < 2 and not pool._pending
        pool.close()  # the call in flight is abandoned: its worker is killed, not waited for
        assert time.monotonic() - t0 < 4
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
