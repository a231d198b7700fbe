"""Time-based checkpoints (``checkpoint.save_every_minutes``), decided alike on every rank.

A save is collective, so the decision to save must be the same on every rank at the same step
boundary; each rank's own clock could disagree by the skew between nodes (or by how long each
rank waited in the step's last collective). ``SaveClock.due`` therefore uses rank 0's clock
only: rank 0 measures the minutes since the last save (or since the run started) and broadcasts
them, one ``[1]`` float64 broadcast per step boundary; every rank compares the same number.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist


class SaveClock:
    """``due()`` is True at the first step boundary at least ``every_minutes`` after the last
    ``saved()`` (or the construction). ``every_minutes == 0`` turns it off (no collective).

    ``clock`` returns seconds (``time.monotonic`` by default; tests inject their own). Only
    rank 0's clock is read for the decision.
    """

    def __init__(self, every_minutes: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = 60.0 * every_minutes
        self.clock = clock
        self.last = clock()

    def saved(self) -> None:
        """A checkpoint was just written: the next one is due ``every_minutes`` from now."""
        self.last = self.clock()

    def due(self, group: Optional["dist.ProcessGroup"] = None,
            device: Optional[torch.device] = None) -> bool:
        """Collective over ``group`` (all ranks; rank 0 of the world is its source): whether
        ``every_minutes`` have passed on rank 0's clock. The same on every rank."""
        if self.every_s <= 0:
            return False
        elapsed = torch.tensor([self.clock() - self.last], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.broadcast(elapsed, src=0, group=group)
        return float(elapsed.item()) >= self.every_s
