"""One AdamW step over SmolLM2-135M's parameters: torch's per-tensor loop (megatron-core's
CPU fallback before ``optimizer.fused_adam``), ``foreach``, and the fused kernel (the default now).

The parameters are SmolLM2-135M-Instruct's 182 fp32 tensors (shapes from the fetched model's
``config.json``, values random), with gradients and Adam state; one thread, as each trainer rank
runs. Each round steps every variant once, in a shuffled order; printed: the median seconds per
step and each variant's ratio to the loop, and the largest difference of the fused and foreach
results from the loop's after the same steps (the same update up to float rounding).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_adam_step.py [--rounds 5] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

VARIANTS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def param_shapes(model_dir: Path):
    """The model's parameter shapes (tied embedding once), built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return [tuple(p.shape) for p in model.parameters()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", type=Path, default=None, help="HF model directory (default: the fetched SmolLM2)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.model is None:
        from megatron_stare.models.fetch import fetch

        args.model = Path(fetch("smollm2-135m-instruct", quiet=True))
    shapes = param_shapes(args.model)
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    opts, params = {}, {}
    for name, kw in VARIANTS.items():
        params[name] = [torch.nn.Parameter(t.clone()) for t in init]
        for p, g in zip(params[name], grads):
            p.grad = g
        opts[name] = torch.optim.AdamW(params[name], lr=1e-4, weight_decay=0.01, **kw)
    times = {n: [] for n in VARIANTS}
    order = random.Random(0)
    for r in range(args.rounds + 1):  # round 0 allocates the state: not counted
        for name in order.sample(list(VARIANTS), len(VARIANTS)):
            t0 = time.perf_counter()
            opts[name].step()
            if r:
                times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    diff = {n: max((a - b).abs().max().item() for a, b in zip(params[n], params["loop"])) for n in VARIANTS}
    n_params = sum(t.numel() for t in init)
    print(f"AdamW step over {len(shapes)} tensors ({n_params / 1e6:.1f}M fp32), 1 thread, median of {args.rounds}:")
    for n in VARIANTS:
        print(f"  {n:8s} {med[n]:7.3f} s  ({med['loop'] / med[n]:5.1f}x the loop)  max |diff| from the loop "
              f"after {args.rounds + 1} steps: {diff[n]:.2e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"tensors": len(shapes), "params": n_params, "threads": 1,
                                         "rounds": args.rounds, "median_s": med, "steps_s": times,
                                         "speedup_over_loop": {n: med["loop"] / med[n] for n in VARIANTS},
                                         "max_abs_diff_from_loop": diff, "torch": torch.__version__}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
