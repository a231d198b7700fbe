"""Multi-turn rollouts on token ids through the ``hf`` engine: the trainer's token ids are exactly
what crossed the engine's and the environment's boundaries (a recorded trace, not text), the
loss mask marks the model's tokens, the turn / token limits, seeds, and the per-step metrics."""

from __future__ import annotations

from typing import List

import pytest
import torch

from megatron_stare.actor.batching import collate
from megatron_stare.rollout import SamplingParams
from megatron_stare.rollout.engines.hf.engine import HFEngine
from megatron_stare.rollout.multiturn import MultiTurnLimits, Trajectory, generate_multiturn, multiturn_metrics
from megatron_stare.testing.envs import EchoToolEnv, TracedEngine, traced_env
from megatron_stare.testing.hf_models import build_tiny_hf_model
from megatron_stare.types import Sample

PROMPTS = [[5, 6, 7, 8], [10, 11, 12], [20, 21, 22, 23, 24]]
TURN = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = build_tiny_hf_model("qwen2", tmp_path_factory.mktemp("mt") / "m")
    return HFEngine(str(d), device="cpu")


def run_traced(engine, prompts, params, limits, done_after=3):
    """Trajectories plus the engine trace and each trajectory's environment trace."""
    traced = TracedEngine(engine)
    env_traces: List[list] = []

    def new_env(p):
        trace: list = []
        env_traces.append(trace)
        env = traced_env(EchoToolEnv(done_after=done_after), trace)
        env.reset(prompts[p])
        return env

    return generate_multiturn(traced, prompts, params, limits, new_env), traced.calls, env_traces


def engine_turns(calls):
    """Row id -> ``[(context, token_ids, logprobs)]``: each model turn as the engine's boundary
    saw it, in call order, keyed by the row id the engine was called with."""
    outs = {}
    for contexts, rows, results in calls:
        for ctx, r, (toks, lps) in zip(contexts, rows, results):
            outs.setdefault(r, []).append((ctx, toks, lps))
    return outs


def test_token_ids_are_exactly_the_boundary_trace(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=3, n=2)
    trajs, calls, env_traces = run_traced(engine, PROMPTS, params, MultiTurnLimits(max_turns=5, max_total_tokens=64))
    assert len(trajs) == len(PROMPTS) * 2 and all(isinstance(t, Trajectory) for t in trajs)
    turns = engine_turns(calls)
    # env_traces are in creation order: prompt-major, sample-minor, the rows' order.
    for i, t in enumerate(trajs):
        p, s = divmod(i, 2)
        row = p * 2 + s
        assert (t.prompt_index, t.sample_index) == (p, s)
        expect, mask, lps = [], [], []
        env_trace = env_traces[i]
        assert len(turns[row]) == len(env_trace) == t.turns == 3
        for k, ((ctx, toks, lp), (seen_turn, obs, done)) in enumerate(zip(turns[row], env_trace)):
            assert ctx == PROMPTS[p] + expect  # every turn continues the exact token context
            assert seen_turn == toks  # the environment got the sampled tokens as they are
            expect += toks + ([] if done else obs)
            mask += [1] * len(toks) + ([] if done else [0] * len(obs))
            lps += lp.tolist() + ([] if done else [0.0] * len(obs))
        assert t.token_ids == expect and t.loss_mask == mask and t.logprobs.tolist() == lps
        assert (t.finish_reason, t.env_reward, t.tool_calls, t.tool_errors) == ("stop", 1.0, 2, 1)
        # ... and so does what the trainer runs on: the sample's row and its loss mask.
        sample = Sample(sample_id=i, group_id=p, prompt_ids=list(PROMPTS[p]), response_ids=t.token_ids,
                        loss_mask=t.loss_mask)
        mb = collate([sample])
        P = len(PROMPTS[p])
        assert mb.input_ids[0].tolist() + [mb.targets[0, -1].item()] == PROMPTS[p] + expect
        assert mb.loss_mask[0, P - 1:].long().tolist() == mask and not mb.loss_mask[0, :P - 1].any()
        assert (mb.token_keys[0][~mb.loss_mask[0]] == 0).all()  # masked targets have no key


def test_limits_turns_and_total_tokens(engine):
    trajs, *_ = run_traced(engine, PROMPTS, TURN, MultiTurnLimits(max_turns=2, max_total_tokens=64), done_after=9)
    for t in trajs:  # out of turns: no trailing observation, ended "length"
        assert (t.turns, t.finish_reason, len(t.token_ids), sum(t.loss_mask)) == (2, "length", 4 + 3 + 4, 8)
    trajs, calls, _ = run_traced(engine, PROMPTS, TURN, MultiTurnLimits(max_turns=9, max_total_tokens=9),
                                 done_after=9)
    for t in trajs:  # 4 model + 3 obs + 2 model (the last turn's budget is what is left)
        assert (len(t.token_ids), t.loss_mask, t.finish_reason) == (9, [1] * 4 + [0] * 3 + [1] * 2, "length")
    assert [c[2][0][0].__len__() for c in calls] == [4, 2]
    # An observation is cut to the budget.
    trajs, *_ = run_traced(engine, PROMPTS, TURN, MultiTurnLimits(max_turns=9, max_total_tokens=6), done_after=9)
    assert all((t.loss_mask, t.turns) == ([1] * 4 + [0] * 2, 1) for t in trajs)


def test_greedy_matches_single_sequence_generation(engine):
    """Greedy multi-turn == the engine continued by hand, one row at a time."""
    trajs, *_ = run_traced(engine, PROMPTS, TURN, MultiTurnLimits(max_turns=3, max_total_tokens=64))
    for p, t in enumerate(trajs):
        env, ctx = EchoToolEnv(), list(PROMPTS[p])
        for _ in range(3):
            toks = engine.generate([ctx], TURN)[0].token_ids
            step = env.step(toks)
            ctx += toks + ([] if step.done else step.observation)
            if step.done:
                break
        assert ctx[len(PROMPTS[p]):] == t.token_ids


def test_seeded_rollouts_repeat_and_do_not_depend_on_batching(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=11, n=2)
    limits = MultiTurnLimits(max_turns=3, max_total_tokens=64)
    a, *_ = run_traced(engine, PROMPTS, params, limits)
    b, *_ = run_traced(engine, PROMPTS, params, limits)
    alone, *_ = run_traced(engine, PROMPTS[1:2], params, limits)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    # Prompt 1 alone, at its batch index: the same trajectories.
    generate = generate_multiturn(TracedEngine(engine), PROMPTS[1:2], params, limits,
                                  lambda p: EchoToolEnv(), prompt_indices=[1])
    assert [t.token_ids for t in generate] == [t.token_ids for t in a[2:4]]
    assert [t.token_ids for t in alone] != [t.token_ids for t in a[2:4]]  # index 0's stream differs


def test_metrics():
    def traj(mask, turns, calls, errors):
        return Trajectory(0, 0, list(range(len(mask))), torch.zeros(len(mask)), "stop", loss_mask=mask,
                          turns=turns, tool_calls=calls, tool_errors=errors)

    m = multiturn_metrics([traj([1, 1, 0, 1], 2, 1, 0), traj([1, 0, 0, 1, 1, 1], 3, 2, 1)])
    assert m == {"multiturn/turns_mean": 2.5, "multiturn/tool_calls_mean": 1.5,
                 "multiturn/tool_success_rate": 2 / 3, "multiturn/trained_token_frac": 7 / 10}
    with pytest.raises(ValueError, match="loss mask of 1"):
        traj([1], 1, 0, 0).__class__(0, 0, [1, 2], torch.zeros(2), "stop", loss_mask=[1])


def assert_multiturn_matches_hf(eng, model_dir, atol: float = 1e-4) -> None:
    """Greedy multi-turn trajectories of ``eng`` (serving ``model_dir``'s weights) == the hf
    engine's: the same token ids, masks, turns and ends; log-probs within ``atol``. Turns end
    at the budget or at an EOS (not ignored), so stops are exercised where the model emits one."""
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    limits = MultiTurnLimits(max_turns=4, max_total_tokens=40)
    ref, *_ = run_traced(HFEngine(str(model_dir), device="cpu"), PROMPTS, params, limits, done_after=4)
    got, calls, _ = run_traced(eng, PROMPTS, params, limits, done_after=4)
    assert len(calls) >= 3  # really multi-turn on this engine
    for r, g in zip(ref, got):
        assert (g.token_ids, g.loss_mask, g.turns, g.finish_reason) == (r.token_ids, r.loss_mask, r.turns,
                                                                        r.finish_reason)
        assert torch.allclose(g.logprobs, r.logprobs, atol=atol, rtol=0)
