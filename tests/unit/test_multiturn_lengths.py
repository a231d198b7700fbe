"""Lengths with multi-turn: response metrics and DAPO overlong shaping count model tokens only
(the budget the policy controls); sequence budgets (config checks, the engine's context length)
hold the whole trajectory, observations included."""

import pytest
import torch

from megatron_stare.config.load import ConfigError, load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.data import Prompt
from megatron_stare.trainer.generation import GroupSelector, ScoredBatch, model_tokens
from megatron_stare.rollout.base import GenerationResult
from megatron_stare.rollout.multiturn import Trajectory
from megatron_stare.rollout.spec import EngineSpec, EngineWorld
from tests.unit.test_config_ranges import files  # noqa: F401  (the fixture: a tiny model config + data)

MT = ["rollout.multi_turn.env=calculator", "rollout.max_new_tokens=16", "rollout.multi_turn.max_turns=3",
      "rollout.multi_turn.max_total_tokens=100", "data.max_prompt_length=64"]


def _cfg(files, extra):
    return validate_config(load_config(None, files + list(extra)), world_size=1, cuda=False)


def test_budgets(files):
    single = _cfg(files, ["rollout.max_new_tokens=16", "data.max_prompt_length=64"])
    assert (single.rollout.max_response_tokens, single.rollout.max_model_tokens) == (16, 16)
    multi = _cfg(files, MT)
    assert multi.rollout.max_response_tokens == 100  # the whole trajectory
    assert multi.rollout.max_model_tokens == 3 * 16  # turns x new tokens, below max_total_tokens
    assert _cfg(files, MT + ["rollout.multi_turn.max_total_tokens=40"]).rollout.max_model_tokens == 40
    # The engine's context (vLLM's max_model_len, SGLang's context length) holds prompt + trajectory.
    assert EngineSpec.from_config(multi, EngineWorld()).context_length == 64 + 100
    assert EngineSpec.from_config(single, EngineWorld()).context_length == 64 + 16


def _error(files, extra) -> str:
    with pytest.raises(ConfigError) as info:
        _cfg(files, extra)
    return str(info.value)


def test_checks_use_the_trajectory_budget(files):
    # 164 tokens a sequence: a micro-batch budget that fits prompt + max_new_tokens does not.
    msg = _error(files, MT + ["parallel.micro_batch_tokens=100"])
    assert "data.max_prompt_length + rollout.multi_turn.max_total_tokens = 164" in msg
    _cfg(files, MT + ["parallel.micro_batch_tokens=164"])
    msg = _error(files, MT + ["rollout.multi_turn.max_total_tokens=5000"])
    assert "max_position_embeddings" in msg and "max_total_tokens" in msg
    # The overlong buffer is measured against the model-token budget (48 here), not max_new_tokens.
    _cfg(files, MT + ["reward.overlong_buffer_len=40"])
    assert "reward.overlong_buffer_len=48 must be below the model-token budget" in _error(
        files, MT + ["reward.overlong_buffer_len=48"])


def _traj(i, s, mask, finish):
    return Trajectory(i, s, list(range(len(mask))), torch.zeros(len(mask)), finish, loss_mask=mask)


def _without_observations(t: Trajectory) -> GenerationResult:
    keep = [k for k, m in enumerate(t.loss_mask) if m]
    return GenerationResult(t.prompt_index, t.sample_index, [t.token_ids[k] for k in keep],
                            t.logprobs[keep], t.finish_reason)


def test_selector_counts_model_tokens(files):
    """Shaped rewards and response metrics of trajectories equal those of the same responses
    with their observation tokens removed; num_tokens still counts every token."""
    cfg = _cfg(files, MT + ["reward.overlong_buffer_len=20", "trainer.prompts_per_step=1", "rollout.n=4"])
    m, o = [1] * 10, [0] * 30
    # The model-token budget is 48, the buffer 20: the penalty ramps from 0 at 28 model tokens.
    trajs = [_traj(0, 0, m + o + m, "stop"),            # 20 model tokens of 50: no penalty
             _traj(0, 1, m + o + m + o + m[:8], "stop"),  # 28 of 88: just at the buffer's start
             _traj(0, 2, m * 3 + o + m[:6], "length"),    # 36 of 66: 8 tokens into the buffer
             _traj(0, 3, m[:4], "stop")]
    assert [model_tokens(t) for t in trajs] == [20, 28, 36, 4]
    prompt = Prompt("p", "2", {}, "p", [1, 2], "test")

    def select(results):
        sel = GroupSelector(cfg)
        sel.add(ScoredBatch([prompt], results, [1.0, 1.0, 0.0, 1.0], 4))
        return sel.finish()

    (samples, stats), (ref_samples, ref_stats) = select(trajs), select([_without_observations(t) for t in trajs])
    rewards = [s.reward for s in samples]
    assert rewards == [s.reward for s in ref_samples]
    assert rewards == pytest.approx([1.0, 1.0 - (28 - 28) / 20, 0.0 - (36 - 28) / 20, 1.0])
    assert rewards[2] < 0  # counted on all 66 tokens it would be -(66 - 28) / 20
    for k in ("response/mean_length", "response/max_length", "response/truncated_frac"):
        assert stats.metrics()[k] == ref_stats.metrics()[k]
    assert stats.response_len_max == 36 and stats.truncated_frac == 0.25
    assert stats.num_tokens == sum(len(t.token_ids) for t in trajs) > ref_stats.num_tokens
