"""Data-parallel rollout: each engine replica generates its own slice of a batch's prompts.

A run has ``replicas`` engine replicas (``EngineDevices.replicas``): a colocated vLLM has
``world / rollout.tp`` (vLLM's ``external_launcher`` data parallelism), a colocated SGLang one
per TP group, a driver-placed engine one (several servers behind it are balanced by the
dispatcher, ``rollout/dispatch.py``, inside that one client). Replica ``r`` generates the
contiguous slice ``replica_slice(P, r, replicas)`` of the batch's ``P`` prompts, seeding prompt
``i`` with ``sample_seed(seed, i)`` - the prompt's index in the whole batch, not in the slice -
so what a prompt gets does not depend on the replica count (up to the engine's batch-dependent
numerics; see ``tests/distributed/test_rollout_data_parallel.py``).

``gather_results`` then gives every trainer rank the whole batch: one rank per replica (its
``leads_replica`` rank) contributes its slice, the slices are all-gathered and concatenated in
rank order, which is replica order, which is prompt order: the same prompt-major list a single
replica would have returned, on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

if TYPE_CHECKING:
    from megatron_stare.rollout.base import GenerationResult

__all__ = ["check_prompt_major", "gather_results", "replica_slice"]


def replica_slice(num_prompts: int, replica: int, replicas: int) -> range:
    """The prompts replica ``replica`` of ``replicas`` generates: a contiguous range; the first
    ``num_prompts % replicas`` replicas take one prompt more (so sizes differ by at most one,
    and a replica gets an empty range when there are fewer prompts than replicas)."""
    if not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} is not in [0, {replicas})")
    base, extra = divmod(num_prompts, replicas)
    start = replica * base + min(replica, extra)
    return range(start, start + base + (replica < extra))


def check_prompt_major(results: Sequence["GenerationResult"], num_prompts: int, n: int) -> None:
    """Raise unless ``results`` are ``num_prompts * n`` results in prompt-major order (prompt 0's
    ``n`` samples, then prompt 1's, ...): what a gather of every replica's slice must give."""
    got = [(r.prompt_index, r.sample_index) for r in results]
    want = [(p, s) for p in range(num_prompts) for s in range(n)]
    if got != want:
        raise RuntimeError(f"data-parallel rollout: the gathered results are not {num_prompts} prompts x "
                           f"{n} samples in prompt order (got {len(got)} results, first mismatch "
                           f"{next(((g, w) for g, w in zip(got, want) if g != w), None)}); a replica "
                           f"generated the wrong slice")


def gather_results(local: Optional[List["GenerationResult"]], contributes: bool, group=None
                   ) -> List["GenerationResult"]:
    """Every rank of ``group`` (the default group: every trainer rank) receives the
    concatenation, in rank order, of the ``local`` results of the ranks that ``contribute``
    (one per replica). A collective: every rank of the group calls it. With one process (no
    process group) it returns ``local``."""
    import torch.distributed as dist

    if contributes and local is None:
        raise ValueError("a contributing rank must pass its results")
    if not dist.is_initialized():
        return list(local or [])
    parts: List[Optional[List["GenerationResult"]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local if contributes else None, group=group)
    return [r for part in parts if part is not None for r in part]
