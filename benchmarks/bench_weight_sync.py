"""Weight-sync time, bandwidth and peak memory through the process-group transport, against a raw
collective of the same bytes.

Setup: a trainer job (``tp * pp`` gloo ranks; rank 0 sends) and one engine process (receives)
joined by a 2-member weight group, as a disaggregated engine would be. Per repeat:

- ``transport``: ``ProcessGroupSender`` -> ``ProcessGroupReceiver`` of the whole model in flat
  buckets of ``--bucket-mb``; the receiver copies every tensor into preallocated "engine"
  parameters, as an engine's loader does;
- ``raw``: one broadcast of a preallocated buffer of the same total bytes (the floor: no
  bucketing, no metadata, no producer);
- ratio = transport / raw (1.0 = transport overhead-free), and bytes/s of each;
- peak extra memory on the sender and on the receiver during the transport sync (torch
  allocator events), against the bucket size.

Sources (``--source``):
- ``state_dict`` (default): HF-named random tensors of a Qwen2-like model (``--hidden``,
  ``--layers``, ``--vocab``, ``--ffn``; defaults ~370 MB fp32) already resident on rank 0;
- ``megatron``: THE TRAINER PATH - the same shapes written as an HF checkpoint, loaded into a
  Megatron model at ``--tp`` x ``--pp``, and streamed by ``models.export.iter_hf_buckets``
  (dst rank 0: TP gathers, PP hand-off, HF renaming, flat buckets) straight into the sender
  (``send_buckets``, no repacking). The time then includes the export; ``export-only`` is
  reported too.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_weight_sync.py [--source megatron --tp 2 --pp 2]
[--bucket-mb 64] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

GROUP = "bench_weights"


def hf_shapes(hidden: int, layers: int, vocab: int, ffn: int, heads: int = 12, kv: int = 4):
    """HF Qwen2 tensor names and shapes for the given dimensions."""
    hd = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.q_proj.bias": (heads * hd,),
            p + "self_attn.k_proj.weight": (kv * hd, hidden), p + "self_attn.k_proj.bias": (kv * hd,),
            p + "self_attn.v_proj.weight": (kv * hd, hidden), p + "self_attn.v_proj.bias": (kv * hd,),
            p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return shapes


def _engine(port: int, shapes: dict, repeats: int, out_q) -> None:
    """The engine process: receive every repeat into preallocated parameters, then the raw bytes."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from megatron_stare.weight_sync import init_named_weight_group
    from megatron_stare.weight_sync import PeakMemory, ProcessGroupReceiver

    group = init_named_weight_group("127.0.0.1", port, 1, 2, GROUP, "gloo")
    params = {n: torch.empty(s) for n, s in shapes.items()}
    total = sum(t.numel() * t.element_size() for t in params.values())
    raw = torch.empty(total, dtype=torch.uint8)
    peaks, copy_s = [], []
    for _ in range(repeats):
        recv = ProcessGroupReceiver(group, 0)
        spent = 0.0
        with PeakMemory() as mem:
            for name, t in recv.receive():
                t0 = time.perf_counter()
                params[name].copy_(t)
                spent += time.perf_counter() - t0
                del t
        peaks.append(mem.peak_bytes)
        copy_s.append(spent)
        group.broadcast(raw, 0).wait()
    out_q.put((peaks, copy_s))


def _trainer(rank, world, args, port, shapes, hf_dir):
    from megatron_stare.weight_sync import init_named_weight_group
    from megatron_stare.weight_sync import PeakMemory, ProcessGroupSender, iter_buckets

    bucket = args.bucket_mb << 20
    if args.source == "megatron":
        from megatron_stare.models.export import ExportStats, iter_hf_buckets
        from megatron_stare.models.provider import build_from_hf
        from megatron_stare.parallel import ParallelLayout, init_distributed

        groups = init_distributed(ParallelLayout.from_world(world, tp=args.tp, pp=args.pp))
        model, spec, _ = build_from_hf(hf_dir, groups)
        export_stats = ExportStats()
        source = lambda: iter_hf_buckets(model, groups, spec, bucket, dst=0,  # noqa: E731
                                         stats=export_stats)
    else:
        export_stats = None
        g = torch.Generator().manual_seed(0)
        sd = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
        source = lambda: iter_buckets(iter(sd.items()), bucket)  # noqa: E731
    total = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    export_s = []
    for _ in range(args.repeats if args.source == "megatron" else 0):
        t0 = time.perf_counter()
        for b in source():
            del b
        export_s.append(time.perf_counter() - t0)
    if rank != 0:
        for _ in range(args.repeats):
            for b in source():
                del b
        return None
    group = init_named_weight_group("127.0.0.1", port, 0, 2, GROUP, "gloo")
    sender = ProcessGroupSender(group, 0)
    raw = torch.zeros(total, dtype=torch.uint8)
    times, raws, peaks, packs, nbuckets = [], [], [], [], 0
    for _ in range(args.repeats):
        with PeakMemory() as mem:
            stats = sender.send_buckets(source())
        times.append(stats.seconds)
        packs.append(stats.pack_seconds)
        peaks.append(mem.peak_bytes)
        nbuckets = stats.num_buckets
        assert stats.bytes == total, (stats.bytes, total)
        t0 = time.perf_counter()
        group.broadcast(raw, 0).wait()
        raws.append(time.perf_counter() - t0)
    return {"total": total, "times": times, "raws": raws, "peaks": peaks, "buckets": nbuckets,
            "export_s": export_s, "packs": packs,
            "export_peak": export_stats.peak_live_bytes if export_stats else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", choices=["state_dict", "megatron"], default="state_dict")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from megatron_stare.testing.distributed import free_port, run_on_ranks

    shapes = hf_shapes(args.hidden, args.layers, args.vocab, args.ffn)
    hf_dir = None
    if args.source == "megatron":
        from megatron_stare.testing.hf_models import build_tiny_hf_model

        hf_dir = str(build_tiny_hf_model(
            "qwen2", Path(tempfile.mkdtemp(prefix="bench_ws_")) / "m", num_layers=args.layers,
            vocab_size=args.vocab, hidden_size=args.hidden, num_heads=12, num_kv_heads=4,
            ffn_hidden_size=args.ffn))
    world = args.tp * args.pp if args.source == "megatron" else 1
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    eng = ctx.Process(target=_engine, args=(port, shapes, args.repeats, q))
    eng.start()
    try:
        out = run_on_ranks(_trainer, world, args, port, shapes, hf_dir, timeout=3600)[0]
        recv_peaks, recv_copy = q.get(timeout=600)
    finally:
        eng.join(timeout=30)
        if eng.is_alive():
            eng.kill()
    mb = out["total"] / 2 ** 20
    t, r = statistics.median(out["times"]), statistics.median(out["raws"])
    src = f"megatron TP{args.tp}xPP{args.pp}" if args.source == "megatron" else "state dict"
    print(f"source: {src}; model {mb:.0f} MB fp32, {len(shapes)} HF tensors; "
          f"bucket {args.bucket_mb} MB -> {out['buckets']} buckets; median of {args.repeats}")
    print(f"transport : {t:7.3f} s  {mb / t:8.1f} MB/s")
    print(f"raw bcast : {r:7.3f} s  {mb / r:8.1f} MB/s")
    print(f"ratio transport/raw: {t / r:.2f}   (inside transport: sender packing "
          f"{statistics.median(out['packs']):.3f} s, receiver copy into parameters "
          f"{statistics.median(recv_copy):.3f} s; raw does neither)")
    if out["export_s"]:
        e = statistics.median(out["export_s"])
        print(f"export-only (TP gather + PP hand-off + HF conversion + packing): {e:.3f} s; "
              f"exporter's own peak on rank 0: {out['export_peak'] / 2 ** 20:.1f} MB "
              f"(bucket + the tensor being converted; the transport adds no copy)")
    print(f"peak extra memory: sender {max(out['peaks']) / 2 ** 20:.1f} MB, receiver "
          f"{max(recv_peaks) / 2 ** 20:.1f} MB (bucket {args.bucket_mb} MB; model {mb:.0f} MB)")


if __name__ == "__main__":
    main()
