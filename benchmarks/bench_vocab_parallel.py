"""Time and peak memory of the chunked vocab-parallel log-prob/entropy against the naive path.

Naive = what most RL trainers do: upcast the whole logit shard to fp32, ``log_softmax``, gather the
target, entropy from the full fp32 probabilities. Ours = ``vocab_parallel_logprobs_entropy`` (and
``fused_linear_logprobs_entropy``, which never builds the logits). Each row runs forward + backward
on one CPU thread (tp_group=None: a single shard, so no communication is timed) and prints:

- time: median of ``--repeats`` runs after one warm-up, and the ratio naive / ours (> 1: faster);
- peak: the peak of live torch CPU allocations during forward + backward above what existed before
  (inputs excluded), read from ``torch.profiler``'s allocator events (profile_memory=True), and the
  ratio naive / ours (> 1: less memory). The ``[T, V/tp]`` logits gradient, which both must
  produce, is included; ``saved`` is the bytes of new tensors saved for backward (tensors the caller
  already holds, such as the logits themselves, are not counted), from saved_tensors_hooks;
- bandwidth: minimal bytes (read logits forward, read logits + write grad backward = 3 x logits)
  per second, as a fraction of a plain tensor copy of the logits (2 x logits bytes per copy).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_vocab_parallel.py [--repeats 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._C._profiler as _P
from torch.profiler import ProfilerActivity, profile

from megatron_stare.ops.fused_linear import fused_linear_logprobs_entropy
from megatron_stare.ops.vocab_parallel import vocab_parallel_logprobs_entropy


def naive_logits(x, t, entropy_grad):
    lp = torch.log_softmax(x.float(), -1)
    logp = lp.gather(1, t[:, None]).squeeze(1)
    if entropy_grad:
        ent = -(lp.exp() * lp).sum(-1)
    else:
        with torch.no_grad():
            ent = -(lp.exp() * lp).sum(-1)
    return logp, ent


def ours_logits(x, t, entropy_grad):
    out = vocab_parallel_logprobs_entropy(x, t, entropy_grad=entropy_grad, chunk_size=1024)
    return out.logprobs, out.entropy


def naive_linear(h, w, t, entropy_grad):
    return naive_logits(h @ w.T, t, entropy_grad)


def ours_linear(h, w, t, entropy_grad):
    out = fused_linear_logprobs_entropy(h, w, t, entropy_grad=entropy_grad, chunk_size=512,
                                        vocab_chunk_size=4096)
    return out.logprobs, out.entropy


def step(fn, inputs, t, entropy_grad, g):
    logp, ent = fn(*inputs, t, entropy_grad)
    loss = (logp * g).sum() + ((ent * g).sum() if entropy_grad else 0.0)
    grads = torch.autograd.grad(loss, inputs)
    return grads


def time_median(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        s = time.perf_counter()
        fn()
        times.append(time.perf_counter() - s)
    return statistics.median(times)


def _walk(node, out):
    out.append(node)
    for c in node.children:
        _walk(c, out)


def peak_bytes(fn):
    """Peak of live torch CPU allocations while ``fn`` runs, above the level at its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    nodes = []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        _walk(root, nodes)
    allocs = sorted((n for n in nodes if n.tag == _P._EventType.Allocation),
                    key=lambda n: n.start_time_ns)
    cur = peak = 0
    for n in allocs:
        cur += n.extra_fields.alloc_size
        peak = max(peak, cur)
    return peak


def saved_bytes(fn, inputs):
    seen = {t.data_ptr() for t in inputs}  # held by the caller anyway; each storage once
    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def copy_seconds(x, repeats):
    dst = torch.empty_like(x)
    return time_median(lambda: dst.copy_(x), repeats)


def run_row(name, naive, ours, inputs, t, entropy_grad, repeats, logits_bytes):
    g = torch.randn(t.shape[0])
    res = {}
    for label, fn in (("naive", naive), ("ours", ours)):
        call = lambda fn=fn: step(fn, inputs, t, entropy_grad, g)  # noqa: E731
        res[label] = (time_median(call, repeats), peak_bytes(call),
                      saved_bytes(lambda fn=fn: fn(*inputs, t, entropy_grad), inputs))
    (tn, pn, sn), (to, po, so) = res["naive"], res["ours"]
    mb = 2 ** 20
    line = (f"{name:<44} time {tn:6.3f}s vs {to:6.3f}s (x{tn / to:4.2f})  "
            f"peak {pn / mb:7.1f} vs {po / mb:7.1f} MiB (x{pn / po:4.2f})  "
            f"saved {sn / mb:6.1f} MiB vs {so / 1024:5.1f} KiB")
    if logits_bytes:
        tc = copy_seconds(inputs[0], repeats)
        copy_bw = 2 * logits_bytes / tc
        ours_bw = 3 * logits_bytes / to
        line += (f"  bw {ours_bw / 1e9:5.2f} GB/s = {ours_bw / copy_bw:4.2f} x copy "
                 f"({copy_bw / 1e9:4.1f} GB/s)")
    print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    div = 8 if args.quick else 1
    print(f"torch {torch.__version__}, 1 CPU thread, forward+backward, median of {args.repeats}; "
          "'A vs B' = naive vs ours, (xR) = naive/ours")
    print("peak memory: torch.profiler allocator events (live bytes above the start level, "
          "includes the logits gradient);\nsaved: new bytes saved for backward "
          "(saved_tensors_hooks; caller-held inputs not counted)")
    rows = [
        ("logits bf16 T=2048 V=32768 H-metric", 2048, 32768, torch.bfloat16, False),
        ("logits bf16 T=2048 V=32768 H-grad", 2048, 32768, torch.bfloat16, True),
        ("logits fp32 T=2048 V=32768 H-metric", 2048, 32768, torch.float32, False),
        ("logits bf16 T=2048 V/tp=152064/8 H-metric", 2048, 152064 // 8, torch.bfloat16, False),
        ("logits bf16 T=512 V=152064 (tp=1) H-metric", 512, 152064, torch.bfloat16, False),
    ]
    for name, T, V, dtype, eg in rows:
        T = T // div
        x = (torch.randn(T, V) * 2).to(dtype).requires_grad_()
        t = torch.randint(0, V, (T,))
        run_row(name, naive_logits, ours_logits, (x,), t, eg, args.repeats,
                x.numel() * x.element_size())
        del x
    # The no-logits path: the naive side builds the fp32 logits with a matmul first.
    T, V, H = 512 // div, 32768, 256
    h = torch.randn(T, H).requires_grad_()
    w = (torch.randn(V, H) / H ** 0.5).requires_grad_()
    t = torch.randint(0, V, (T,))
    run_row(f"fused fp32 T={T} h={H} V=32768 H-metric", naive_linear, ours_linear, (h, w), t,
            False, args.repeats, 0)


if __name__ == "__main__":
    main()
