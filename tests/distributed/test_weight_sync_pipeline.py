"""The pipelined sync's memory bound: the sender keeps at most TWO buckets alive (one in flight,
one being packed), reuses its two staging buffers across buckets and across syncs, and the
engine receives every byte unchanged.

Rank 0 packs a lazily produced stream (``pack_stream`` into a two-slot ``StagingBuffer``, as the
Megatron export does) and hands the buckets to a ``ProcessGroupSender``, which leaves each
bucket's data broadcast in flight while the next bucket is packed; rank 1 receives. Live buckets
are counted with weak references to the bucket buffers (a buffer is alive while the sender's
in-flight broadcast or the packer holds it), at every tensor the producer makes - no timing.
"""

from __future__ import annotations

import pytest

from megatron_stare.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed

N_TENSORS, NUMEL = 24, 16 << 10  # 64 KiB fp32 tensors
BUCKET = 4 * NUMEL * 4  # 4 tensors per bucket -> 6 buckets per sync


def _tensor(i: int):
    import torch

    return torch.arange(NUMEL, dtype=torch.float32).add_(i * NUMEL)  # one allocation, distinct values


def _worker(rank, world, slots):
    import weakref

    import torch
    import torch.distributed as dist

    from megatron_stare.weight_sync import (PeakMemory, ProcessGroupReceiver, ProcessGroupSender, StagingBuffer,
                                            pack_stream)

    group = dist.new_group(list(range(world)))
    if rank == 1:
        recv = ProcessGroupReceiver(group, root=0)
        got = []
        for _ in range(2):
            got.append({n: t.clone() for n, t in recv.receive()})
        return got
    sender = ProcessGroupSender(group, root=0)
    staging = StagingBuffer(torch.device("cpu"), slots=slots)
    refs, live_max = [], []

    def produce():
        for i in range(N_TENSORS):
            # Buckets alive now: the one this tensor goes into + every earlier one still held.
            live_max.append(1 + sum(r() is not None for r in refs))
            yield f"t{i}", _tensor(i)

    def buckets():
        for b in pack_stream(produce(), BUCKET, torch.device("cpu"), staging=staging):
            refs.append(weakref.ref(b.buffer))
            yield b
            del b

    with PeakMemory() as mem:
        stats = [sender.send_buckets(buckets())]
    allocations_first = staging.allocations
    stats.append(sender.send_buckets(buckets()))  # a second sync reuses the same staging
    return {"live_max": max(live_max), "peak": mem.peak_bytes, "buckets": stats[0].num_buckets,
            "allocations": (allocations_first, staging.allocations)}


def test_sender_keeps_at_most_two_buckets_alive_and_reuses_staging():
    sender, received = run_on_ranks(_worker, 2, 2)
    assert sender["buckets"] == N_TENSORS // 4
    # One bucket in flight while the next is packed: exactly two alive, never three.
    assert sender["live_max"] == 2, sender["live_max"]
    # Two staging buffers for the whole first sync, none more for the second.
    assert sender["allocations"] == (2, 2), sender["allocations"]
    # Peak extra memory: two buckets + the tensor being produced + headers.
    assert sender["peak"] <= 2 * BUCKET + NUMEL * 4 + (16 << 10), sender["peak"]
    for sync in received:
        assert sorted(sync) == sorted(f"t{i}" for i in range(N_TENSORS))
        for i in range(N_TENSORS):
            assert torch_equal(sync[f"t{i}"], _tensor(i))


def test_one_slot_staging_cannot_reuse_under_an_in_flight_bucket():
    """The guard above is not vacuous: with ONE staging slot the buffer in flight cannot be
    reused, so every bucket allocates afresh (the cost the second slot removes)."""
    sender, _ = run_on_ranks(_worker, 2, 1)
    assert sender["live_max"] == 2
    assert sender["allocations"][0] == sender["buckets"], sender["allocations"]


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)
