"""Rewards for tests: deterministic, cheap, and non-degenerate on an untrained tiny model
(whose answers are never right), so that advantages, STARE selection and updates are exercised."""

import os
import time


def parity_reward(response: str, answer: str, metadata: dict) -> float:
    """1.0 when the response has an even number of characters, else 0.0."""
    return float(len(response) % 2 == 0)


SLOW_RANK_SLEEP_S = 1.0
"""How long ``parity_reward_slow_on_rank_1`` sleeps on rank 1: past any test's small timeout."""


def parity_reward_slow_on_rank_1(response: str, answer: str, metadata: dict) -> float:
    """``parity_reward``, except that on rank 1 (``RANK``) every call first sleeps
    ``SLOW_RANK_SLEEP_S``: a verifier slow on one rank only (its calls run past the timeout)."""
    if os.environ.get("RANK") == "1":
        time.sleep(SLOW_RANK_SLEEP_S)
    return parity_reward(response, answer, metadata)


def parity_reward_raises_on_rank_1(response: str, answer: str, metadata: dict) -> float:
    """``parity_reward``, except that it raises on rank 1 (``RANK``): a reward bug one rank hits."""
    if os.environ.get("RANK") == "1":
        raise ValueError("verifier bug on rank 1")
    return parity_reward(response, answer, metadata)


def digit_share_reward(response: str, answer: str, metadata: dict) -> float:
    """The share of the response's non-space characters that are digits (0.0 when it has none):
    a dense reward (a few percent on an untrained tiny model) with one optimum, 1.0, that any
    policy writing only digit tokens reaches, so runs that learn end near the same value."""
    chars = [c for c in response if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


SLOW_REWARD_S = 5.0
"""How long each ``slow_parity_reward`` call takes."""


def slow_parity_reward(response: str, answer: str, metadata: dict) -> float:
    """``parity_reward`` after ``SLOW_REWARD_S`` of sleep: a slow verifier (preemption tests)."""
    time.sleep(SLOW_REWARD_S)
    return parity_reward(response, answer, metadata)


def parity_compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """``parity_reward`` with verl's ``compute_score`` signature: a reward any model's samples
    split on, so a real model's first steps move its weights (a correct-answer reward may not)."""
    return parity_reward(solution_str, ground_truth, extra_info or {})


def constant_reward(response: str, answer: str, metadata: dict) -> float:
    """1.0 for every response: every prompt group all right, so DAPO's dynamic sampling runs dry."""
    return 1.0
