import pytest
import torch
import torch.distributed as dist

from megatron_stare.testing.distributed import RankFailure, run_on_ranks

pytestmark = pytest.mark.distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item(), torch.get_num_threads()


def _fail_on_one(rank, world_size):
    # Both ranks through init first: a rank 0 that returned (and tore its group down) before rank
    # 1 finished gloo's connection mesh failed rank 1's init instead (seen under load).
    dist.barrier()
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def test_run_on_ranks_collects_results():
    out = run_on_ranks(_sum_ranks, 3)
    assert [o[0] for o in out] == [3.0, 3.0, 3.0]
    assert all(o[1] == 1 for o in out)


def test_run_on_ranks_reports_failing_rank():
    with pytest.raises(RankFailure, match=r"rank 1 -----(.|\n)*boom on rank one"):
        run_on_ranks(_fail_on_one, 2, timeout=60)
