"""Prompt sampling: the same global batch of dataset indices on every DP rank, resumable.

Every DP rank builds the same ``PromptSampler``; each step it yields the GLOBAL batch of
``prompts_per_step`` dataset indices (so GRPO groups and dynamic sampling see the whole step) and
``shard_for_rank`` hands each rank a contiguous slice (whole prompts, so all ``n`` responses of a
prompt live on one rank). ``state_dict()`` is ``(epoch, position)`` plus what must not change
across a resume; loading it reproduces the exact following batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np

from megatron_stare.data.readers import DataError

__all__ = ["PromptSampler", "shard_for_rank"]


@dataclass
class PromptSampler:
    """Deterministic global batches of prompt indices, resumable.

    Epoch ``e`` visits every index once, in the order of a permutation drawn from
    ``(seed, e)`` (identity when not ``shuffle``). A batch takes the next ``prompts_per_step``
    indices and continues into the next epoch when the current one runs out, so no prompt is
    dropped (a dataset smaller than a batch repeats prompts within it).
    """

    num_prompts: int
    prompts_per_step: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    """Epoch of the next index to be drawn."""
    position: int = 0
    """Offset of the next index in that epoch's order."""
    _order: Optional[np.ndarray] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.num_prompts < 1 or self.prompts_per_step < 1:
            raise DataError(f"sampler needs >= 1 prompts and prompts_per_step >= 1, got "
                            f"{self.num_prompts} and {self.prompts_per_step}")

    def epoch_order(self, epoch: int) -> np.ndarray:
        """``[num_prompts]`` int64: the visiting order of ``epoch``."""
        if not self.shuffle:
            return np.arange(self.num_prompts, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts).astype(np.int64)

    def next_batch(self) -> List[int]:
        """The next ``prompts_per_step`` dataset indices (the whole step, every DP rank)."""
        out: List[int] = []
        while len(out) < self.prompts_per_step:
            if self._order is None:
                self._order = self.epoch_order(self.epoch)
            take = self._order[self.position:self.position + self.prompts_per_step - len(out)]
            out.extend(int(i) for i in take)
            self.position += len(take)
            if self.position == self.num_prompts:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return out

    def __iter__(self) -> Iterator[List[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_prompts": self.num_prompts,
                "prompts_per_step": self.prompts_per_step, "seed": self.seed, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Resume at ``state``'s cursor; the dataset size, batch size, seed and shuffle must match
        (else the following batches would silently differ from the interrupted run's)."""
        for key in ("num_prompts", "prompts_per_step", "seed", "shuffle"):
            if int(state[key]) != int(getattr(self, key)):
                raise DataError(f"cannot resume the sampler: checkpoint has {key}={state[key]}, this run has "
                                f"{int(getattr(self, key))} (did the dataset, data.on_malformed or the batch "
                                f"size change?)")
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


def shard_for_rank(batch: Sequence[int], dp_rank: int, dp_size: int) -> List[int]:
    """Rank ``dp_rank``'s contiguous slice of a global batch; the slices partition it in order."""
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
    if len(batch) % dp_size:
        raise DataError(f"a batch of {len(batch)} prompts does not split over {dp_size} data-parallel "
                        f"ranks; make trainer.prompts_per_step a multiple of the DP size")
    per = len(batch) // dp_size
    return list(batch[dp_rank * per:(dp_rank + 1) * per])
