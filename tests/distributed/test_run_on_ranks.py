"""The multi-rank harness (``testing.distributed.run_on_ranks``): ranks forked from its forkserver
are fresh processes that see the caller's environment and directory at the time of the call, not
those of the test that first started the forkserver, and a failing rank is named."""

import os

import pytest

from megatron_stare.testing.distributed import RankFailure, run_on_ranks

pytestmark = pytest.mark.distributed


def _probe(rank, world):
    from megatron.core import parallel_state

    import torch.distributed as dist

    got = [None] * world
    dist.all_gather_object(got, rank)
    return {"env": os.environ.get("RUN_ON_RANKS_PROBE"), "cwd": os.getcwd(), "pid": os.getpid(),
            "gathered": got, "megatron_initialized": parallel_state.model_parallel_is_initialized(),
            "threads": int(os.environ["OMP_NUM_THREADS"])}


def _init_megatron_then_report(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    return parallel_state.model_parallel_is_initialized()


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def test_ranks_take_the_callers_environment_and_directory(tmp_path, monkeypatch):
    first = run_on_ranks(_probe, 2)  # starts (or reuses) the forkserver under this environment
    assert [r["gathered"] for r in first] == [[0, 1], [0, 1]]
    monkeypatch.setenv("RUN_ON_RANKS_PROBE", "second call")
    monkeypatch.chdir(tmp_path)
    second = run_on_ranks(_probe, 2)
    assert [r["env"] for r in second] == ["second call"] * 2
    assert [r["cwd"] for r in second] == [str(tmp_path)] * 2
    assert {r["pid"] for r in first}.isdisjoint(r["pid"] for r in second)  # new processes each call
    assert all(r["threads"] == 1 for r in first + second)


def test_every_call_starts_without_the_previous_calls_state():
    assert run_on_ranks(_init_megatron_then_report, 2) == [True, True]
    assert [r["megatron_initialized"] for r in run_on_ranks(_probe, 2)] == [False, False]


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RankFailure, match=r"(?s)1 of 2 rank\(s\) failed.*rank 1.*rank one refuses"):
        run_on_ranks(_fail_on_one, 2)
