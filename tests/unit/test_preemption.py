"""Preemption signals: recorded by a handler, agreed collectively, handlers restored."""

import os
import signal

import pytest

from megatron_stare.runtime.preemption import (PREEMPTED_EXIT_CODE, PREEMPTION_SIGNALS, STATUS_FILE_ENV, Preemption,
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


def _writer_queue_after_signals(rank, world, immune, out_dir):
    """Start megatron-core's checkpoint-writer results queue (``immune``: through
    ``start_writer_results_queue``), send its Manager every preemption signal as torchrun's
    ``killpg`` would, then save and load a sharded checkpoint through it. Returns (Manager alive,
    loaded tensor or the save's error, signal this rank recorded, signal mask unchanged)."""
    import time

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_stare.compat import cpu as cpu_compat
    from megatron_stare.checkpoint.dist_ckpt import start_writer_results_queue

    cpu_compat.apply()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with Preemption.install() as p:
        if immune:
            start_writer_results_queue()
        else:
            filesystem_async._get_write_results_queue()
        manager = filesystem_async._results_queue._manager._process
        for s in PREEMPTION_SIGNALS:
            os.kill(manager.pid, s)
        time.sleep(1.0)
        alive = manager.is_alive()
        w = torch.arange(6.0).reshape(2, 3)
        os.makedirs(out_dir)
        try:
            dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0)}, out_dir)
            loaded = dist_checkpointing.load(
                {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), replica_id=0)}, out_dir)["w"]
        except Exception as e:  # noqa: BLE001 - the unprotected Manager's failure is the point
            loaded = f"{type(e).__name__}: {e}"
        return alive, loaded, p.received, signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask


def test_checkpoint_writer_survives_preemption_signals(tmp_path):
    """torchrun delivers a preemption signal to each rank's whole process group, Megatron's
    checkpoint-writer Manager included; the save the signal asks for still works (CI once saw the
    Manager die mid-start: EOFError). Without ``start_writer_results_queue`` the Manager dies and
    the save fails: the protection is needed. The rank itself received nothing; its mask is as
    before."""
    import torch

    (alive, loaded, received, mask_same), = run_on_ranks(_writer_queue_after_signals, 1, True, str(tmp_path / "a"))
    assert alive and received is None and mask_same
    assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, torch.arange(6.0).reshape(2, 3)), loaded
    (alive, loaded, _, _), = run_on_ranks(_writer_queue_after_signals, 1, False, str(tmp_path / "b"))
    assert not alive and isinstance(loaded, str), loaded


def test_ctrl_c_copies_are_one_press_and_a_later_press_stops_at_once(monkeypatch):
    """SIGINT is a preemption signal (exit 130); copies within REPEAT_WINDOW_S of the first (a
    terminal's and a launcher's) are one press; a press after that raises KeyboardInterrupt."""
    from megatron_stare.runtime import preemption

    assert signal.SIGINT in PREEMPTION_SIGNALS
    assert preemption.exit_code(signal.SIGINT) == 130 and preemption.exit_code(signal.SIGTERM) == 75
    clock = [100.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    before = signal.getsignal(signal.SIGINT)  # close() restores whatever was installed before
    with Preemption.install() as p:
        os.kill(os.getpid(), signal.SIGINT)
        clock[0] += preemption.REPEAT_WINDOW_S - 0.01
        os.kill(os.getpid(), signal.SIGINT)  # a copy of the same press: only recorded
        assert p.received == signal.SIGINT
        clock[0] += 0.02
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
