"""The reward contract (rewards/contract.py): verl keyword calls, the positional call, return
values (number, bool, dict with extras), refused signatures, reward.by_source routing - inline and
in RewardPool worker processes - and the extras' step metrics."""

import pytest
import torch

from megatron_stare.config.load import Config, RewardConfig
from megatron_stare.data import Prompt
from megatron_stare.trainer.generation import GroupSelector, ScoredBatch
from megatron_stare.rewards import RewardError, RewardPool, bind_reward, check_reward_config, normalize_return
from megatron_stare.rollout.base import GenerationResult
from tests.unit._contract_rewards import (Scorer, ground_truth_type, numpy_score, only_kwargs, positional, verl_four,
                                          verl_gsm8k, verl_kwargs, verl_math_verify)

ME = "tests.unit._contract_rewards"  # light: the pool's worker processes import it
META = {"data_source": "my_math", "extra_info": {"index": 3, "split": "train"}, "ability": "math"}


def test_keyword_calls_get_verls_arguments():
    assert bind_reward(verl_four)("7", "7", META) == {"score": 1.0, "acc": True, "pred": "7", "index": 3,
                                                      "src_len": 7}
    assert bind_reward(verl_four).keywords == ("data_source", "solution_str", "ground_truth", "extra_info")
    assert bind_reward(verl_gsm8k).keywords == ("solution_str", "ground_truth")
    assert bind_reward(verl_gsm8k)("so 42", "42", META) == 1.0
    assert bind_reward(verl_kwargs)("a", "b", META) is True
    assert bind_reward(only_kwargs)("a", "b", {}) == 1.0  # **kwargs only: all four, None where absent
    assert bind_reward(Scorer())("a", "b", {}) == 2.0  # a callable instance
    assert bind_reward(ground_truth_type)("a", 42, {})["is_int"]  # the answer as the row gave it
    # verl's math_verify.compute_score(model_output, ground_truth, timeout_score=0): the response first.
    assert (bind_reward(verl_math_verify).keywords, bind_reward(verl_math_verify).response_first) == \
        (("ground_truth",), True)
    assert normalize_return(bind_reward(verl_math_verify)("so 42", "42", META)) == (1.0, {"acc": 1.0})
    assert normalize_return(bind_reward(numpy_score)("x", "1", META)) == (0.5, {})  # numpy scalars are numbers


def test_positional_call_as_the_builtins():
    assert bind_reward(positional).keywords is None
    assert bind_reward(positional)("x", "x", META) == 1.75
    assert bind_reward(lambda r, a, m=None: float(a == "42"))("x", 42, {}) == 1.0  # positional answers are str
    assert bind_reward(lambda *args: len(args))("x", "y", {}) == 3


@pytest.mark.parametrize("fn, why", [
    (lambda data_source, solution_str, ground_truth, extra_info, tokenizer: 0.0, "it also requires tokenizer (give them defaults)"),
    (lambda data_source, response, answer: 0.0, "it also requires response, answer (give them defaults)"),
    (lambda data_source, ground_truth: 0.0, "it never receives the response (add a solution_str parameter)"),
    (lambda response, answer: 0.0, "rename its parameters to verl's or take three positional ones"),
    (lambda a, b, c, d: 0.0, "rename its parameters to verl's or take three positional ones"),
    (lambda a, b, c, *, strict: 0.0, "it requires the keywords strict"),
], ids=["extra_required", "mixed_names", "no_solution", "two_positional", "four_positional", "required_kwonly"])
def test_signatures_neither_call_fits_are_refused(fn, why):
    with pytest.raises(RewardError) as e:
        bind_reward(fn, "reward.fn", "pkg.mod:fn")
    msg = str(e.value)
    assert msg.startswith("reward.fn: 'pkg.mod:fn'(") and msg.endswith(why) and "\n" not in msg
    assert "fits neither reward call: verl's keywords (data_source, solution_str, ground_truth, extra_info) " \
           "nor (response, answer, metadata)" in msg


def test_return_values():
    assert normalize_return(1) == (1.0, {}) and normalize_return(True) == (1.0, {})
    assert normalize_return(False) == (0.0, {})
    assert normalize_return({"score": 0.5, "acc": True, "pred": "7", "n": float("nan"), "len": 3}) == \
        (0.5, {"acc": 1.0, "len": 3.0})
    for bad, why in [(None, "returned None (NoneType), not a finite number"), (float("inf"), "returned inf"),
                     ({"acc": 1}, "returned a dict without a 'score' key (keys: acc)"),
                     ({"score": "1"}, "returned '1' (str)")]:
        with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
            normalize_return(bad)


def test_check_reward_config_names_the_field():
    check_reward_config(RewardConfig(fn="math", by_source={"a": "exact_match", "b": f"{ME}:verl_four"}))
    for cfg, msg in [
        (RewardConfig(fn=f"{ME}:Scorer"), f"reward.fn: '{ME}:Scorer'"),  # a class: called as Scorer(r, a, m)
        (RewardConfig(by_source={"code": "nope.mod:fn"}), "reward.by_source.code: cannot import 'nope.mod:fn'"),
        (RewardConfig(by_source={"code": "nosuch"}), "reward.by_source.code: unknown reward 'nosuch'"),
        (RewardConfig(by_source={"code": f"{ME}:returns_none", "x": "json:dumps"}),
         "reward.by_source.x: 'json:dumps'"),
    ]:
        with pytest.raises(RewardError) as e:
            check_reward_config(cfg)
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("workers", [0, 1], ids=["inline", "worker"])
def test_pool_routes_by_source_and_returns_extras(workers):
    cfg = RewardConfig(fn=f"{ME}:positional", by_source={"my_math": f"{ME}:verl_four", "gsm": f"{ME}:verl_gsm8k"},
                       num_workers=workers, timeout_s=30)
    responses = ["7", "x", "so 12", "so 13"]
    answers = ["7", "x", "12", "12"]
    metas = [META, {"data_source": "else"}, {"data_source": "gsm"}, {"data_source": "gsm"}]
    with RewardPool(cfg) as pool:
        fut = pool.submit(responses, answers, metas)
        assert fut.result(timeout=120) == [1.0, 1.25, 1.0, 0.0]
        assert fut.extras() == [{"acc": 1.0, "index": 3.0, "src_len": 7.0}, {}, {}, {}]
        assert pool.score(["a"], ["a"], [{"data_source": "none"}]) == [1.25]  # no route: reward.fn
    with RewardPool(RewardConfig(fn=f"{ME}:returns_none", num_workers=workers)) as pool:
        with pytest.raises(RewardError, match=f"reward: {ME}:returns_none failed on response 0: returned None"):
            pool.score(["a"], ["a"], [{}])


def test_extras_are_logged_as_step_means():
    """Extras' means over the step's responses (those that gave the key), as reward/<key>; a
    built-in metric's name is not replaced."""
    cfg = Config()
    cfg.trainer.prompts_per_step, cfg.rollout.n = 2, 2
    prompts = [Prompt("p", "1", {}, "p", [1], "t:1"), Prompt("q", "2", {}, "q", [2], "t:2")]
    results = [GenerationResult(i // 2, i % 2, [5, 6], torch.zeros(2), "stop") for i in range(4)]
    sel = GroupSelector(cfg)
    sel.add(ScoredBatch(prompts, results, [1.0, 0.0, 1.0, 1.0], 2, extras=[
        {"acc": 1.0, "mean": 9.0}, {"acc": 0.0}, {"acc": 1.0, "len": 4.0}, {}]))
    _, stats = sel.finish()
    m = stats.metrics()
    assert m["reward/acc"] == pytest.approx(2 / 3) and m["reward/len"] == 4.0
    assert m["reward/mean"] == 0.75  # the built-in, not the reward's own "mean"


@pytest.mark.parametrize("dynamic", [False, True])
def test_flat_groups_are_the_share_of_drawn_groups_with_one_reward(dynamic):
    """Two batches of two groups of 2 responses: three groups earn one reward for both responses
    ((1, 1), (0.3, 0.3), (0, 0)), one is mixed. ``rollout/flat_groups`` is 3/4 of the drawn groups
    either way; GRPO keeps the flat groups (advantage 0), dynamic sampling drops them."""
    cfg = Config()
    cfg.trainer.prompts_per_step, cfg.rollout.n = 2, 2
    cfg.trainer.dynamic_sampling, cfg.trainer.max_gen_batches = dynamic, 2
    prompts = [Prompt("p", "1", {}, "p", [1], "t:1"), Prompt("q", "2", {}, "q", [2], "t:2")]
    results = [GenerationResult(i // 2, i % 2, [5, 6], torch.zeros(2), "stop") for i in range(4)]
    sel = GroupSelector(cfg)
    sel.add(ScoredBatch(prompts, results, [1.0, 1.0, 0.3, 0.3], 2))
    sel.add(ScoredBatch(prompts, results, [0.0, 0.0, 1.0, 0.0], 2))
    samples, stats = sel.finish()
    assert stats.metrics()["rollout/flat_groups"] == 0.75
    if dynamic:  # one informative group: trimmed to a multiple of the mini-batches (1)
        assert stats.kept_groups == 1 and [s.reward for s in samples] == [1.0, 0.0]
    else:
        assert stats.kept_groups == 4 and [s.advantage for s in samples[:6]] == [0.0] * 6


def test_acc_of_a_dict_return_is_the_verdict_of_accuracy_and_held_out_avg_at_k():
    """A reward that pays 0.3 for a wrong answer in the right format (verl's ``format_score``)
    returns ``acc``: the step's accuracy and the held-out avg@k / pass@k count ``acc``, not
    ``score > 0``; responses without the key (or a batch without extras) fall back to score > 0."""
    from megatron_stare.trainer.generation import eval_metrics

    cfg = Config()
    cfg.trainer.prompts_per_step, cfg.rollout.n = 2, 2
    prompts = [Prompt("p", "1", {}, "p", [1], "t:1"), Prompt("q", "2", {}, "q", [2], "t:2")]
    results = [GenerationResult(i // 2, i % 2, [5, 6], torch.zeros(2), "stop") for i in range(4)]
    scores = [1.0, 0.3, 0.3, 0.0]
    batch = ScoredBatch(prompts, results, scores, 2, extras=[{"acc": 1.0}, {"acc": 0.0}, {"acc": 0.0}, {"acc": 0.0}])
    assert batch.verdicts() == [1.0, 0.0, 0.0, 0.0]
    sel = GroupSelector(cfg)
    sel.add(batch)
    _, stats = sel.finish()
    assert stats.accuracy == 0.25 and stats.reward_mean == pytest.approx(0.4)
    m = eval_metrics(batch)
    assert m["eval/avg@2"] == 0.25 and m["eval/pass@2"] == 0.5
    # Without an "acc": score > 0, per response.
    assert ScoredBatch(prompts, results, scores, 2).verdicts() == [1.0, 1.0, 1.0, 0.0]
    assert ScoredBatch(prompts, results, scores, 2, extras=[{"acc": 1.0}, {}, {}, {}]).verdicts() == [1.0, 1.0, 1.0, 0.0]
    assert eval_metrics(ScoredBatch(prompts, results, scores, 2))["eval/avg@2"] == 0.75
