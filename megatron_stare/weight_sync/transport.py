"""How weight bytes move from the trainer to a rollout engine.

Two transports, one wire idea:

* **in-process** (``InProcessTransport``): the engine lives in the trainer's process (the ``hf``
  engine, colocated vLLM). The HF-named tensor stream is handed to ``engine.update_weights``
  as is: no copy, no flattening; the producer's own buckets bound the memory.
* **process group** (``ProcessGroupSender`` / ``ProcessGroupReceiver``): the engine is another
  process (a vLLM server worker, a disaggregated engine). The trainer broadcasts flat buckets
  (``bucket.FlatBucket``) over a process group - gloo on CPU, NCCL on GPU - that contains the
  trainer's sending rank and every engine worker. Each bucket is three broadcasts: a header
  ``int64[2] = (metadata bytes, data bytes)``, the JSON metadata, the flat data. A header of
  ``(0, 0)`` ends the stream. The receiver yields views into the bucket's buffer. It reuses
  that buffer for the next bucket only when the consumer has dropped every view of it;
  otherwise it allocates a fresh one, so consumers that keep tensors across buckets (vLLM's
  layer-wise reload buffers a layer until all its pieces arrived) stay correct, and memory is
  freed as soon as they drop them. Peak extra memory per rank: one bucket (``max(bucket_bytes,
  largest tensor)``) for consumers that copy as they go.

Ranks passed here are ranks *within the group* (the group's own numbering), and collectives are
issued on the group object directly, so groups made outside ``torch.distributed``'s global
registry (vLLM's stateless groups) work the same as ``dist.new_group`` ones.

``PeakMemory`` measures the peak extra bytes allocated during a sync (CPU: the torch profiler's
allocator events; CUDA: the caching allocator's peak), which is how the tests prove the
"peak extra memory is bounded by the bucket size" property.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from megatron_stare.weight_sync import wire
from megatron_stare.weight_sync.bucket import (Assembler, FlatBucket, StagingBuffer, StreamCounts, TensorMeta, dtype_name,
                                               iter_buckets)

__all__ = ["InProcessTransport", "PeakMemory", "ProcessGroupReceiver", "ProcessGroupSender", "SyncStats"]

@dataclass
class SyncStats(StreamCounts):
    """What one sync moved (``StreamCounts``: buckets, tensors, payload bytes) and its wall seconds."""

    seconds: float = 0.0
    pack_seconds: float = 0.0
    """Part of ``seconds`` spent copying tensors into flat buffers (sender only)."""
    send_seconds: float = 0.0
    """Part of ``seconds`` spent in (waiting for) the broadcasts (sender only)."""
    join_seconds: float = 0.0
    """Part of ``seconds`` spent joining pieces into whole tensors (receiver only)."""

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


class ProcessGroupSender:
    """Trainer side: broadcast a stream of HF tensors as flat buckets from group rank ``root``.

    The packing buffer is a ``StagingBuffer`` kept for the sender's life: reused across the
    buckets of a send, and across sends by a caller that keeps the sender (the engines make one
    per sync, so the trainer holds no bucket between syncs).
    """

    def __init__(self, group: dist.ProcessGroup, root: int = 0, device: Optional[torch.device] = None):
        self.group, self.root = group, root
        self.device = device or wire.default_device(group)
        self.staging = StagingBuffer(self.device)

    def send(self, named_tensors: Iterable[Tuple[str, Tensor]], bucket_bytes: int) -> SyncStats:
        """Send every tensor in buckets of ``bucket_bytes``, then the end marker.

        Extra memory: one packed bucket (``<= max(bucket_bytes, largest tensor)``); a bucket that
        holds a single contiguous tensor already on the device is sent without a copy.
        """
        return self.send_buckets(iter_buckets(named_tensors, bucket_bytes))

    def send_buckets(self, buckets: Iterable) -> SyncStats:
        """Send ready-made buckets, then the end marker. A bucket is a ``FlatBucket`` (e.g. the
        Megatron export's: sent as is, no copy) or a list of ``(name, tensor)`` (packed here).
        Each bucket's data broadcast is left in flight while the next bucket is pulled from
        ``buckets`` (the producer packs it); it is waited before the next one is sent (or packed
        here), so a producer with a two-slot ``StagingBuffer`` reuses its two buffers and never
        holds a third."""
        stats = SyncStats()
        link = wire.group_link(self.group, self.root)
        data_link = wire.group_link_async(self.group, self.root)
        in_flight: Optional[wire.Pending] = None
        t0 = time.perf_counter()
        try:
            # Bucket k's data is in flight while the loop pulls (the producer packs) bucket k+1:
            # at most two buckets alive, the one moving and the one being filled. A list bucket
            # packed HERE waits first, so the sender's own memory stays one bucket.
            for bucket in buckets:
                metas, nbytes, materialize = self._plan(bucket)
                if in_flight is not None and not isinstance(bucket, FlatBucket):
                    in_flight.wait()
                tp = time.perf_counter()
                buffer = materialize()
                ts = time.perf_counter()
                stats.pack_seconds += ts - tp
                if in_flight is not None:
                    in_flight.wait()  # bucket k's buffer is free for bucket k+2
                in_flight = wire.send_bucket_async(link, data_link, FlatBucket(metas, buffer), self.device)
                stats.send_seconds += time.perf_counter() - ts
                stats.count_bucket(metas)
                del bucket, buffer, materialize
            ts = time.perf_counter()
            if in_flight is not None:
                in_flight.wait()
                in_flight = None
            stats.send_seconds += time.perf_counter() - ts
        except BaseException:
            # Receivers block waiting for the next header: end their stream so they return
            # (with a partial update the caller must redo) instead of hanging until timeout.
            try:
                if in_flight is not None:
                    in_flight.wait()
                wire.send_end(link, self.device)
            except Exception:  # noqa: BLE001 - the group itself may be what failed
                pass
            raise
        wire.send_end(link, self.device)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _plan(self, bucket):
        """``(metas, nbytes, materialize)``: the bucket's layout, and a function that returns
        its flat ``uint8`` buffer on ``self.device`` (a copy only where one is needed)."""
        if isinstance(bucket, FlatBucket):
            metas, flat = bucket.metas, bucket.buffer
        elif len(bucket) == 1 and bucket[0][1].is_contiguous():
            name, t = bucket[0]
            metas = [TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), 0, t.numel() * t.element_size())]
            flat = t.detach().reshape(-1).view(torch.uint8)
        else:
            metas, nbytes = FlatBucket.layout(bucket)
            return metas, nbytes, lambda: FlatBucket.pack(bucket, out=self.staging.get(nbytes)).buffer
        return metas, flat.numel(), lambda: flat.to(self.device)


class ProcessGroupReceiver:
    """Engine side: receive the bucket stream sent by a ``ProcessGroupSender``.

    ``receive()`` is a generator of ``(name, tensor)`` views into the bucket's buffer (a
    ``StagingBuffer``, reused only once no view of it survives, also across syncs when the
    receiver is kept); pass it straight to a weight loader. A tensor sent in pieces (the
    Megatron export's ``pieces=True``) is joined first and yielded whole (``Assembler``: one
    extra tensor here while it arrives). ``stats`` is filled as it runs.
    """

    def __init__(self, group: dist.ProcessGroup, root: int = 0, device: Optional[torch.device] = None):
        self.group, self.root = group, root
        self.device = device or wire.default_device(group)
        self.staging = StagingBuffer(self.device)
        self.stats = SyncStats()

    def receive(self) -> Iterator[Tuple[str, Tensor]]:
        self.stats = SyncStats()
        t0 = time.perf_counter()
        link = wire.group_link(self.group, self.root)
        asm = Assembler()
        while (bucket := wire.recv_bucket(link, self.device, self.staging)) is not None:
            self.stats.num_buckets += 1
            for name, view in asm.feed(bucket):
                self.stats.count_tensor(view)
                yield name, view
                del view
            del bucket
        asm.close()
        self.stats.join_seconds = asm.seconds
        self.stats.seconds = time.perf_counter() - t0


class InProcessTransport:
    """Hand the tensor stream to an engine in this process (no copy); count what passed."""

    def __init__(self, engine):
        self.engine = engine

    def sync(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> SyncStats:
        stats = SyncStats()

        def counted():
            for name, t in named_tensors:
                stats.count_tensor(t)
                yield name, t

        t0 = time.perf_counter()
        self.engine.update_weights(counted())
        stats.seconds = time.perf_counter() - t0
        return stats


class PeakMemory:
    """Context manager: peak extra bytes allocated by torch in this process inside the block.

    CPU: replays the allocator's alloc/free events recorded by the torch profiler (exact for
    torch tensors, blind to non-torch allocations). CUDA (``device="cuda"``): the caching
    allocator's peak above the level at entry. Result in ``.peak_bytes``.
    """

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.peak_bytes: int = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        self._prof.__exit__(*exc)
        events = [e for e in self._prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        events.sort(key=lambda e: e.start_ns())
        level = peak = 0
        for e in events:
            level += e.nbytes()
            peak = max(peak, level)
        self.peak_bytes = peak
