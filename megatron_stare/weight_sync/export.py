"""Streaming export: a Megatron model on any TP/PP layout -> HF ``(name, tensor)`` buckets.

    for bucket in iter_hf_buckets(model, groups, spec, bucket_bytes=512 << 20, dst="all"):
        engine.load(bucket)          # bucket: a weight_sync.FlatBucket of (hf_name, tensor) views

No rank ever holds the whole model. Pipeline stages take turns (stage 0 first); within a stage
every canonical tensor is all-gathered over TP one at a time (``sharding.gather_canonical``),
converted to HF names/layouts by the architecture mapping, and copied into a flat byte buffer
of at most ``bucket_bytes`` (a single larger tensor gets a bucket of its own;
``weight_sync.pack_stream``). A full buffer is one bucket in the project's one bucket format
(``weight_sync.FlatBucket``): moved to the destination in ONE transfer in the one wire protocol
(``weight_sync.wire``: sizes, JSON header, the bytes), and yielded as views into that buffer.
Buffers come from a two-slot ``StagingBuffer`` and are reused once the consumer dropped every
view of a bucket, so a consumer may keep one bucket in flight (an async send: the weight-sync
sender, a pipeline stage's ``isend`` to ``dst``) while the next is gathered and packed. Peak
extra memory per rank: two bucket buffers (one when the consumer drops each bucket before asking
for the next) plus the tensor being converted (the reused TP gather / concatenation buffers and
its HF pieces).

The weight sync to an engine behind a process group uses ``pieces=True`` instead
(``export_pieces``): with one ``dst``, each TP rank's rows of every HF tensor go point-to-point
straight into the collector's bucket buffer, tensors are cut at bucket boundaries, and the
destination holds two buckets of at most ``bucket_bytes`` and nothing else (no gather buffer,
no HF copies); receivers join the pieces (``weight_sync.Assembler``). A mixture-of-experts
model's experts come point-to-point from the ranks that hold them (``expert_plan``), while
``dst="all"`` all-gathers each expert over EP (every colocated engine holds every expert). Whole tensors remain the
default for checkpoint writers and colocated engines (``dst="all"``).

Destinations (``dst``):
- ``"all"``: every rank yields every bucket. Each stage broadcasts its buckets over its pipeline
  group; TP peers already hold the gathered tensors; every data-parallel replica streams itself.
- a global rank ``r``: only ``r`` yields buckets. The ranks of ``r``'s model replica gather; the
  member of ``r``'s pipeline group in each other stage sends to ``r`` point-to-point; ranks of
  other data-parallel replicas do nothing.

Every rank of the job must iterate the generator to its end (collectives inside).

Volume per rank per sync with ``dst="all"`` (a colocated engine): each rank receives ``(tp - 1)``
shards of every TP-split weight of its stage in the all-gather, and yields the WHOLE HF model
(``benchmarks/bench_rollout_dp.py``: Megatron TP2 -> vLLM TP2, each rank gathers 0.5x and
receives 1.0x the model's bytes; its engine rank keeps about 1/2). Even where the engine's TP
layout equals the trainer's, this cannot be cut with vLLM 0.32: its loaders
(``weight_loader`` / ``reload_weights``) take full HF tensors and narrow them to the TP rank
themselves, and it has no entry point for pre-sharded tensors. For the 32B recipe that is 61 GiB
received per rank per sync (``--dry-run`` prints it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron_stare.weight_sync.export_pieces import ExpertPlan, find_collector, piece_buckets, stage_pieces
from megatron_stare.models.gpt import GPTSpec
from megatron_stare.models.provider import mapping_for
from megatron_stare.models.sharding import (ExpertGroups, full_shape, gather_canonical, is_expert_param, local_params,
                                            num_local_experts)
from megatron_stare.runtime.parallel import ParallelGroups, group_ranks
from megatron_stare.weight_sync import (FlatBucket, StagingBuffer, group_link, isend_link, pack_stream, recv_bucket,
                                        recv_link, send_bucket, send_bucket_async, send_end, send_link)
from megatron_stare.weight_sync.bucket import StreamCounts, aligned, nbytes_of


@dataclass
class ExportStats(StreamCounts):
    """What this rank packed (its own stage's buckets: ``StreamCounts``) and the most memory the
    exporter held at once on this rank while packing (bytes)."""

    max_bucket_bytes: int = 0
    max_tensor_bytes: int = 0
    peak_live_bytes: int = 0
    in_flight: int = 0  # bytes of the tensor being converted right now (and its HF pieces)
    gather_seconds: float = 0.0  # in the TP all-gathers and unsharding (this stage)
    convert_seconds: float = 0.0  # HF renaming/splitting and dtype casts
    pack_seconds: float = 0.0  # copying HF tensors into the flat buffers
    handoff_seconds: float = 0.0  # receiving other stages' buckets (the PP hand-off, on dst)

    def live(self, nbytes: int) -> None:
        self.peak_live_bytes = max(self.peak_live_bytes, nbytes)

    def copied(self, tensor_bytes: int, buffer_bytes: int) -> None:
        self.max_tensor_bytes = max(self.max_tensor_bytes, tensor_bytes)
        self.live(buffer_bytes + self.in_flight)

    def packed(self, bucket: FlatBucket) -> None:
        self.count_bucket(bucket.metas)
        self.max_bucket_bytes = max(self.max_bucket_bytes, bucket.nbytes)


def _stage_tensors(model, groups: ParallelGroups, spec: GPTSpec, dtype: Optional[torch.dtype],
                   stats: ExportStats) -> Iterator[Tuple[str, torch.Tensor]]:
    """This stage's HF tensors, TP-gathered one canonical tensor at a time (collective)."""
    mapping = mapping_for(spec)
    gathered = gather_canonical(model, groups.tp_group, groups.layout.tp, reuse=True,
                                experts=expert_groups(model, groups, spec))
    while True:
        t0 = time.perf_counter()
        item = next(gathered, None)
        t1 = time.perf_counter()
        stats.gather_seconds += t1 - t0
        if item is None:
            return
        canon, full = item
        pieces = [(n, t if dtype is None else t.to(dtype)) for n, t in mapping.to_hf(canon, full)]
        stats.convert_seconds += time.perf_counter() - t1
        yield from _accounted(pieces, full, stats)


def expert_groups(model, groups: ParallelGroups, spec: GPTSpec) -> Optional[ExpertGroups]:
    """The expert groups ``gather_canonical`` needs for a mixture-of-experts ``spec`` (else None)."""
    if spec.moe is None:
        return None
    lay = groups.layout
    return ExpertGroups(groups.ep_group, lay.ep, groups.etp_group, lay.etp, num_local_experts(model))


def _accounted(pieces, full, stats):
    stats.in_flight = nbytes_of(full) + sum(nbytes_of(t) for _, t in pieces)
    for item in pieces:
        yield item
    stats.in_flight = 0


def _stage_buckets(model, groups, spec, bucket_bytes, dtype, stats) -> Iterator[FlatBucket]:
    """Pack this stage's HF tensors into flat buckets of at most ``bucket_bytes``."""
    # Upper bound of what is left to pack, so a small model never allocates a huge buffer.
    esize = torch.tensor([], dtype=dtype).element_size() if dtype is not None else None
    lay = groups.layout
    bound = sum(
        aligned(torch.Size(full_shape(p, lay.tp, lay.etp)).numel() * (esize or p.element_size()))
        * (3 if "linear_qkv" in local else 2 if "linear_fc1" in local else 1) * (lay.ep if is_expert_param(p) else 1)
        for local, _, p in local_params(model))
    stats.in_flight = 0
    buckets = pack_stream(_stage_tensors(model, groups, spec, dtype, stats), bucket_bytes, groups.device,
                          size_bound=bound, on_copy=stats.copied, staging=StagingBuffer(groups.device, slots=2))
    while True:
        # Time in pack_stream that is not the producer's (gather, convert) is packing.
        before = stats.gather_seconds + stats.convert_seconds
        t0 = time.perf_counter()
        bucket = next(buckets, None)
        stats.pack_seconds += time.perf_counter() - t0 - (stats.gather_seconds + stats.convert_seconds - before)
        if bucket is None:
            return
        stats.packed(bucket)
        yield bucket
        del bucket


def _received(link, dev, staging: StagingBuffer, stats: ExportStats) -> Iterator[FlatBucket]:
    """Another stage's buckets as they arrive over ``link`` (the PP hand-off)."""
    while True:
        t0 = time.perf_counter()
        bucket = recv_bucket(link, dev, staging)
        stats.handoff_seconds += time.perf_counter() - t0
        if bucket is None:
            return
        yield bucket
        del bucket  # hold no bucket while the next one arrives


def iter_hf_buckets(model, groups: ParallelGroups, spec: GPTSpec, bucket_bytes: int = 512 << 20,
                    *, dst: Union[str, int] = "all", dtype: Optional[torch.dtype] = None,
                    stats: Optional[ExportStats] = None, pieces: bool = False) -> Iterator[FlatBucket]:
    """Yield the model's HF tensors as ``FlatBucket``s on the destination rank(s).

    ``dst``: ``"all"`` or a global rank (see the module docstring). ``dtype`` casts every
    tensor (e.g. to bf16 for the engine) before packing; default keeps the parameter dtype.
    Buckets arrive stage by stage in the model's parameter order. ``stats`` (optional) is
    filled with bucket counts and sizes and this rank's peak exporter memory.

    ``pieces`` (with a single ``dst``; the weight sync to an engine behind a process group):
    tensors travel as pieces written straight into the buckets (``export_pieces``): buckets of
    at most ``bucket_bytes``, no gather buffer, peak two buckets on ``dst``. Read such buckets
    with ``weight_sync.assemble``; iterating one tensor by tensor refuses. Whole tensors
    (``pieces=False``) are what a checkpoint writer needs.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if dst != "all" and not (isinstance(dst, int) and 0 <= dst < dist.get_world_size()):
        raise ValueError(f"dst must be 'all' or a global rank in [0, {dist.get_world_size()}), got {dst!r}")
    if pieces and dst == "all":
        raise ValueError("iter_hf_buckets(pieces=True) streams to one rank: pass dst=<global rank> "
                         "(dst='all' exports whole tensors)")
    stats = stats if stats is not None else ExportStats()
    pp, me, dev = groups.layout.pp, dist.get_rank(), groups.device
    pp_ranks = group_ranks(groups.pp_group) if pp > 1 else [me]
    if pieces:
        yield from _piece_export(model, groups, spec, bucket_bytes, dst, dtype, stats, pp_ranks)
        return
    local = _stage_buckets(model, groups, spec, bucket_bytes, dtype, stats)

    # Received buckets land in two reused buffers (one may still be in flight to an engine).
    staging = StagingBuffer(dev, slots=2)
    if dst == "all":
        for s in range(pp):
            link = group_link(groups.pp_group, dist.get_group_rank(groups.pp_group, pp_ranks[s])) \
                if pp > 1 else None
            if s == groups.pp_rank:
                for bucket in local:
                    if link is not None:
                        send_bucket(link, bucket, dev)
                    yield bucket
                    del bucket  # hold no bucket while the next one is built
                if link is not None:
                    send_end(link, dev)
            else:
                yield from _received(link, dev, staging, stats)
        return

    # Expert-parallel groups span data-parallel replicas: every rank takes part in the gathers.
    if dst not in group_ranks(groups.mp_group) and not (spec.moe is not None and groups.layout.ep > 1):
        return  # another data-parallel replica streams to dst
    if dst not in pp_ranks:
        for _ in local:  # only take part in this stage's TP (and expert) gathers
            pass
        return
    yield from _to_dst(local, dst, groups, pp_ranks, staging, stats)


def _to_dst(local: Iterator[FlatBucket], dst: int, groups: ParallelGroups, pp_ranks, staging: StagingBuffer,
            stats: ExportStats) -> Iterator[FlatBucket]:
    """On ``dst``: its own stage's buckets and the other stages' (received into ``staging``), in
    stage order. On another stage's member of ``dst``'s pipeline group: send this stage's buckets
    to ``dst``, bucket k in flight while bucket k+1 is built; yields nothing."""
    dev = groups.device
    if dist.get_rank() != dst:
        in_flight = None
        for bucket in local:
            if in_flight is not None:
                in_flight.wait()
            in_flight = send_bucket_async(send_link(dst), isend_link(dst), bucket, dev)
            del bucket
        if in_flight is not None:
            in_flight.wait()
        send_end(send_link(dst), dev)
        return
    for s in range(groups.layout.pp):
        if s == groups.pp_rank:
            yield from local
        else:
            yield from _received(recv_link(pp_ranks[s]), dev, staging, stats)


def _piece_export(model, groups: ParallelGroups, spec: GPTSpec, bucket_bytes: int, dst: int,
                  dtype: Optional[torch.dtype], stats: ExportStats, pp_ranks) -> Iterator[FlatBucket]:
    """``iter_hf_buckets(pieces=True)``: each stage's collector (the member of ``dst``'s pipeline
    group) builds its stage's buckets from pieces; other stages' collectors send theirs to
    ``dst``, which takes them into the same two staging slots as its own. A MoE model's experts
    come from the collector's expert grid (``expert_plan``), which may span data-parallel replicas."""
    me, dev, tp = dist.get_rank(), groups.device, groups.layout.tp
    tp_ranks = group_ranks(groups.tp_group) if tp > 1 else [me]
    if spec.moe is None:
        if dst not in group_ranks(groups.mp_group):
            return  # another data-parallel replica streams to dst
        collector = tp_ranks[find_collector(groups.tp_group, tp, dst in pp_ranks, dev)]
        experts = None
    else:
        collector, experts = expert_plan(model, groups, dst in pp_ranks)
        if collector not in tp_ranks and not experts.grid:
            return  # neither in the collector's TP group nor in its expert grid
    staging = StagingBuffer(dev, slots=2)  # own buckets and, on dst, the other stages' buckets
    plan = stage_pieces(model, mapping_for(spec), tp, groups.tp_rank, me=me,
                        tp_ranks=tp_ranks if collector in tp_ranks else None, experts=experts)
    local = piece_buckets(plan, bucket_bytes, dtype=dtype, me=me, collector=collector, staging=staging, stats=stats)
    if me != collector:
        for _ in local:  # send this rank's pieces to the collector
            pass
        return
    yield from _to_dst(local, dst, groups, pp_ranks, staging, stats)


def expert_plan(model, groups: ParallelGroups, collects: bool) -> Tuple[int, ExpertPlan]:
    """(this stage's collector, where its experts are) from one all-gather over the world of
    each rank's ``(pp rank, expert-data-parallel rank, ep rank, etp rank, collects)``: the
    collector's grid is the ranks of its stage with its expert-data-parallel rank."""
    lay = groups.layout
    edp = dist.get_rank(groups.edp_group) if lay.edp > 1 else 0
    mine = torch.tensor([groups.pp_rank, edp, groups.ep_rank, groups.etp_rank, int(collects)], dtype=torch.int64,
                        device=groups.device)
    every = torch.empty(dist.get_world_size() * 5, dtype=torch.int64, device=groups.device)
    dist.all_gather_into_tensor(every, mine)
    rows = every.view(-1, 5).tolist()
    hits = [r for r, row in enumerate(rows) if row[4] and row[0] == groups.pp_rank]
    if len(hits) != 1:
        raise RuntimeError(f"weight export: {len(hits)} ranks of pipeline stage {groups.pp_rank} share the "
                           f"destination's pipeline group (expected exactly 1)")
    c = hits[0]
    grid = {}
    if edp == rows[c][1]:
        grid = {(row[2], row[3]): r for r, row in enumerate(rows) if row[0] == groups.pp_rank and row[1] == edp}
    return c, ExpertPlan(lay.ep, lay.etp, groups.ep_rank, groups.etp_rank, num_local_experts(model), grid)
