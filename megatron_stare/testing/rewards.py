"""Rewards for tests: deterministic, cheap, and non-degenerate on an untrained tiny model
(whose answers are never right), so that advantages, STARE selection and updates are exercised."""


def parity_reward(response: str, answer: str, metadata: dict) -> float:
    """1.0 when the response has an even number of characters, else 0.0."""
    return float(len(response) % 2 == 0)
