"""The step's global samples -> this DP rank's mini-batches of micro-batches, on device."""

from __future__ import annotations

from typing import List, Sequence

from megatron_stare.actor.types import ActorSettings
from megatron_stare.actor.batching import plan_rank_batches, sequence_pad_multiple
from megatron_stare.runtime.parallel import ParallelGroups
from megatron_stare.types import MicroBatch, Sample


def prepare_batches(samples: Sequence[Sample], groups: ParallelGroups, settings: ActorSettings,
                    mini_batches: int = 1) -> List[List[MicroBatch]]:
    """This DP rank's mini-batches of micro-batches for the step's global ``samples``.

    Every rank computes the same plan from the same samples (``batching``); engine log-probs
    are carried only when every sample has them. Micro-batches are packed rows when
    ``parallel.pack_sequences``, else padded rows; lengths are padded to the multiple that
    sequence / context parallelism split them by (padding is masked out of every loss).
    """
    lay = groups.layout
    per_mini = len(samples) // max(mini_batches, 1)
    if per_mini < lay.dp:
        raise ValueError(f"a mini-batch of {per_mini} samples cannot feed {lay.dp} data-parallel "
                         f"ranks; raise trainer.prompts_per_step or lower the DP degree")
    with_engine = all(s.engine_logprobs is not None for s in samples)
    # r3: the engine's routed experts ride with their tokens (checked by the actor's prepare).
    batches = plan_rank_batches(samples, mini_batches=mini_batches, dp_rank=groups.dp_rank,
                                dp_size=lay.dp, token_budget=settings.parallel.micro_batch_tokens,
                                max_rows=settings.max_rows_per_micro_batch, with_engine_logp=with_engine,
                                cp=lay.cp, cp_rank=groups.cp_rank,
                                pad_multiple=sequence_pad_multiple(lay.tp, lay.cp, lay.sequence_parallel),
                                packed=settings.parallel.pack_sequences,
                                with_routes=settings.routing_replay == "r3")
    return [[mb.to(groups.device) for mb in mini] for mini in batches]
