"""Partial rollouts (``rollout/partial.py``) on the real ``hf`` engine and real transformers.

A response that spans a weight update carries two policy versions, and each token's behaviour
log-prob is the one the weights of its version give (checked against a full transformers forward
of each version); cuts depend on token counts only, and a batch saved between segments continues
exactly.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_stare.rollout import SamplingParams, build_engine
from megatron_stare.rollout.engines.hf.engine import score_tokens
from megatron_stare.rollout.partial import SegmentedBatch
from megatron_stare.testing.hf_models import build_tiny_hf_model
from tests.unit.test_rollout_hf import stream_state_dict

PROMPTS = [[5, 6, 7, 8], [10, 11, 12], [20, 21, 22, 23, 24]]
INDICES = [3, 4, 5]  # the batch's prompt indices (a replica's slice need not start at 0)
SAMPLED = SamplingParams(n=2, temperature=0.8, max_new_tokens=8, ignore_eos=True, seed=7)
ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("partial_models")
    dirs = [build_tiny_hf_model("qwen2", root / name, seed=s) for name, s in (("A", 0), ("B", 1))]
    hf = [transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval() for d in dirs]
    return dirs, hf


@pytest.fixture()
def engine(models):
    eng = build_engine("hf", str(models[0][0]))
    yield eng
    eng.shutdown()


def _run(engine, models, schedule, segment=3, params=SAMPLED, stop_after=None):
    """Segments under ``schedule`` (one version per segment: 0 = model A, 1 = model B, the engine
    loaded accordingly); ``stop_after``: save the state after that many segments and go on in a
    fresh ``SegmentedBatch``."""
    dirs, _ = models
    batch, loaded = SegmentedBatch(PROMPTS, INDICES, params, segment), 0
    engine.update_weights(stream_state_dict(dirs[0]))
    for i, v in enumerate(schedule):
        if batch.finished:
            break
        if v != loaded:
            engine.update_weights(stream_state_dict(dirs[v]))
            loaded = v
        batch.advance(engine, v)
        if stop_after == i + 1:
            state = json.loads(json.dumps(batch.state_dict()))
            batch = SegmentedBatch(PROMPTS, INDICES, params, segment)
            batch.load_state_dict(state)
    return batch


def test_a_response_spanning_a_weight_update_carries_both_versions_and_their_logprobs(engine, models):
    _, hf = models
    batch = _run(engine, models, [0, 1, 1])
    assert batch.finished and batch.segments == 3
    results = batch.results()
    assert [(r.prompt_index, r.sample_index) for r in results] == [(p, s) for p in INDICES for s in range(2)]
    for r in results:
        assert len(r.token_ids) == 8 and r.versions == [0] * 3 + [1] * 5
        prompt = PROMPTS[INDICES.index(r.prompt_index)]
        under = [score_tokens(m, prompt, r.token_ids, temperature=SAMPLED.temperature) for m in hf]
        assert torch.allclose(r.logprobs[:3], under[0][:3], atol=ATOL)
        assert torch.allclose(r.logprobs[3:], under[1][3:], atol=ATOL)
        # The versions differ where it matters: B's log-probs of A's tokens are not A's.
        assert (under[0][:3] - under[1][:3]).abs().max() > 10 * ATOL


def test_first_segment_is_the_unsegmented_call_cut_and_the_schedule_fixes_the_tokens(engine, models):
    whole = engine.generate(PROMPTS, SAMPLED, prompt_indices=INDICES)
    once = _run(engine, models, [0, 1, 1]).results()
    assert [r.token_ids[:3] for r in once] == [r.token_ids[:3] for r in whole]
    again = _run(engine, models, [0, 1, 1]).results()
    assert [r.token_ids for r in again] == [r.token_ids for r in once]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(again, once))
    # Another schedule, other continuations (the versions are what the tokens depend on).
    other = _run(engine, models, [0, 0, 0]).results()
    assert all(r.versions == [0] * 8 for r in other)
    assert [r.token_ids for r in other] != [r.token_ids for r in once]


def test_a_batch_saved_between_segments_continues_exactly(engine, models):
    full = _run(engine, models, [0, 1, 1]).results()
    resumed = _run(engine, models, [0, 1, 1], stop_after=1).results()
    assert [(r.token_ids, r.versions, r.finish_reason) for r in resumed] == \
        [(r.token_ids, r.versions, r.finish_reason) for r in full]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(resumed, full))


def test_stopped_responses_are_not_continued_and_short_budgets_finish(engine, models):
    """Greedy with a stop token that one response meets at its 5th token: it ends there
    (``stop``, in segment 2) while the others run to ``max_new_tokens`` (``length``); a budget
    that is not a multiple of the segment asks only what is left."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True)
    ref = engine.generate(PROMPTS, greedy, prompt_indices=INDICES)
    stop = ref[0].token_ids[4]
    others_hit = [stop in r.token_ids for r in ref[1:]]
    params = SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True, stop_token_ids=(stop,))
    batch = _run(engine, models, [0, 0, 0, 0], params=params)
    if not all(others_hit):
        assert batch.segments == 3  # 3 + 3 + 1 tokens, then finished
    r0 = batch.results()[0]
    assert r0.token_ids == ref[0].token_ids[:ref[0].token_ids.index(stop) + 1] and r0.finish_reason == "stop"
    for r, hit in zip(batch.results()[1:], others_hit):
        if not hit:
            assert (len(r.token_ids), r.finish_reason) == (7, "length")


def test_misuse_is_refused(engine):
    with pytest.raises(ValueError, match="segment_tokens"):
        SegmentedBatch(PROMPTS, INDICES, SAMPLED, 0)
    batch = SegmentedBatch(PROMPTS, INDICES, SAMPLED, 3)
    with pytest.raises(RuntimeError, match="before every response finished"):
        batch.results()
