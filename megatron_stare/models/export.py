"""Streaming export: a Megatron model on any TP/PP layout -> HF ``(name, tensor)`` buckets.

    for bucket in iter_hf_buckets(model, groups, spec, bucket_bytes=512 << 20, dst="all"):
        engine.load(bucket)          # bucket: list of (hf_name, tensor), plus bucket.flat

No rank ever holds the whole model. Pipeline stages take turns (stage 0 first); within a stage
every canonical tensor is all-gathered over TP one at a time (``sharding.gather_canonical``),
converted to HF names/layouts by the architecture mapping, and copied into a flat byte buffer
of at most ``bucket_bytes`` (a single larger tensor gets a bucket of its own). A full buffer is
one bucket: moved to the destination in ONE transfer (a small header, then the bytes), and
yielded as views into that buffer. Peak extra memory per rank: one bucket buffer plus the
tensor being converted (its TP parts and its HF pieces).

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

import pickle
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron_stare.models.gpt import GPTSpec
from megatron_stare.models.provider import mapping_for
from megatron_stare.models.sharding import full_shape, gather_canonical, local_params
from megatron_stare.parallel import ParallelGroups, group_ranks

_ALIGN = 64  # byte offset of every tensor in a bucket, so dtype views of the bytes are legal


@dataclass
class ExportStats:
    """What this rank packed (its own stage's buckets) and the most memory the exporter held
    at once on this rank while packing (bytes)."""

    num_buckets: int = 0
    num_tensors: int = 0
    total_bytes: int = 0
    max_bucket_bytes: int = 0
    max_tensor_bytes: int = 0
    peak_live_bytes: int = 0
    in_flight: int = 0  # bytes of the tensor being converted right now (and its HF pieces)

    def live(self, nbytes: int) -> None:
        self.peak_live_bytes = max(self.peak_live_bytes, nbytes)


class Bucket(list):
    """A list of HF ``(name, tensor)`` pairs whose tensors are views into ``self.flat``
    (``[nbytes]`` uint8); ``meta`` is ``[(name, dtype, shape, offset, nbytes)]``."""

    def __init__(self, flat: torch.Tensor, meta: list) -> None:
        super().__init__((name, _view(flat, dtype, shape, off, n)) for name, dtype, shape, off, n in meta)
        self.flat, self.meta = flat, meta


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _view(flat: torch.Tensor, dtype: str, shape, off: int, n: int) -> torch.Tensor:
    return flat[off: off + n].view(getattr(torch, dtype)).view(shape)


def _stage_tensors(model, groups: ParallelGroups, spec: GPTSpec, dtype: Optional[torch.dtype],
                   stats: ExportStats) -> Iterator[Tuple[str, torch.Tensor]]:
    """This stage's HF tensors, TP-gathered one canonical tensor at a time (collective)."""
    mapping = mapping_for(spec)
    for canon, full in gather_canonical(model, groups.tp_group, groups.layout.tp):
        pieces = [(n, t if dtype is None else t.to(dtype)) for n, t in mapping.to_hf(canon, full)]
        yield from _accounted(pieces, full, stats)


def _accounted(pieces, full, stats):
    stats.in_flight = _nbytes(full) + sum(_nbytes(t) for _, t in pieces)
    for item in pieces:
        yield item
    stats.in_flight = 0


def _stage_buckets(model, groups, spec, bucket_bytes, dtype, stats) -> Iterator[Bucket]:
    """Pack this stage's HF tensors into flat buckets of at most ``bucket_bytes``."""
    # Upper bound of what is left to pack, so a small model never allocates a huge buffer.
    esize = torch.tensor([], dtype=dtype).element_size() if dtype is not None else None
    remaining = sum(
        _aligned(torch.Size(full_shape(p, groups.layout.tp)).numel() * (esize or p.element_size()))
        * (3 if "linear_qkv" in local else 2 if "linear_fc1" in local else 1)
        for local, _, p in local_params(model))
    stats.in_flight = 0
    flat, meta, used = None, [], 0
    for name, t in _stage_tensors(model, groups, spec, dtype, stats):
        n = _nbytes(t)
        if flat is not None and used + n > flat.numel():
            yield _finish(flat, meta, used, stats)
            flat, meta, used = None, [], 0
        if flat is None:
            flat = torch.empty(max(min(bucket_bytes, remaining), n), dtype=torch.uint8,
                               device=groups.device)
        flat[used: used + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        meta.append((name, str(t.dtype).replace("torch.", ""), tuple(t.shape), used, n))
        remaining -= _aligned(n)
        used = min(_aligned(used + n), flat.numel())
        stats.max_tensor_bytes = max(stats.max_tensor_bytes, n)
        stats.live(flat.numel() + stats.in_flight)
    if meta:
        yield _finish(flat, meta, used, stats)


def _finish(flat, meta, used, stats) -> Bucket:
    flat = flat[:used]
    stats.num_buckets += 1
    stats.num_tensors += len(meta)
    stats.total_bytes += sum(m[4] for m in meta)
    stats.max_bucket_bytes = max(stats.max_bucket_bytes, used)
    return Bucket(flat, meta)


def _send(bucket: Optional[Bucket], to: Optional[int], group, device) -> None:
    """Send (``to`` a rank) or broadcast (``to`` None, src = this rank) one bucket, or the
    end-of-stage marker (``bucket`` None): sizes ``[header bytes, flat bytes]``, header, bytes."""
    if bucket is None:
        parts = [torch.zeros(2, dtype=torch.int64, device=device)]
    else:
        head = torch.frombuffer(bytearray(pickle.dumps(bucket.meta)), dtype=torch.uint8).to(device)
        sizes = torch.tensor([head.numel(), bucket.flat.numel()], dtype=torch.int64, device=device)
        parts = [sizes, head, bucket.flat]
    for t in parts:
        if to is None:
            dist.broadcast(t, src=dist.get_rank(), group=group)
        else:
            dist.send(t, dst=to)


def _recv(src: int, broadcast: bool, group, device) -> Optional[Bucket]:
    """Receive one bucket from global rank ``src``; None at the end of its stage."""
    def get(t):
        if broadcast:
            dist.broadcast(t, src=src, group=group)
        else:
            dist.recv(t, src=src)
        return t

    sizes = get(torch.zeros(2, dtype=torch.int64, device=device)).tolist()
    if sizes[0] == 0:
        return None
    head = get(torch.empty(sizes[0], dtype=torch.uint8, device=device))
    meta = pickle.loads(head.cpu().numpy().tobytes())
    return Bucket(get(torch.empty(sizes[1], dtype=torch.uint8, device=device)), meta)


def iter_hf_buckets(model, groups: ParallelGroups, spec: GPTSpec, bucket_bytes: int = 512 << 20,
                    *, dst: Union[str, int] = "all", dtype: Optional[torch.dtype] = None,
                    stats: Optional[ExportStats] = None) -> Iterator[Bucket]:
    """Yield the model's HF tensors as ``Bucket`` lists on the destination rank(s).

    ``dst``: ``"all"`` or a global rank (see the module docstring). ``dtype`` casts every
    tensor (e.g. to bf16 for the engine) before packing; default keeps the parameter dtype.
    Buckets arrive stage by stage in the model's parameter order. ``stats`` (optional) is
    filled with bucket counts and sizes and this rank's peak exporter memory.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if dst != "all" and not (isinstance(dst, int) and 0 <= dst < dist.get_world_size()):
        raise ValueError(f"dst must be 'all' or a global rank in [0, {dist.get_world_size()}), got {dst!r}")
    stats = stats if stats is not None else ExportStats()
    pp, me, dev = groups.layout.pp, dist.get_rank(), groups.device
    pp_ranks = group_ranks(groups.pp_group) if pp > 1 else [me]
    local = _stage_buckets(model, groups, spec, bucket_bytes, dtype, stats)

    if dst == "all":
        for s in range(pp):
            if s == groups.pp_rank:
                for bucket in local:
                    if pp > 1:
                        _send(bucket, None, groups.pp_group, dev)
                    yield bucket
                    del bucket  # hold no bucket while the next one is built
                if pp > 1:
                    _send(None, None, groups.pp_group, dev)
            else:
                while (bucket := _recv(pp_ranks[s], True, groups.pp_group, dev)) is not None:
                    yield bucket
                    del bucket
        return

    if dst not in group_ranks(groups.mp_group):
        return  # another data-parallel replica streams to dst
    if dst not in pp_ranks:
        for _ in local:  # only take part in this stage's TP gathers
            pass
        return
    if me != dst:
        for bucket in local:
            _send(bucket, dst, None, dev)
            del bucket
        _send(None, dst, None, dev)
        return
    for s in range(pp):
        if s == groups.pp_rank:
            yield from local
        else:
            while (bucket := _recv(pp_ranks[s], False, None, dev)) is not None:
                yield bucket
                del bucket
