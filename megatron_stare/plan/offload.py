"""What ``trainer.offload`` frees while a colocated engine generates, for the planner (``plan.py``).

``OFFLOADED``: the memory plan's components each level moves off the GPU in the phases with
``Phase.trainer_offloaded`` (``runtime/phases.py``; the moves themselves: ``offload.py``).
``OffloadPlan``: the freed bytes and what the engine can do with them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OFFLOADED", "OffloadPlan"]

#: What each ``trainer.offload`` level moves off the GPU in the phases with ``trainer_offloaded``.
OFFLOADED = {"none": (), "optimizer": ("main_grads_gib", "optimizer_gib"),
             "all": ("weights_gib", "main_grads_gib", "optimizer_gib", "reference_gib")}


@dataclass(frozen=True)
class OffloadPlan:
    """The trainer's state off the GPU while the engine generates, and what the engine can do with
    it: a memory fraction raised by the freed bytes, its KV pool and full-length sequences per
    replica before and after (``offload.py``)."""

    level: str
    """``trainer.offload``; with 'none' the figures are those 'all' would give (a hint)."""
    freed_gib: float
    """Per GPU: the level's components (``OFFLOADED``) on the stage that frees least."""
    utilization_before: float
    utilization_after: float
    """``rollout.gpu_memory_utilization`` + freed / GPU memory, rounded down to 0.01, at most 0.95."""
    kv_before_gib: float
    kv_after_gib: float
    sequences_before: int
    sequences_after: int
    """Full-length sequences the KV pool of one replica holds at once."""

    def line(self, sequences: int) -> str:
        level = self.level if self.level != "none" else "none (with trainer.offload=all"
        tail = ")" if self.level == "none" else ""
        return (f"  offload  trainer.offload={level}: {self.freed_gib:.1f} GiB per GPU leave for pinned host memory "
                f"while the engine generates; rollout.gpu_memory_utilization {self.utilization_before:g} -> "
                f"{self.utilization_after:g} gives the engine KV {self.kv_before_gib:.1f} -> {self.kv_after_gib:.1f} "
                f"GiB per GPU: {self.sequences_before} -> {self.sequences_after} full-length sequences per replica "
                f"at once (of {sequences}){tail}")
