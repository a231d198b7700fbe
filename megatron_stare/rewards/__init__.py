"""Rewards: verifiers of final answers, synthetic tasks, and batch scoring beside the trainer.

``get_reward_fn(cfg.reward.fn)`` resolves a registered name (``math``, ``exact_match``; the
study's ``pick_sum`` through its entry point) or a dotted path; ``contract.py`` defines how a reward is called (verl's keywords
or ``(response, answer, metadata)``), what it returns and ``reward.by_source`` routing
(``check_reward_config`` checks them all up front); ``RewardPool(cfg.reward)`` scores batches in worker processes with per-call time
limits; ``shape_overlong`` adds DAPO's overlong penalty. Importing this package does not import
torch or math-verify (reward workers stay light).
"""

from megatron_stare.rewards.math_verify_reward import (ANSWER_MARKERS, MathVerifyReward, extract_after_marker,
                                                       extract_boxed, extract_final_answer, math_reward)
from megatron_stare.rewards.pool import HARD_KILL_GRACE_S, RewardFuture, RewardPool, score_one, shape_overlong
from megatron_stare.rewards.contract import (VERL_PARAMS, BoundReward, RewardRouter, bind_reward, build_reward,
                                             check_reward_config, normalize_return)
from megatron_stare.rewards.lookup import get_reward_fn
from megatron_stare.rewards.registry import REWARDS, RewardError, RewardFn, RewardTimeout, deadline, register_reward
from megatron_stare.rewards.synthetic import TASKS, ExactMatch, exact_match, make_task, register_task, write_jsonl

__all__ = ["ANSWER_MARKERS", "HARD_KILL_GRACE_S", "REWARDS", "TASKS", "VERL_PARAMS", "BoundReward", "ExactMatch",
           "MathVerifyReward", "RewardError", "RewardFn", "RewardRouter", "bind_reward", "build_reward",
           "check_reward_config", "normalize_return", "RewardFuture", "RewardPool", "RewardTimeout", "deadline",
           "exact_match", "extract_after_marker", "extract_boxed", "extract_final_answer", "get_reward_fn",
           "make_task", "math_reward", "register_reward", "register_task", "score_one", "shape_overlong",
           "write_jsonl"]
