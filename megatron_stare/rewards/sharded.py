"""Score a batch once across the trainer's ranks, and give every rank the same scores.

``score_once`` is step phase 3 (``runtime/phases.py``). Every rank holds the same gathered
responses; rank ``r`` of ``W`` scores responses ``r, r + W, r + 2W, ...`` in its own
``RewardPool`` (each response is scored exactly once, the work spread over the ranks), and
the scores are all-gathered. A call that runs past ``reward.timeout_s`` scores 0 on the rank
that scored it, and that 0 is what every rank receives: a slow verifier on one rank cannot
make the ranks disagree on rewards, on DAPO dynamic sampling, or on the collectives that
follow. A reward function that raises on any rank (or anything else that fails while a rank
scores its share) fails every rank with the same line, after the gather, so no rank is left
waiting in it. A preemption signal that stops a rank's scoring (``step_interrupt.py``) is
shared the same way: every rank raises ``StepInterrupted`` after the gather.

Not imported by ``megatron_stare.rewards`` (its reward workers stay free of torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import logging
from typing import Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron_stare.runtime.preemption import StepInterrupted
from megatron_stare.rewards.pool import RewardPool
from megatron_stare.rewards.registry import RewardError

__all__ = ["SharedScores", "score_once", "shard_of"]

log = logging.getLogger(__name__)
#: What a rank whose scoring a preemption signal stopped shares in place of an error line.
INTERRUPTED = "\0interrupted"


@dataclass(frozen=True)
class SharedScores:
    """``scores`` ``[N]`` in response order, identical on every rank; ``timeouts`` and
    ``crashes`` summed over the ranks; ``extras`` ``[N]`` the other numbers of dict returns
    (``{}`` each when the reward returns numbers)."""

    scores: List[float]
    timeouts: int
    crashes: int
    extras: List[Dict[str, float]] = field(default_factory=list)


def shard_of(n: int, rank: int, world: int) -> range:
    """The responses rank ``rank`` of ``world`` scores (strided: every rank gets a mix)."""
    return range(rank, n, world)


def score_once(pool: RewardPool, n: int, item: Callable[[int], Tuple[str, str, dict]],
               group: Optional[dist.ProcessGroup] = None) -> SharedScores:
    """Scores of responses ``0 .. n-1`` (``item(i)`` = ``(response text, answer, metadata)``),
    each scored once on one rank of ``group`` (default: the world) and shared by all."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = shard_of(n, rank, world)
    local: Tuple[List[int], List[float], int, int, List[Dict[str, float]], Optional[str]]
    try:
        texts, answers, metas = zip(*(item(i) for i in mine)) if len(mine) else ((), (), ())
        fut = pool.submit(list(texts), list(answers), list(metas))
        local = (list(mine), pool.wait(fut), fut.num_timeouts, fut.num_crashes, fut.extras(), None)
    except StepInterrupted:  # a preemption signal: shared below, so that every rank stops here
        local = (list(mine), [], 0, 0, [], INTERRUPTED)
    except RewardError as e:  # shared below, so that every rank raises it
        local = (list(mine), [], 0, 0, [], str(e).splitlines()[0])
    except Exception as e:  # noqa: BLE001 - a failure here must not leave the other ranks waiting
        log.exception("scoring this rank's share of the batch failed")
        local = (list(mine), [], 0, 0, [], f"reward: scoring failed: {type(e).__name__}: "
                                           f"{str(e).splitlines()[0] if str(e) else ''}")
    gathered: List = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    if any(err == INTERRUPTED for *_, err in gathered):
        raise StepInterrupted("score")
    errors = [(r, err) for r, (*_, err) in enumerate(gathered) if err is not None]
    if errors:
        r, err = errors[0]
        raise RewardError(f"{err} (scored on rank {r})")
    scores = [0.0] * n
    extras: List[Dict[str, float]] = [{} for _ in range(n)]
    for idx, vals, _, _, more, _ in gathered:
        for i, v, x in zip(idx, vals, more):
            scores[i], extras[i] = v, x
    return SharedScores(scores, timeouts=sum(g[2] for g in gathered), crashes=sum(g[3] for g in gathered),
                        extras=extras)
