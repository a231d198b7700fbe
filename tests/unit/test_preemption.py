"""Preemption signals: recorded by a handler, agreed collectively, handlers restored."""

import os
import signal

import pytest

from megatron_stare.preemption import (PREEMPTED_EXIT_CODE, PREEMPTION_SIGNALS, STATUS_FILE_ENV, Preemption,
                                       write_status)
from megatron_stare.testing.distributed import run_on_ranks


def _agree(rank, world, signalled_rank, rounds):
    """Each round: ``signalled_rank`` (None: nobody) sends itself SIGUSR1 in round 1; every rank
    returns what ``agreed()`` said in each round."""
    out = []
    with Preemption.install() as p:
        for r in range(rounds):
            if r == 1 and rank == signalled_rank:
                os.kill(os.getpid(), signal.SIGUSR1)
            got = p.agreed()
            out.append(None if got is None else got.name)
        out.append(p.received)
    return out


@pytest.mark.distributed
def test_one_rank_signalled_all_ranks_agree():
    """Rank 1 alone is signalled: from that boundary on, both ranks see SIGUSR1 (rank 0 never
    received it); no signal anywhere: nobody stops."""
    r0, r1 = run_on_ranks(_agree, 2, 1, 3)
    assert r0[:3] == r1[:3] == [None, "SIGUSR1", "SIGUSR1"]
    assert r0[3] is None and r1[3] == signal.SIGUSR1
    assert run_on_ranks(_agree, 2, None, 2) == [[None, None, None]] * 2


def test_handler_records_first_signal_and_restores(tmp_path, monkeypatch):
    before = {s: signal.getsignal(s) for s in PREEMPTION_SIGNALS}
    with Preemption.install() as p:
        os.kill(os.getpid(), signal.SIGTERM)  # would end this process without the handler
        os.kill(os.getpid(), signal.SIGUSR1)
        assert p.received == signal.SIGTERM
    assert {s: signal.getsignal(s) for s in PREEMPTION_SIGNALS} == before
    status = tmp_path / "status"
    monkeypatch.setenv(STATUS_FILE_ENV, str(status))
    monkeypatch.setenv("LOCAL_RANK", "1")
    write_status(PREEMPTED_EXIT_CODE)
    assert not status.exists()  # only a node's local rank 0 writes
    monkeypatch.setenv("LOCAL_RANK", "0")
    write_status(PREEMPTED_EXIT_CODE)
    assert status.read_text() == "75\n"
