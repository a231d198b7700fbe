"""Weight sync from a Megatron trainer to an engine, against the raw collectives of the same bytes.

Setup: a trainer world of ``tp * pp`` gloo ranks (a Megatron model loaded from a Qwen2-like HF
checkpoint) and one engine process joined to global rank 0 by a 2-member weight group, as a
disaggregated engine would be. Two variants, each in its OWN world (its own trainer ranks and
its own engine process; ``bench_common``), timed in interleaved rounds (median of the paired
ratios):

- ``sync``: the trainer path - ``models.export.iter_hf_buckets(dst=0, pieces=True)`` (each TP
  rank's rows sent point-to-point straight into buckets of at most ``--bucket-mb`` on the
  stage's collector, the PP hand-off to rank 0) streamed by ``ProcessGroupSender`` to the
  engine's ``ProcessGroupReceiver``, which joins pieces and copies every tensor into
  preallocated parameters. Sender and receiver are kept across syncs (as the engines keep them).
- ``whole``: the same with the whole-tensor export (``pieces=False``: TP all-gather of each
  canonical tensor, HF conversion, a bucket of its own for a tensor above the bucket size) -
  the path before pieces, and still the checkpoint writer's.
- ``raw``: the collectives the same bytes need and nothing else, measured one after the other
  on preallocated buffers: (1) the TP gather: every TP rank but the stage's collector (TP rank
  0) sends the bytes of its TP-split parameter shards to it, ``send``/``recv``, all stages at
  once (the bytes the piece export moves; the vocabulary padding rows included), (2)
  ``send``/``recv`` of every other stage's HF bytes to rank 0 (the PP hand-off), (3) one
  broadcast of the whole model's HF bytes to the engine. Recorded beside it, not in its total:
  an ``all_gather_into_tensor`` of the same shards over TP (``allgather``), the collective
  the whole-tensor export uses (every TP rank receives everything).

Both end when the engine has acknowledged (a 1-element broadcast back), so the receiver's last
copy is inside the sync time. ``ratio = sync / raw``; the goal (issue #17) is <= 1.5 at TP2xPP2
(``whole_ratio = whole / raw`` alongside).
Also recorded: the per-phase times inside the sync on rank 0 (TP gather, PP hand-off, packing,
broadcast: ``ExportStats`` / ``SyncStats``) and the sender's peak extra memory (torch allocator
events on rank 0 during one sync, outside the timed rounds) in units of the bucket size.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_weight_sync.py [--layouts 2x1 2x2]
[--bucket-mb 32] [--repeats 5] [--json benchmarks/results/weight_sync.json]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402

GROUP = "bench_weights"
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*")  # its replacement is not in every torch
EXIT, SYNC, RAW = 0, 1, 2
VARIANTS = ("sync", "whole", "raw")


def _engine(port: int) -> None:
    """The engine process: obey commands broadcast by the trainer's rank 0 over the weight group."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from megatron_stare.weight_sync import ProcessGroupReceiver, init_named_weight_group
    from megatron_stare.weight_sync.wire import broadcast

    group = init_named_weight_group("127.0.0.1", port, 1, 2, GROUP, "gloo")
    recv = ProcessGroupReceiver(group, 0)  # kept across syncs: its staging buffer is reused
    params, raw, ack = {}, None, torch.ones(1)
    while True:
        cmd = torch.zeros(2, dtype=torch.int64)
        broadcast(cmd, 0, group)
        if int(cmd[0]) == EXIT:
            return
        if int(cmd[0]) == SYNC:
            copy_s = 0.0
            for name, t in recv.receive():
                dst = params.get(name)
                if dst is None:  # first (warm-up) sync: allocate the "engine parameters"
                    dst = params[name] = torch.empty_like(t)
                t0 = time.perf_counter()
                dst.copy_(t)
                copy_s += time.perf_counter() - t0
                del t
            broadcast(ack, 1, group)
            # The engine's side of the sync, for the profile: receive loop, joins, parameter copies.
            broadcast(torch.tensor([recv.stats.seconds, recv.stats.join_seconds, copy_s]), 1, group)
            continue
        else:
            if raw is None or raw.numel() != int(cmd[1]):
                raw = torch.zeros(int(cmd[1]), dtype=torch.uint8)
            broadcast(raw, 0, group)
        broadcast(ack, 1, group)


def _trainer_setup(rank, world, kind, tp, pp, hf_dir, bucket_bytes):
    """One rank of a variant's world; returns its runner."""
    torch.set_num_threads(1)
    from megatron_stare.weight_sync.export import ExportStats, iter_hf_buckets
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.runtime.parallel import ParallelLayout, group_ranks, init_distributed
    from megatron_stare.testing.distributed import free_port
    from megatron_stare.weight_sync import PeakMemory, ProcessGroupSender, init_named_weight_group
    from megatron_stare.weight_sync.wire import broadcast

    groups = init_distributed(ParallelLayout.from_world(world, tp=tp, pp=pp))
    model, spec, _ = build_from_hf(hf_dir, groups)

    def export(stats=None):
        return iter_hf_buckets(model, groups, spec, bucket_bytes, dst=0, stats=stats, pieces=kind == "sync")

    # Byte counts of what the sync moves, from one export (also the warm-up of the export).
    st = ExportStats()
    for b in export(st):
        del b
    stage_bytes = torch.tensor([st.bytes if groups.tp_rank == 0 else 0], dtype=torch.int64)
    all_stage = [torch.zeros_like(stage_bytes) for _ in range(world)]
    dist.all_gather(all_stage, stage_bytes)
    total = int(sum(int(t) for t in all_stage))
    from megatron_stare.models.sharding import local_params
    shard = sum(p.numel() * p.element_size() for _, _, p in local_params(model)
                if tp > 1 and getattr(p, "tensor_model_parallel", False))
    pp_ranks = group_ranks(groups.pp_group) if pp > 1 else [rank]
    mine = int(all_stage[rank]) if 0 in pp_ranks and rank != 0 else 0  # bytes this rank hands to 0

    group = sender = None
    if rank == 0:
        port = free_port()
        eng = mp.get_context("spawn").Process(target=_engine, args=(port,))
        eng.start()
        group = init_named_weight_group("127.0.0.1", port, 0, 2, GROUP, "gloo")
        sender = ProcessGroupSender(group, 0)  # kept across syncs (staging reuse)
    ack = torch.zeros(1)

    def command(code: int, n: int = 0) -> None:
        broadcast(torch.tensor([code, n], dtype=torch.int64), 0, group)

    def sync(stats=None) -> dict:
        t0 = time.perf_counter()
        if rank != 0:
            for b in export(stats):
                del b
            return {"span": time.perf_counter() - t0}
        command(SYNC)
        st = sender.send_buckets(export(stats))
        broadcast(ack, 1, group)
        span = time.perf_counter() - t0
        engine = torch.zeros(3, dtype=torch.float32)
        broadcast(engine, 1, group)  # after the ack: not in the timed span of the sync
        assert st.bytes == total, (st.bytes, total)
        return {"span": span, "pack": st.pack_seconds, "send": st.send_seconds, "buckets": st.num_buckets,
                "engine_receive": float(engine[0]), "engine_join": float(engine[1]), "engine_copy": float(engine[2])}

    sync()  # warm-up: engine parameters and every staging buffer allocated
    gather_in = torch.ones(shard // 4 + 1)
    gather_out = torch.empty(gather_in.numel() * tp)
    hand = torch.zeros(max(mine, 1), dtype=torch.uint8)
    recv_bufs = {r: torch.zeros(int(all_stage[r]), dtype=torch.uint8) for r in pp_ranks if r != 0} \
        if rank == 0 else {}
    bcast = torch.zeros(total, dtype=torch.uint8) if rank == 0 else None

    tp_ranks = group_ranks(groups.tp_group) if tp > 1 else [rank]
    gather_bufs = [torch.empty_like(gather_in) for _ in tp_ranks[1:]] if groups.tp_rank == 0 else []

    def raw() -> dict:
        out = {}
        t0 = time.perf_counter()
        if tp > 1 and groups.tp_rank == 0:
            for src, buf in zip(tp_ranks[1:], gather_bufs):
                dist.recv(buf, src=src)
        elif tp > 1:
            dist.send(gather_in, dst=tp_ranks[0])
        t1 = time.perf_counter()
        if rank == 0:
            for r, buf in recv_bufs.items():
                dist.recv(buf, src=r)
        elif mine:
            dist.send(hand, dst=0)
        t2 = time.perf_counter()
        if rank == 0:
            command(RAW, total)
            broadcast(bcast, 0, group)
            broadcast(ack, 1, group)
        t3 = time.perf_counter()
        out.update(gather=t1 - t0, handoff=t2 - t1, bcast=t3 - t2, span=t3 - t0)
        dist.barrier()
        t4 = time.perf_counter()
        if tp > 1:
            dist.all_gather_into_tensor(gather_out, gather_in, group=groups.tp_group)
        out["allgather"] = time.perf_counter() - t4
        return out

    def runner(cmd):
        dist.barrier()
        if cmd == "info":
            return {"total": total, "shard_bytes": shard, "handoff_bytes": sum(int(all_stage[r]) for r in recv_bufs),
                    "largest_tensor": st.max_tensor_bytes}
        if cmd == "peak":
            if rank != 0:
                sync()
                return None
            with PeakMemory() as mem:
                sync()
            return mem.peak_bytes
        if cmd == "phases":  # one sync with the exporter's phase times (rank 0's view)
            est = ExportStats()
            out = sync(est)
            out["total"] = out.pop("span")
            out.update(gather=est.gather_seconds, handoff=est.handoff_seconds, convert=est.convert_seconds,
                       pack=est.pack_seconds + out.get("pack", 0.0))  # the exporter's packing (+ the sender's: none)
            return out
        if cmd == "time":
            out = raw() if kind == "raw" else sync()
            out["total"] = out.pop("span")  # command to acknowledgement (raw: its collectives)
            return out
        if cmd == "stop" and rank == 0:
            command(EXIT)
            eng.join(timeout=60)
        return None

    return runner


def run_layout(tp: int, pp: int, hf_dir: str, bucket_mb: int, repeats: int) -> dict:
    bb = bucket_mb << 20
    worlds = bench_common.start([bench_common.Variant(k, _trainer_setup, (k, tp, pp, hf_dir, bb))
                                 for k in VARIANTS], world_size=tp * pp)
    try:
        info = worlds.ask("raw", "info")[0]
        rounds = bench_common.interleaved_times(worlds, list(VARIANTS), repeats,
                                                reduce=lambda answers: answers[0])
        phases = {k: [worlds.ask(k, "phases")[0] for _ in range(3)] for k in ("sync", "whole")}
        peak = {k: max(worlds.ask(k, "peak")[0] for _ in range(2)) for k in ("sync", "whole")}
        for n in VARIANTS:
            worlds.ask(n, "stop")
    finally:
        worlds.close()
    sync_t = [r["total"] for r in rounds["sync"]]
    whole_t = [r["total"] for r in rounds["whole"]]
    raw_t = [r["total"] for r in rounds["raw"]]
    raw_ag_t = [r["total"] - r["gather"] + r["allgather"] for r in rounds["raw"]]
    keys = ("gather", "handoff", "convert", "pack", "send", "total", "engine_receive", "engine_join", "engine_copy")
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {
        "layout": f"TP{tp}xPP{pp}", "ranks": tp * pp, "bucket_bytes": bb, "model_bytes": info["total"],
        "largest_tensor_bytes": info["largest_tensor"], "tp_shard_bytes_per_rank": info["shard_bytes"],
        "handoff_bytes": info["handoff_bytes"], "buckets": rounds["sync"][0]["buckets"],
        "whole_buckets": rounds["whole"][0]["buckets"],
        "sync_s": sync_t, "whole_s": whole_t, "raw_s": raw_t, "ratio": bench_common.paired_ratio(sync_t, raw_t),
        "whole_ratio": bench_common.paired_ratio(whole_t, raw_t),
        # against the raw collectives with a TP all-gather in place of the gather (the old baseline)
        "ratio_vs_allgather": bench_common.paired_ratio(sync_t, raw_ag_t),
        "whole_ratio_vs_allgather": bench_common.paired_ratio(whole_t, raw_ag_t),
        "sync_median_s": statistics.median(sync_t), "whole_median_s": statistics.median(whole_t),
        "raw_median_s": statistics.median(raw_t),
        "raw_phases_median_s": {k: med(rounds["raw"], k) for k in ("gather", "handoff", "bcast", "allgather")},
        "sync_phases_median_s": {k: med(phases["sync"], k) for k in keys},
        "whole_phases_median_s": {k: med(phases["whole"], k) for k in keys},
        "sender_peak_bytes": peak["sync"], "sender_peak_buckets": peak["sync"] / bb,
        "whole_sender_peak_bytes": peak["whole"], "whole_sender_peak_buckets": peak["whole"] / bb,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=["2x1", "2x2"], help="TPxPP of the trainer")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--bucket-mb", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here (e.g. benchmarks/results/weight_sync.json)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron_stare.testing.hf_models import build_tiny_hf_model

    hf_dir = str(build_tiny_hf_model(
        "qwen2", Path(tempfile.mkdtemp(prefix="bench_ws_")) / "m", num_layers=args.layers,
        vocab_size=args.vocab, hidden_size=args.hidden, num_heads=12, num_kv_heads=4,
        ffn_hidden_size=args.ffn))
    results = []
    for lay in args.layouts:
        tp, pp = (int(v) for v in lay.split("x"))
        r = run_layout(tp, pp, hf_dir, args.bucket_mb, args.repeats)
        results.append(r)
        mb = r["model_bytes"] / 2 ** 20
        rp, sp = r["raw_phases_median_s"], r["sync_phases_median_s"]
        print(f"{r['layout']}: model {mb:.0f} MiB fp32, bucket {args.bucket_mb} MiB -> {r['buckets']} buckets; "
              f"{args.repeats} interleaved rounds")
        print(f"  sync {r['sync_median_s']:.3f} s | whole-tensor export {r['whole_median_s']:.3f} s | raw collectives "
              f"{r['raw_median_s']:.3f} s (gather {rp['gather']:.3f} + hand-off {rp['handoff']:.3f} + bcast "
              f"{rp['bcast']:.3f}; a TP all-gather instead: {rp['allgather']:.3f}) | ratio {r['ratio']:.2f} (goal <= 1.5), "
              f"whole {r['whole_ratio']:.2f}; against the raw collectives with the all-gather: sync "
              f"{r['ratio_vs_allgather']:.2f}, whole {r['whole_ratio_vs_allgather']:.2f}")
        for k in ("sync", "whole"):
            sp = r[f"{k}_phases_median_s"]
            print(f"  inside {k} (rank 0, median of 3): gather {sp['gather']:.3f}, hand-off {sp['handoff']:.3f}, "
                  f"convert {sp['convert']:.3f}, pack {sp['pack']:.3f}, send {sp['send']:.3f}, total {sp['total']:.3f} s; "
                  f"engine: receive loop {sp['engine_receive']:.3f} (joins {sp['engine_join']:.3f}, parameter copies "
                  f"{sp['engine_copy']:.3f})")
        print(f"  sender peak extra memory {r['sender_peak_bytes'] / 2 ** 20:.1f} MiB = "
              f"{r['sender_peak_buckets']:.2f} buckets (goal <= 2); whole-tensor export "
              f"{r['whole_sender_peak_buckets']:.2f} buckets")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "weight_sync", "machine": bench_common.machine(),
                                               "args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
