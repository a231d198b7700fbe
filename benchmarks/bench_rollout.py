"""Rollout throughput (generated tokens/s) of the engines on the same prompts.

A random-init Qwen2-style checkpoint (``--hidden``, ``--layers``; built offline), ``--prompts``
prompts of ``--prompt-len / 2`` to ``--prompt-len`` tokens, ``--n`` samples each, exactly ``--new-tokens`` new tokens
per sample (``ignore_eos``), temperature 1. Each engine runs one warm-up call, then
``--repeats`` timed calls; prints the median seconds, tokens/s and the ratio to ``hf``.
Engines: ``hf`` (embedded transformers loop), ``vllm`` (colocated in-process), and with
``--server`` also ``vllm-server`` (HTTP; start-up not timed).

Usage: ``OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_rollout.py
[--engines hf vllm] [--prompts 16 --n 4 --new-tokens 64]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    ap.add_argument("--server", action="store_true", help="also time the vllm-server engine")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from megatron_stare.config.load import load_config
    from megatron_stare.rollout import EngineWorld, SamplingParams, engine_for_rank
    from megatron_stare.testing.hf_models import build_tiny_hf_model

    model = build_tiny_hf_model("qwen2", Path(tempfile.mkdtemp(prefix="bench_rollout_")) / "m",
                                hidden_size=args.hidden, num_layers=args.layers,
                                num_heads=args.hidden // 32, num_kv_heads=max(1, args.hidden // 64),
                                ffn_hidden_size=4 * args.hidden)
    g = torch.Generator().manual_seed(0)
    # Varied lengths in [prompt_len/2, prompt_len], as real prompts are (the hf engine batches
    # only equal-length prompts together; vLLM batches everything).
    lens = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,), generator=g)
    prompts = [torch.randint(3, 390, (int(n),), generator=g).tolist() for n in lens]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens,
                            ignore_eos=True, seed=0)
    engines = list(args.engines) + (["vllm-server"] if args.server else [])
    print(f"model: hidden {args.hidden}, {args.layers} layers (random init, fp32); "
          f"{args.prompts} prompts x {args.prompt_len // 2}-{args.prompt_len} tokens, n={args.n}, {args.new_tokens} new "
          f"tokens each; OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    rates = {}
    for name in engines:
        cfg = load_config(None, [f"model.path={model}", f"rollout.engine={name}",
                                 f"data.max_prompt_length={args.prompt_len}", f"rollout.max_new_tokens={args.new_tokens}"])
        _, eng = engine_for_rank(cfg, EngineWorld())  # as the trainer builds it
        try:
            eng.generate(prompts[:2], params)  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                res = eng.generate(prompts, params)
                times.append(time.perf_counter() - t0)
            tokens = sum(len(r.token_ids) for r in res)
        finally:
            eng.shutdown()
        t = statistics.median(times)
        rates[name] = tokens / t
        print(f"{name:12s} {t:8.2f} s  {rates[name]:9.1f} tokens/s  "
              f"x{rates[name] / rates.get('hf', rates[name]):.2f} vs hf")


if __name__ == "__main__":
    main()
