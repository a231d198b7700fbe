"""Time-based saves: ``SaveClock`` with an injected clock, on one process and on 2 gloo ranks
whose clocks disagree (the decision follows rank 0's)."""

import pytest

from megatron_stare.checkpoint.schedule import SaveClock
from megatron_stare.testing.distributed import run_on_ranks


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_due_after_the_interval_and_restarted_by_a_save():
    clock = FakeClock()
    sc = SaveClock(2.0, clock)
    clock.t += 119.0
    assert not sc.due()
    clock.t += 1.0
    assert sc.due() and sc.due()  # stays due until a save happens
    sc.saved()
    assert not sc.due()
    clock.t += 120.0
    assert sc.due()


def test_zero_minutes_is_off():
    clock = FakeClock()
    sc = SaveClock(0.0, clock)
    clock.t += 1e9
    assert not sc.due()


def _decisions(rank, world, offsets):
    # Each rank's clock runs at its own offset and rate; only rank 0's may decide.
    clock = FakeClock(5000.0 * rank)
    sc = SaveClock(1.0, clock)
    out = []
    for dt in offsets:
        clock.t += dt * (1 if rank == 0 else 10)
        out.append(sc.due())
        if out[-1]:
            sc.saved()
    return out


@pytest.mark.distributed
def test_ranks_agree_on_rank0s_clock():
    offsets = [30.0, 29.0, 1.0, 50.0, 20.0]
    want = [False, False, True, False, True]  # rank 0 alone: 30, 59, 60 (save), 50, 70 (save)
    assert run_on_ranks(_decisions, 2, offsets) == [want, want]
