"""The slicing and ordering rules of data-parallel rollout (``rollout/data_parallel.py``), and the
gather on 2 gloo ranks (the vLLM-CPU replicas themselves: ``tests/distributed/
test_rollout_data_parallel.py``)."""

import pytest
import torch

from megatron_stare.rollout.base import GenerationResult
from megatron_stare.rollout.data_parallel import check_prompt_major, gather_results, replica_slice
from megatron_stare.testing.distributed import run_on_ranks


@pytest.mark.parametrize("prompts,replicas", [(5, 2), (1, 2), (0, 3), (12, 4), (7, 3), (2, 4)])
def test_slices_tile_the_batch_in_order_and_differ_by_at_most_one(prompts, replicas):
    parts = [replica_slice(prompts, r, replicas) for r in range(replicas)]
    assert [i for p in parts for i in p] == list(range(prompts))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_a_replica_outside_the_run_is_refused():
    with pytest.raises(ValueError, match="replica 2 is not in"):
        replica_slice(4, 2, 2)


def _results(indices, n):
    return [GenerationResult(p, s, [p, s], torch.zeros(2), "length") for p in indices for s in range(n)]


def _gather(rank, world, prompts, n):
    part = replica_slice(prompts, rank, world)
    got = gather_results(_results(part, n), contributes=True)
    out = [(r.prompt_index, r.sample_index) for r in got]
    try:
        check_prompt_major(got, prompts, n)
        return out, None
    except RuntimeError as e:
        return out, str(e)


def _gather_dup(rank, world, prompts, n):
    # Broken on purpose: every rank generates the WHOLE batch and contributes it.
    got = gather_results(_results(range(prompts), n), contributes=True)
    try:
        check_prompt_major(got, prompts, n)
        return None
    except RuntimeError as e:
        return str(e)


@pytest.mark.distributed
def test_gather_gives_every_rank_the_batch_in_prompt_order_and_catches_duplicates():
    for out, err in run_on_ranks(_gather, 2, 5, 3):
        assert err is None and out == [(p, s) for p in range(5) for s in range(3)]
    errs = run_on_ranks(_gather_dup, 2, 3, 2)
    assert all(e is not None and "not 3 prompts x 2 samples in prompt order (got 12 results" in e for e in errs)
