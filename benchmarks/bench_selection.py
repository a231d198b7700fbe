"""Exact radix top-k across ranks against all-gather + torch.topk, for world sizes 1-4 on gloo.

Each rank holds ``N_local`` fp32 values (surprisal-like: |normal| * 3, quantised to 1e-3 so there
are many ties) and int64 token keys; ``k`` = 10% of the global count. Per row it prints the median
over ``--repeats`` (after a warm-up, ranks barrier-synchronised) of:

- ours: ``topk_threshold`` + ``TopKThreshold.select`` (exactly k selected, layout-independent);
- gather: ``all_gather`` of values and keys, ``torch.topk`` on the concatenation, then the local
  mask ``v >= kth`` (what an exact-threshold baseline costs; it does not resolve ties);

and the bytes each rank receives: ours counted on its collectives (``2**radix_bits`` int64 counts
per radix pass plus O(world) all-gathers), gather ``N_global * 12``. On this CPU/gloo setup the
ranks share 2 cores, so absolute times are dominated by collective latency and oversubscription;
the message-size column is the figure that carries over to NCCL.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_selection.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megatron_stare.ops.selection import topk_threshold
from megatron_stare.testing.distributed import run_on_ranks


def _median_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        s = time.perf_counter()
        fn()
        times.append(time.perf_counter() - s)
    return statistics.median(times)


def _bench(rank, world_size, n_local, repeats):
    g = torch.Generator().manual_seed(rank)
    values = ((torch.randn(n_local, generator=g).abs() * 3 * 1000).round() / 1000).float()
    keys = torch.arange(n_local, dtype=torch.int64) * world_size + rank
    group = dist.group.WORLD
    k = (n_local * world_size) // 10

    # Count our collectives and the bytes each rank receives through them.
    stats = {"calls": 0, "bytes": 0}
    real_all_reduce, real_all_gather = dist.all_reduce, dist.all_gather

    def counting_all_reduce(t, *a, **kw):
        stats["calls"] += 1
        stats["bytes"] += t.numel() * t.element_size()
        return real_all_reduce(t, *a, **kw)

    def counting_all_gather(out, t, *a, **kw):
        stats["calls"] += 1
        stats["bytes"] += len(out) * t.numel() * t.element_size()
        return real_all_gather(out, t, *a, **kw)

    def ours():
        return topk_threshold(values, keys, k, group).select(values, keys)

    def gather():
        vs = [torch.empty_like(values) for _ in range(world_size)]
        ks = [torch.empty_like(keys) for _ in range(world_size)]
        dist.all_gather(vs, values, group=group)
        dist.all_gather(ks, keys, group=group)
        kth = torch.topk(torch.cat(vs), k).values[-1]
        return values >= kth

    dist.all_reduce, dist.all_gather = counting_all_reduce, counting_all_gather
    try:
        mask = ours()
    finally:
        dist.all_reduce, dist.all_gather = real_all_reduce, real_all_gather
    n_sel = mask.sum()
    real_all_reduce(n_sel)
    t_ours = _median_time(ours, repeats)
    t_gather = _median_time(gather, repeats)
    n_gather = gather().sum()
    real_all_reduce(n_gather)
    return t_ours, t_gather, stats["calls"], stats["bytes"], int(n_sel), int(n_gather), k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 20])
    args = ap.parse_args()
    print("exact radix top-k (ours) vs all_gather + torch.topk (gather); gloo, ranks share 2 CPU "
          f"cores; median of {args.repeats}; k = 10% of N_global; fp32 values with many ties")
    for n_local in args.sizes:
        for ws in (1, 2, 3, 4):
            t_o, t_g, n_calls, ours_bytes, n_sel, n_gat, k = run_on_ranks(
                _bench, ws, n_local, args.repeats, timeout=600)[0]
            gather_bytes = n_local * ws * 12
            print(f"N_local={n_local:>8} world={ws}  ours {t_o * 1e3:8.1f} ms  gather "
                  f"{t_g * 1e3:8.1f} ms  (gather/ours x{t_g / t_o:5.2f})  bytes in/rank ours "
                  f"{ours_bytes / 1024:6.1f} KiB ({n_calls} collectives) vs gather "
                  f"{gather_bytes / 2 ** 20:7.2f} MiB  selected ours {n_sel} (k={k}) vs gather "
                  f"{n_gat}", flush=True)


if __name__ == "__main__":
    main()
