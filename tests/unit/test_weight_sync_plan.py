"""Bucketing, flat packing, checksums and the in-process transport (single process)."""

from __future__ import annotations

import pytest
import torch

from megatron_stare.weight_sync import (FlatBucket, InProcessTransport, PeakMemory, ProcessGroupReceiver,
                                        ProcessGroupSender, compare_checksums, iter_buckets,
                                        iter_flat_buckets, tensor_checksum)
from megatron_stare.weight_sync import ALIGN_BYTES, decode_header


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(10, 7, generator=g)),                     # 280 B
        ("b.bias", torch.randn(3, generator=g).to(torch.bfloat16)),         # 6 B
        ("c.weight", torch.randn(100, 20, generator=g)),                   # 8000 B
        ("d.mask", torch.tensor([True, False, True])),                      # 3 B
        ("e.scalar", torch.tensor(3.5, dtype=torch.float64)),              # 8 B
        ("f.ids", torch.arange(5, dtype=torch.int32)),
        ("g.empty", torch.empty(0, 4)),
    ]


def test_iter_buckets_respects_the_size_and_is_lazy():
    named = _tensors()
    buckets = list(iter_buckets(named, 1024))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]  # order kept
    for b in buckets:
        packed = FlatBucket.pack(b)
        assert len(b) == 1 or packed.nbytes <= 1024
    assert [n for n, _ in buckets[1]] == ["c.weight"]  # a big tensor travels alone

    pulled = []

    def producer():
        for item in named:
            pulled.append(item[0])
            yield item

    it = iter_buckets(producer(), 1024)
    first = next(it)
    # Only one tensor past the first bucket was pulled (the one that did not fit).
    assert len(pulled) == len(first) + 1


def test_iter_buckets_rejects_duplicates_and_bad_size():
    with pytest.raises(ValueError, match="twice"):
        list(iter_buckets([("x", torch.zeros(1)), ("x", torch.zeros(1))], 100))
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets([], 0))


def test_flat_bucket_round_trip_is_bit_exact_and_aligned():
    named = _tensors()
    flat = FlatBucket.pack(named)
    assert flat.buffer.dtype == torch.uint8 and flat.buffer.dim() == 1
    assert all(m.offset % ALIGN_BYTES == 0 for m in flat.metas)
    out = dict(flat.tensors())
    for name, t in named:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)
        if t.numel():
            assert out[name].untyped_storage().data_ptr() == flat.buffer.untyped_storage().data_ptr()
    metas = decode_header(flat.header(), flat.nbytes)
    assert metas == flat.metas


def test_flat_buckets_of_non_contiguous_tensors():
    t = torch.arange(12.0).reshape(3, 4).t()
    (flat,) = list(iter_flat_buckets([("t", t)], 1 << 20))
    assert torch.equal(dict(flat.tensors())["t"], t)


def test_checksums():
    t = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    c = tensor_checksum(t)
    assert c.sum == pytest.approx(t.double().sum().item())
    assert c.sumsq == pytest.approx((t.double() ** 2).sum().item())
    assert c == tensor_checksum(t.clone())
    u = t.clone()
    u[2, 3] = torch.nextafter(u[2, 3], torch.tensor(1e9))  # one ulp
    assert tensor_checksum(u).digest != c.digest
    exp = {"t": c}
    assert compare_checksums(exp, {"t": tensor_checksum(u)}) == ["t"]
    assert compare_checksums(exp, {"t": tensor_checksum(u)}, exact=False) == []
    assert compare_checksums(exp, {"t": tensor_checksum(t.to(torch.bfloat16))}, exact=False,
                             rtol=1e-2) == []
    assert compare_checksums(exp, {}) == ["t"]
    assert type(c).from_json(c.to_json()) == c


def test_in_process_transport_counts_and_forwards():
    class Sink:
        def update_weights(self, stream):
            self.got = dict(stream)

    named = _tensors()
    sink = Sink()
    stats = InProcessTransport(sink).sync(iter(named))
    assert stats.num_tensors == len(named)
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in named)
    assert all(sink.got[n] is t for n, t in named)  # no copy


def test_peak_memory_measures_torch_allocations():
    with PeakMemory() as m:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(1 << 19, dtype=torch.uint8)
        del a, b
        c = torch.empty(1 << 18, dtype=torch.uint8)
        del c
    assert (1 << 20) + (1 << 19) <= m.peak_bytes < (1 << 20) + (1 << 19) + 4096


def test_process_group_wire_format_round_trip_and_buffer_reuse():
    """Broadcasts recorded on the sending side and replayed into a receiver (the multi-process
    run is tests/distributed/test_weight_sync_pg.py)."""
    import megatron_stare.weight_sync.wire as tr

    sent = []
    orig, orig_async = tr.broadcast, tr.broadcast_async
    tr.broadcast = lambda tensor, root, group: sent.append(tensor.clone())
    # the sender leaves data broadcasts in flight: record them too (None: already complete)
    tr.broadcast_async = lambda tensor, root, group: tr.Pending(tensor, lambda t: sent.append(t.clone()))
    try:
        stats = ProcessGroupSender(object(), 0, device=torch.device("cpu")).send(iter(_tensors()), 1024)
        replay = iter(sent)
        tr.broadcast = lambda tensor, root, group: tensor.copy_(next(replay))
        recv = ProcessGroupReceiver(object(), 0, device=torch.device("cpu"))
        got, storages = {}, set()
        for n, t in recv.receive():  # a consumer that copies and lets go
            got[n] = t.clone()
            storages.add(t.untyped_storage().data_ptr())
            del t
    finally:
        tr.broadcast, tr.broadcast_async = orig, orig_async
    for n, t in _tensors():
        assert torch.equal(got[n], t) and got[n].dtype == t.dtype
    assert recv.stats.num_buckets == stats.num_buckets and recv.stats.bytes == stats.bytes
    # The receive buffer is reused across buckets once the consumer let go of it.
    assert stats.num_buckets >= 3 and len(storages) < stats.num_buckets


def _record_and_replay(send):
    """Run ``send(sender)`` with broadcasts recorded, then replay them into a receiver."""
    import megatron_stare.weight_sync.wire as tr

    sent = []
    orig, orig_async = tr.broadcast, tr.broadcast_async
    tr.broadcast = lambda tensor, root, group: sent.append(tensor.clone())
    # the sender leaves data broadcasts in flight: record them too (None: already complete)
    tr.broadcast_async = lambda tensor, root, group: tr.Pending(tensor, lambda t: sent.append(t.clone()))
    try:
        try:
            send(ProcessGroupSender(object(), 0, device=torch.device("cpu")))
        except OSError:
            pass
        replay = iter(sent)
        tr.broadcast = lambda tensor, root, group: tensor.copy_(next(replay))
        recv = ProcessGroupReceiver(object(), 0, device=torch.device("cpu"))
        return {n: t.clone() for n, t in recv.receive()}, recv.stats
    finally:
        tr.broadcast, tr.broadcast_async = orig, orig_async


def test_ready_flat_buckets_are_sent_without_repacking():
    named = _tensors()
    b = FlatBucket.pack(named)  # the Megatron export's bucket type
    got, stats = _record_and_replay(lambda s: s.send_buckets([b, [("z", torch.ones(3))]]))
    assert stats.num_buckets == 2
    for n, t in named + [("z", torch.ones(3))]:
        assert torch.equal(got[n], t)


def test_a_failing_producer_still_ends_the_receivers_stream():
    def broken():
        yield "a.weight", torch.ones(300)  # 1200 B: a bucket of its own
        yield "b.weight", torch.ones(4)    # pending in the next bucket when the producer fails
        raise OSError("export failed")

    got, stats = _record_and_replay(lambda s: s.send(broken(), 1024))
    # The receiver got the complete bucket and then the end marker: it returned instead of
    # waiting forever (the caller re-raises and must redo the update).
    assert list(got) == ["a.weight"] and stats.num_buckets == 1
