"""Exact top-k across ranks (``topk_threshold``) against all-gather + torch.topk, on gloo.

Each rank holds ``N_local`` fp32 values (surprisal-like: ``|normal| * 3`` quantised to 1e-3, so
there are many ties) and int64 token keys; ``k`` = 10% of the global count. Variants, each in its
own world of ranks (processes), timed in interleaved rounds:

- ``ours``: ``topk_threshold`` + ``TopKThreshold.select`` (exactly k selected, ties broken by
  key, layout-independent); with ``--two``, also STARE C2's two thresholds in one
  ``topk_thresholds`` call against two all-gather + topk;
- ``gather``: ``all_gather`` of values and keys, ``torch.topk`` on the concatenation, then the
  local mask ``v >= kth`` (what an exact-threshold baseline costs; it does not resolve ties).

A sample is the mean of the same number of back-to-back calls for every variant, enough for
about 5 ms (barrier first; the slowest rank counts); the ratio is the median over rounds of
ours / gather (<= 1.2 is the goal). Also printed: the bytes each rank receives through our
collectives (counted on them) against ``N_global * 12`` for the gather. The ranks share 2 cores,
so the absolute times are dominated by collective latency and oversubscription; the message sizes
carry over to NCCL. Each variant runs in ``--replicas`` identical worlds (a world can stay slower
than its twin for a whole run here); the ratio pools the pairs (ours#i, gather#i), and
ours#1 / ours#0 (A/A) shows the noise.
The ratios go to ``benchmarks/results/selection.json``.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_selection.py [--repeats 31] [--replicas 2]
[--sizes 1024 65536 1048576] [--worlds 2 3 4] [--sweep 11:4096 16:65536]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench_common import Variant, interleaved_times, machine, paired_ratio, start

RESULTS = Path(__file__).resolve().parent / "results" / "selection.json"
SIZES = [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
# Short samples keep the two halves of a pair close in time (the load of other work changes fast).
SAMPLE_S = 0.005


def _data(rank, world_size, n_local, which=0):
    g = torch.Generator().manual_seed(rank + 1000 * which + 7 * n_local)
    values = ((torch.randn(n_local, generator=g).abs() * 3 * 1000).round() / 1000).float()
    keys = (torch.arange(n_local, dtype=torch.int64) * world_size + rank) * 2 + which
    return values, keys


def setup(rank, world_size, kind, radix_bits, gather_max, eager=None):
    """A world of ``kind`` in {ours, gather}; answers ``(op, n_local, two)`` commands."""
    from megatron_stare.ops.selection import topk_thresholds

    group = dist.group.WORLD
    cache = {}

    def ours(sets, k):
        kw = {}
        if radix_bits:
            kw = dict(radix_bits=radix_bits, gather_max=gather_max)
        if eager is not None:
            kw["eager"] = eager
        thrs = topk_thresholds([(v, kk, k) for v, kk in sets], group, **kw)
        return [t.select(v, kk) for t, (v, kk) in zip(thrs, sets)]

    def gather(sets, k):
        out = []
        for values, keys in sets:
            vs = [torch.empty_like(values) for _ in range(world_size)]
            ks = [torch.empty_like(keys) for _ in range(world_size)]
            dist.all_gather(vs, values, group=group)
            dist.all_gather(ks, keys, group=group)
            kth = torch.topk(torch.cat(vs), k).values[-1]
            out.append(values >= kth)
        return out

    fn = ours if kind == "ours" else gather

    def case(n_local, two):
        if (n_local, two) not in cache:
            sets = [_data(rank, world_size, n_local, w) for w in range(2 if two else 1)]
            k = (n_local * world_size) // 10
            cache[(n_local, two)] = lambda: fn(sets, k)
            cache[(n_local, two)]()  # warm-up
        return cache[(n_local, two)]

    def run(cmd):
        op, n_local, two, *inner = cmd
        call = case(n_local, two)
        if op in ("time", "calibrate"):
            # "calibrate": one call; "time": the mean of `inner` back-to-back calls, the same
            # count for every variant (a lone call right after the barrier is faster).
            count = inner[0] if op == "time" else 1
            dist.barrier()
            s = time.perf_counter()
            for _ in range(count):
                call()
            return (time.perf_counter() - s) / count
        if op == "selected":
            n = torch.tensor([int(m.sum()) for m in call()])
            dist.all_reduce(n)
            return n.tolist()
        if op == "bytes":
            return _count_bytes(call)
        if op == "phases":
            return _phases(call)
        raise ValueError(op)
    return run


def _phases(call, calls: int = 200) -> dict:
    """Median seconds per phase of one call over ``calls`` calls (barrier before each): the work
    before the first collective, the collectives (all-gathers and all-reduces), and the work
    after the last; plus the number of torch operators one call dispatches."""
    from torch.profiler import ProfilerActivity, profile

    marks = []
    real = {"all_gather": dist.all_gather, "all_reduce": dist.all_reduce}

    def timed(fn):
        def wrapper(*a, **kw):
            marks.append(time.perf_counter())
            out = fn(*a, **kw)
            marks.append(time.perf_counter())
            return out
        return wrapper

    spans = []
    dist.all_gather, dist.all_reduce = timed(real["all_gather"]), timed(real["all_reduce"])
    try:
        for _ in range(calls):
            marks.clear()
            dist.barrier()
            s = time.perf_counter()
            call()
            e = time.perf_counter()
            coll = sum(b - a for a, b in zip(marks[::2], marks[1::2]))
            spans.append((marks[0] - s, coll, e - marks[-1], e - s))
    finally:
        dist.all_gather, dist.all_reduce = real["all_gather"], real["all_reduce"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    n_ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    names = ("before_collective", "collectives", "after_collective", "total")
    return {**{n: statistics.median(x[i] for x in spans) for i, n in enumerate(names)},
            "aten_ops": n_ops}


def _count_bytes(call):
    """``(collectives, bytes received by this rank)`` of one call."""
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

    dist.all_reduce, dist.all_gather = counting_all_reduce, counting_all_gather
    try:
        call()
    finally:
        dist.all_reduce, dist.all_gather = real_all_reduce, real_all_gather
    return stats["calls"], stats["bytes"]


def _row(worlds, names, ws, n_local, two, args, reps_w) -> dict:
    """Time one size on the started worlds and print its line."""
    calib = interleaved_times(worlds, names, 3, cmd=("calibrate", n_local, two))
    inner = max(1, math.ceil(SAMPLE_S / min(min(ts) for ts in calib.values())))
    # Small sizes are cheap and the noisiest: three times the rounds.
    reps = args.repeats * (3 if n_local <= 1 << 14 else 1)
    t = interleaved_times(worlds, names, reps, cmd=("time", n_local, two, inner))
    ours = [x for i in range(reps_w) for x in t[f"ours#{i}"]]
    gather = [x for i in range(reps_w) for x in t[f"gather#{i}"]]
    sel = {n: worlds.ask(n, ("selected", n_local, two))[0] for n in ("ours#0", "gather#0")}
    n_calls, n_bytes = worlds.ask("ours#0", ("bytes", n_local, two))[0]
    row = {"world": ws, "n_local": n_local, "thresholds": 2 if two else 1,
           "gather_s": statistics.median(gather), "ours_s": statistics.median(ours),
           "ratio": paired_ratio(ours, gather), "ours_collectives": n_calls,
           "ours_bytes_in": n_bytes, "gather_bytes_in": n_local * ws * 12 * (2 if two else 1),
           "selected_ours": sel["ours#0"], "selected_gather": sel["gather#0"],
           "k": (n_local * ws) // 10}
    row["met"] = row["ratio"] <= 1.2
    if ws == 2 and not two and n_local <= args.phases:
        row["phases"] = {n: worlds.ask(n, ("phases", n_local, two))[0]
                         for n in ("ours#0", "gather#0")}
    if reps_w > 1:
        row["ratio ours-A/A"] = paired_ratio(t["ours#1"], t["ours#0"])
    for n in names[2 * reps_w :]:
        row[f"ratio {n}"] = paired_ratio(t[n], t["gather#0"])
    extra = "  ".join(f"{k[6:]} x{v:.2f}" for k, v in row.items() if k.startswith("ratio "))
    for n, ph in row.get("phases", {}).items():
        print(f"  phases {n:<8} " + "  ".join(
            f"{k} {v * 1e3:.3f} ms" if k != "aten_ops" else f"{v} aten ops"
            for k, v in ph.items()))
    print(f"world={ws} N_local={n_local:>8} thr={row['thresholds']}  ours "
          f"{row['ours_s'] * 1e3:8.2f} ms  gather {row['gather_s'] * 1e3:8.2f} ms  ours/gather "
          f"x{row['ratio']:5.2f} [{'met' if row['met'] else 'MISSED'}]  in/rank ours "
          f"{n_bytes / 1024:7.1f} KiB ({n_calls} coll.) vs {row['gather_bytes_in'] / 2 ** 20:7.2f}"
          f" MiB  selected {sel['ours#0']} (k={row['k']}) vs {sel['gather#0']}  {extra}",
          flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--replicas", type=int, default=2, help="worlds per variant (gather, ours); "
                    "with 2 or more, ours#1 / ours#0 (A/A) shows the noise of the measurement")
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--two", action="store_true", help="also time two thresholds (STARE C2)")
    ap.add_argument("--sweep", nargs="*", default=[], metavar="BITS:GATHER_MAX[:EAGER]",
                    help="also time ours with these radix_bits:gather_max[:eager] settings")
    ap.add_argument("--phases", type=int, default=1 << 14, metavar="N",
                    help="profile the phases of one call at world 2 up to N values per rank")
    ap.add_argument("--merge", action="store_true", help="replace only this run's rows (same "
                    "world, size and threshold count) in an existing --out file")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    print("exact top-k (ours) vs all_gather + torch.topk (gather); gloo, ranks share 2 CPU "
          f"cores; {args.repeats} interleaved rounds, each variant its own world of processes; "
          "ratio = median of ours/gather; k = 10% of N_global; fp32 values with many ties")
    sweeps = [tuple(int(x) for x in s.split(":")) for s in args.sweep]
    # Each of gather and ours runs in `--replicas` worlds; a world can stay slower than its
    # identical twin for a whole run on this shared machine, so pairs are (ours#i, gather#i) and
    # the ratio is the median over all of them; ours#1 / ours#0 (A/A) is the noise floor.
    reps_w = max(1, args.replicas)
    variants = [Variant(f"{kind}#{i}", setup, (kind, 0, 0))
                for i in range(reps_w) for kind in ("gather", "ours")]
    variants += [Variant(f"ours[{':'.join(map(str, sw))}]", setup, ("ours", *sw)) for sw in sweeps]
    names = [v.name for v in variants]
    record = {"machine": machine(), "repeats": args.repeats, "repeats_up_to_16k": 3 * args.repeats,
              "replica_worlds": reps_w, "goal": 1.2, "rows": []}
    for ws in args.worlds:
        worlds = start(variants, world_size=ws)
        try:
            for two in (False, True) if args.two else (False,):
                for n_local in args.sizes:
                    record["rows"].append(_row(worlds, names, ws, n_local, two, args, reps_w))
        finally:
            worlds.close()
    out = Path(args.out)
    if args.merge and out.exists():
        key = lambda r: (r["thresholds"], r["world"], r["n_local"])  # noqa: E731
        mine = {key(r) for r in record["rows"]}
        old = [r for r in json.loads(out.read_text())["rows"] if key(r) not in mine]
        record["rows"] = sorted(old + record["rows"], key=key)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
