"""What a checkpoint save adds to a step's critical path: background (``checkpoint.async_save``)
against synchronous, with >= 1 GiB of state; and the write bandwidth.

One world (``--world`` gloo ranks, default 1) builds a Megatron actor (the tiny model's shape,
widened: ``--hidden``, ``--layers``) in bf16 with the distributed optimizer, fills Adam's moments,
and saves real training checkpoints (``checkpoint.save_checkpoint``: model, optimizer with fp32
main params and both moments, RNG, manifest) into ``--dir``. Each round, in shuffled order:

- ``sync``: the synchronous save; its wall time is all on the critical path;
- ``async``: the background save, then ``--step-s`` seconds of "next step" (fixed matmul work on
  this rank's thread), then the finalization (``BackgroundSaves.wait``). Its critical path is
  the time blocked in the save calls (start + finalize wait) **plus** how much longer the step's
  work took than the same work alone (``step`` below: the writers share the machine's cores);
- ``step``: the same work alone (the reference for that slowdown);
- ``async_write``: the background save waited for at once (its write time: the bandwidth).

The goal is judged on the median over rounds of ``async critical path / sync save time``
(<= 0.1). Bandwidth = checkpoint bytes / time of the save (sync) or of the write (async).

Usage: ``python benchmarks/bench_checkpoint.py [--world 1] [--hidden 1024] [--layers 6]
[--repeats 3] [--step-s 8] [--dir /tmp] [--json benchmarks/results/checkpoint.json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _work(seconds_hint: float, a: torch.Tensor) -> int:
    """Fixed matmul work sized once to about ``seconds_hint`` on an idle rank; returns how many."""
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds_hint:
        a = torch.tanh(a @ a)
        n += 1
    return n


def _bench(rank, world, root, hidden, layers, repeats, step_s, seed, distributed_optimizer=True):
    import torch.distributed as dist

    from megatron_stare.checkpoint.async_save import BackgroundSaves
    from megatron_stare.checkpoint.core import save_checkpoint
    from megatron_stare.checkpoint.dist_ckpt import _allocate_torch_adam_state
    from megatron_stare.testing.actor_case import build_case_actor, case_groups
    from megatron_stare.testing.megatron_tiny import TINY_SPEC

    torch.set_num_threads(1)
    spec = dataclasses.replace(TINY_SPEC, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_layers=layers,
                               num_attention_heads=16, num_query_groups=4, vocab_size=32000)
    groups = case_groups(world, 1, 1, distributed_optimizer=distributed_optimizer)
    actor, _ = build_case_actor(groups, dtype=torch.bfloat16, spec=spec)
    _allocate_torch_adam_state(actor.optimizer)
    g = torch.Generator().manual_seed(rank)
    for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = o.optimizer
        if not inner.state:  # Megatron's plain optimizer over torch Adam: its state as after a step
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                                      "step": torch.zeros((), dtype=torch.float32)}
        for state in inner.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.dim():
                    t.copy_(torch.rand(t.shape, generator=g))
    params = sum(p.numel() for p in actor.model.parameters())
    kw = dict(actor=actor, groups=groups, spec=spec, trainer_state={"step": 0}, keep_last=1)
    saves = BackgroundSaves(True)
    a = torch.rand(256, 256, generator=g) / 16
    iters = _work(step_s, a)  # the "next step": this many matmuls (sized once, then fixed)
    step = [0]

    def save(background=None):
        step[0] += 1
        return save_checkpoint(root, step[0], background=background, **kw)

    def sync():
        t0 = time.perf_counter()
        save()
        return {"save_s": time.perf_counter() - t0}

    def work():
        t0 = time.perf_counter()
        b = a
        for _ in range(iters):
            b = torch.tanh(b @ b)
        return time.perf_counter() - t0

    def asynchronous():
        t0 = time.perf_counter()
        save(saves)  # plan, small files, staging, fork: the part on the critical path
        started = time.perf_counter() - t0
        took = work()
        t0 = time.perf_counter()
        saves.wait()
        return {"start_s": started, "work_s": took, "finalize_s": time.perf_counter() - t0}

    def async_write():
        t0 = time.perf_counter()
        save(saves)
        saves.wait()
        return {"write_s": time.perf_counter() - t0}

    def alone():
        return {"work_s": work()}

    modes = {"sync": sync, "async": asynchronous, "step": alone, "async_write": async_write}
    save()  # warm-up (the writer Manager, first plans)
    rounds = []
    rng = random.Random(seed)
    for _ in range(repeats):
        order = list(modes)
        rng.shuffle(order)
        r = {}
        for name in order:
            dist.barrier()
            r[name] = modes[name]()
        rounds.append(r)
    d = sorted(Path(root).glob("step_*"))[-1]
    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    return {"rounds": rounds, "checkpoint_bytes": size, "params_per_rank": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-s", type=float, default=8.0, help="the next step's work, seconds (idle)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plain-optimizer", action="store_true",
                    help="Megatron's plain optimizer (state keyed by parameter) instead of the distributed one, "
                         "whose fully reshardable save gathers its state into model space first")
    args = ap.parse_args()
    from megatron_stare.testing.distributed import run_on_ranks

    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        res = run_on_ranks(_bench, args.world, d, args.hidden, args.layers, args.repeats, args.step_s, args.seed,
                           distributed_optimizer=not args.plain_optimizer)
    load1 = os.getloadavg()
    r0 = res[0]
    rows = []
    for i, rounds in enumerate(zip(*[r["rounds"] for r in res])):
        # The slowest rank decides a collective save; per round, the max over ranks.
        sync = max(x["sync"]["save_s"] for x in rounds)
        blocked = max(x["async"]["start_s"] + x["async"]["finalize_s"] for x in rounds)
        slowdown = max(x["async"]["work_s"] - x["step"]["work_s"] for x in rounds)
        write = max(x["async_write"]["write_s"] for x in rounds)
        rows.append({"sync_save_s": sync, "async_blocked_s": blocked, "async_step_slowdown_s": slowdown,
                     "async_critical_s": blocked + max(slowdown, 0.0), "async_write_s": write,
                     "step_alone_s": max(x["step"]["work_s"] for x in rounds),
                     "ratio": (blocked + max(slowdown, 0.0)) / sync, "ratio_blocked_only": blocked / sync})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    gib = r0["checkpoint_bytes"] / 2**30
    summary = {"checkpoint_gib": gib, "params_per_rank": r0["params_per_rank"], **med,
               "sync_bandwidth_mib_s": r0["checkpoint_bytes"] / 2**20 / med["sync_save_s"],
               "async_write_bandwidth_mib_s": r0["checkpoint_bytes"] / 2**20 / med["async_write_s"],
               "goal": "async critical path <= 0.1x the synchronous save",
               "met": med["ratio"] <= 0.1}
    out = {"benchmark": "checkpoint",
           "machine": {"torch": torch.__version__, "python": platform.python_version(), "cpu": platform.machine(),
                       "cores": os.cpu_count(), "threads_per_process": 1,
                       "load_average_before_after": [round(load0[0], 1), round(load1[0], 1)]},
           "args": vars(args), "summary": summary, "rounds": rows, "per_rank": [r["rounds"] for r in res]}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
