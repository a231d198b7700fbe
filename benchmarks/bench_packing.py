"""Packed against padded micro-batches on a long-tail length distribution, and the torch
attention's peak memory on a 16k-token row.

Setup: one process (gloo world of 1), the tiny Qwen2-style test model with the torch attention,
``--num`` sequences whose lengths are lognormal (median ``--median``, sigma ``--sigma``) clipped
to [``--min-len``, ``--max-len``], micro-batches within ``--budget`` tokens. The same samples go
through two actors that differ only in ``parallel.pack_sequences``:

- tokens computed: the sum over micro-batches of what the model runs on (padded: rows x
  longest; packed: the packed row), against the real tokens; and the (query, key) pairs causal
  attention computes (quadratic: the long tail's sequences, alone in their micro-batches either
  way, dominate it, so packing saves less attention than tokens);
- the log-prob pass's wall time (``actor.compute_logprobs``, forward only, with the sensitivity
  sums as in training), ``--repeats`` times each, interleaved packed/padded; medians and the
  padded/packed ratio.

Attention memory (``--no-memory`` skips it): in a fresh subprocess each, forward and backward of
``block_attention`` over one ``--max-len`` sequence (whole, and as the second chunk pair of a
CP2 split, which needs mask tiles), 4 query heads over 2 KV heads of 16: the peak RSS growth,
against the size of the dense fp32 scores a plain implementation would make.

Prints the figures side by side; ``--out FILE`` also writes them as JSON. Usage:
``OMP_NUM_THREADS=1 python benchmarks/bench_packing.py [--num 64] [--max-len 16384] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

def long_tail_samples(num: int, median: float, sigma: float, lo: int, hi: int, vocab: int, seed: int = 0):
    """``num`` samples whose token counts are lognormal(log median, sigma) clipped to [lo, hi]."""
    from megatron_stare.types import Sample

    rng = random.Random(seed)
    out = []
    for i in range(num):
        n = int(min(max(math.exp(rng.gauss(math.log(median), sigma)), lo), hi))
        prompt = rng.randint(16, min(128, n // 2))
        ids = [rng.randrange(vocab) for _ in range(n)]
        out.append(Sample(sample_id=i, group_id=i // 8, prompt_ids=ids[:prompt], response_ids=ids[prompt:],
                          reward=float(i % 2), advantage=1.0 if i % 2 else -1.0))
    return out


def causal_pairs(mb) -> int:
    """(query, key) pairs causal attention computes for a micro-batch: per slot of a packed row,
    per row of padded ones."""
    lens = mb.packed.slot_lens if mb.packed is not None else [mb.shape[1]] * mb.shape[0]
    return sum(n * (n + 1) // 2 for n in lens)


def logprob_benchmark(args) -> dict:
    from megatron_stare.testing.actor_case import build_case_actor, case_groups
    from megatron_stare.testing.megatron_tiny import TINY_SPEC

    groups = case_groups(1, 1, 1)
    samples = long_tail_samples(args.num, args.median, args.sigma, args.min_len, args.max_len,
                                TINY_SPEC.vocab_size)
    modes = {}
    for name, pack in (("packed", True), ("padded", False)):
        actor, _ = build_case_actor(groups, pack_sequences=pack, micro_batch_tokens=args.budget)
        batches = actor.prepare(samples)
        flat = [mb for mini in batches for mb in mini]
        modes[name] = {"actor": actor, "batches": batches, "micro_batches": len(flat),
                       "tokens": sum(mb.model_shape[0] * mb.model_shape[1] for mb in flat),
                       "attention_pairs": sum(causal_pairs(mb) for mb in flat), "seconds": []}
    for _ in range(args.repeats):
        for name, m in modes.items():  # interleaved: load changes hit both modes alike
            t0 = time.perf_counter()
            m["actor"].compute_logprobs(m["batches"])
            m["seconds"].append(time.perf_counter() - t0)
    real = sum(s.num_tokens - 1 for s in samples)
    out = {name: {k: m[k] for k in ("micro_batches", "tokens", "attention_pairs", "seconds")}
           for name, m in modes.items()}
    for m in out.values():
        m["median_s"] = statistics.median(m["seconds"])
    lengths = sorted(s.num_tokens for s in samples)
    out["real_tokens"] = real
    out["lengths"] = {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]}
    out["tokens_ratio_padded_over_packed"] = out["padded"]["tokens"] / out["packed"]["tokens"]
    out["attention_ratio_padded_over_packed"] = out["padded"]["attention_pairs"] / out["packed"]["attention_pairs"]
    out["time_ratio_padded_over_packed"] = out["padded"]["median_s"] / out["packed"]["median_s"]
    return out


MEMORY_PROBE = """
import sys, time, torch
from megatron_stare.models.torch_attention import SegmentLayout, block_attention
def status(key):  # kB from /proc/self/status
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
torch.set_num_threads(1)
L, cp, rank = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
layout = SegmentLayout((L,), cp, rank)
q = torch.randn(layout.local_tokens, 4, 16, requires_grad=True)
k, v = (torch.randn(L, 2, 16, requires_grad=True) for _ in range(2))
open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from now
before = status("VmRSS:")
t0 = time.perf_counter()
block_attention(q, k, v, layout, scale=0.25).sum().backward()
print((status("VmHWM:") - before) / 1024, time.perf_counter() - t0)
"""


def memory_benchmark(length: int) -> dict:
    out = {"length": length, "heads": 4, "kv_heads": 2, "head_dim": 16,
           "dense_scores_mib": 4 * length * length * 4 / 2 ** 20}
    for name, cp, rank in (("whole_row", 1, 0), ("cp2_rank1", 2, 1)):
        res = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(length), str(cp), str(rank)],
                             capture_output=True, text=True, check=True)
        peak, seconds = res.stdout.split()
        out[name] = {"peak_rss_growth_mib": float(peak), "fwd_bwd_s": float(seconds)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--median", type=float, default=1200.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--max-len", type=int, default=16384)
    p.add_argument("--budget", type=int, default=16384, help="micro-batch token budget")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    result = {"config": vars(args), "logprob_pass": logprob_benchmark(args)}
    lp = result["logprob_pass"]
    print(f"{args.num} sequences, lengths {lp['lengths']}, {lp['real_tokens']} real tokens, budget {args.budget}")
    for name in ("packed", "padded"):
        m = lp[name]
        print(f"  {name:7s} {m['micro_batches']:3d} micro-batches, {m['tokens']:7d} tokens computed, "
              f"{m['attention_pairs'] / 1e6:7.1f} M attention pairs, "
              f"log-prob pass median {m['median_s']:.2f} s {['%.2f' % s for s in m['seconds']]}")
    print(f"  padded/packed: tokens {lp['tokens_ratio_padded_over_packed']:.2f}x, "
          f"attention pairs {lp['attention_ratio_padded_over_packed']:.2f}x, "
          f"log-prob pass time {lp['time_ratio_padded_over_packed']:.2f}x")
    if not args.no_memory:
        mem = result["attention_memory"] = memory_benchmark(args.max_len)
        print(f"attention at {mem['length']} tokens (fwd+bwd): peak RSS growth "
              f"{mem['whole_row']['peak_rss_growth_mib']:.0f} MiB whole row, "
              f"{mem['cp2_rank1']['peak_rss_growth_mib']:.0f} MiB as a CP2 chunk; "
              f"dense fp32 scores would be {mem['dense_scores_mib']:.0f} MiB")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
