"""Weight sync across processes on gloo: the process-group transport and the Megatron export.

1. Trainer rank 0 broadcasts model B's HF tensors in flat buckets; engine rank 1 (``hf``
   engine started from model A) loads them straight from the receiver. The engine then
   reproduces transformers' greedy tokens and log-probs of B, and the peak extra memory
   measured on BOTH ranks during the sync is bounded by the bucket size.
2. A Megatron model at TP2 built from B streams itself (``models.export.iter_hf_buckets``,
   dst rank 0) into an ``hf`` engine holding A on rank 0: same equality.
3. The trainer's sync to an engine process: a Megatron replica at TP2 (ranks 0-1 of a DP2xTP2
   world) exports in pieces (``pieces=True``) and rank 0 broadcasts the buckets, one in flight
   while the next is filled, to an ``hf`` engine on rank 2: same equality, and the sending
   rank's peak extra memory stays within two buckets although the embedding is larger than a
   bucket (the whole-tensor export of the same model needs more: the bound is not vacuous).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.hf_models import build_tiny_hf_model

from ..unit.test_rollout_hf import LOGPROB_ATOL, MAX_NEW, PROMPTS, reference_outputs

pytestmark = pytest.mark.distributed

BUCKET = 256 << 10  # the tiny model has 27 tensors, ~1.5 MB; largest 203 KB
HEADER_SLACK = 16 << 10  # header + JSON metadata tensors of one bucket


def _pg_worker(rank, world, a_dir, b_dir, bucket_bytes):
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_stare.rollout import SamplingParams, build_engine
    from megatron_stare.weight_sync import (PeakMemory, ProcessGroupReceiver, ProcessGroupSender,
                                            tensor_checksum)

    group = dist.new_group(list(range(world)))
    if rank == 0:
        sd = load_file(str(Path(b_dir) / "model.safetensors"))
        dist.barrier()
        sender = ProcessGroupSender(group, root=0)
        with PeakMemory() as mem:
            stats = sender.send(iter(sd.items()), bucket_bytes)
        sender.send(iter(sd.items()), bucket_bytes)  # for the hoarding receiver below
        return {"peak": mem.peak_bytes, "stats": stats}
    engine = build_engine("hf", a_dir, device="cpu")
    recv = ProcessGroupReceiver(group, root=0)
    dist.barrier()
    with PeakMemory() as mem:
        engine.update_weights(recv.receive())
    stats = recv.stats
    res = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW,
                                                  ignore_eos=True))
    # A consumer that keeps every view (as vLLM's layer-wise reload does for partial layers):
    # buffers must not be reused under it.
    hoard = list(recv.receive())
    return {"peak": mem.peak_bytes, "stats": stats,
            "results": [(r.token_ids, r.logprobs) for r in res],
            "hoard": {n: tensor_checksum(t) for n, t in hoard}}


def _check(results, reference):
    for (toks, lps), (ref_toks, ref_lps) in zip(results, reference):
        assert toks == ref_toks
        assert (lps - ref_lps).abs().max().item() <= LOGPROB_ATOL


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws_models")
    a = build_tiny_hf_model("qwen2", root / "A", seed=0)
    b = build_tiny_hf_model("qwen2", root / "B", seed=1)
    return a, b, reference_outputs(b, PROMPTS, MAX_NEW)


def test_process_group_push_into_engine_with_bounded_memory(models):
    a, b, ref_b = models
    sender, receiver = run_on_ranks(_pg_worker, 2, str(a), str(b), BUCKET)
    _check(receiver["results"], ref_b)
    s, r = sender["stats"], receiver["stats"]
    assert s.num_tensors == r.num_tensors == 27 and s.bytes == r.bytes
    assert s.num_buckets == r.num_buckets > 3
    # Peak extra memory per rank: one bucket (plus its header / metadata), never the model.
    assert sender["peak"] <= BUCKET + HEADER_SLACK, sender["peak"]
    assert receiver["peak"] <= BUCKET + HEADER_SLACK, receiver["peak"]
    assert s.bytes > 4 * BUCKET  # the bound is meaningful: the model is much larger
    from safetensors.torch import load_file

    from megatron_stare.weight_sync import tensor_checksum

    sd = load_file(str(Path(b) / "model.safetensors"))
    assert receiver["hoard"] == {n: tensor_checksum(t) for n, t in sd.items()}


def _export_worker(rank, world, a_dir, b_dir, bucket_bytes):
    from megatron_stare.weight_sync.export import iter_hf_buckets
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.rollout import SamplingParams, build_engine

    groups = init_distributed(ParallelLayout.from_world(world, tp=2))
    model, spec, _ = build_from_hf(b_dir, groups, make_vocab_size_divisible_by=16)
    engine = build_engine("hf", a_dir, device="cpu") if rank == 0 else None
    buckets = iter_hf_buckets(model, groups, spec, bucket_bytes, dst=0)
    if engine is None:
        for _ in buckets:  # take part in the TP gathers
            pass
        return None
    engine.update_weights_from_buckets(buckets)
    res = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW,
                                                  ignore_eos=True))
    return [(r.token_ids, r.logprobs) for r in res]


def test_megatron_tp2_export_streams_into_engine(models):
    a, b, ref_b = models
    results = run_on_ranks(_export_worker, 2, str(a), str(b), 48 << 10)
    _check(results[0], ref_b)


PIECE_BUCKET = 64 << 10  # below the embedding (397 x 128 fp32 = 203 KB)


def _piece_sync_worker(rank, world, a_dir, b_dir):
    import torch.distributed as dist

    from megatron_stare.weight_sync.export import iter_hf_buckets
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.rollout import SamplingParams, build_engine
    from megatron_stare.weight_sync import PeakMemory, ProcessGroupReceiver, ProcessGroupSender

    groups = init_distributed(ParallelLayout.from_world(world, tp=2))  # replicas {0, 1} and {2, 3}
    link = dist.new_group([0, 2])
    if rank == 2:  # the engine process (its replica has nothing to export to rank 0)
        engine = build_engine("hf", a_dir, device="cpu")
        recv = ProcessGroupReceiver(link, root=0)
        out = {}
        for pieces in (True, False):
            engine.update_weights(recv.receive())
            res = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True))
            out[pieces] = [(r.token_ids, r.logprobs) for r in res]
        return out
    if rank == 3:
        return None
    model, spec, _ = build_from_hf(b_dir, groups, make_vocab_size_divisible_by=16)
    out = {}
    for pieces in (True, False):
        buckets = iter_hf_buckets(model, groups, spec, PIECE_BUCKET, dst=0, pieces=pieces)
        if rank == 1:
            for _ in buckets:  # this rank's pieces (or TP gathers) for rank 0
                pass
            continue
        sizes = []

        def watched():
            for b in buckets:
                sizes.append(b.nbytes)
                yield b
                del b

        sender = ProcessGroupSender(link, root=0)
        with PeakMemory() as mem:
            sender.send_buckets(watched())
        out[pieces] = {"peak": mem.peak_bytes, "max_bucket": max(sizes), "buckets": len(sizes)}
    return out


def test_piece_export_syncs_an_engine_process_within_two_buckets(models):
    a, b, ref_b = models
    sender, _, engine, _ = run_on_ranks(_piece_sync_worker, 4, str(a), str(b))
    for pieces in (True, False):
        _check(engine[pieces], ref_b)
    p, w = sender[True], sender[False]
    assert p["max_bucket"] <= PIECE_BUCKET < w["max_bucket"], (p, w)
    assert p["buckets"] > 10
    assert p["peak"] <= 2 * PIECE_BUCKET + HEADER_SLACK, p
    assert w["peak"] > 2 * PIECE_BUCKET + HEADER_SLACK, w  # the whole-tensor export: gather buffer, big buckets
