"""Scoring once and sharing the scores (``rewards/sharded.py``, step phase 3) on 2 gloo ranks.

Every rank holds the same responses. Rank 1's verifier runs past ``reward.timeout_s`` (its calls
score 0 there); rank 0's does not. Shared, both ranks hold the same scores, the same timeout
count, and each response was scored exactly once over the ranks; the reference is one process
applying the rule "responses of rank 1's shard time out". Broken on purpose (every rank scores
every response itself, as the trainer did before), the same check fails: the ranks disagree.
A reward function that raises on one rank only fails every rank with the same line, and no rank
is left waiting in a collective.
"""

import pytest

from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.rewards import parity_reward

pytestmark = pytest.mark.distributed

SLOW = "megatron_stare.testing.rewards:parity_reward_slow_on_rank_1"
RAISES = "megatron_stare.testing.rewards:parity_reward_raises_on_rank_1"
TIMEOUT_S = 0.1


def _texts(n):
    return [f"response {'x' * k}" for k in range(n)]  # lengths of both parities


def _score(rank, world, ns, mode, fn, workers):
    """This rank's outcome of scoring ``_texts(n)`` for each ``n`` in ``ns``."""
    return [_score_one(rank, n, mode, fn, workers) for n in ns]


def _score_one(rank, n, mode, fn, workers):
    from megatron_stare.config.sections import RewardConfig
    from megatron_stare.rewards import RewardPool
    from megatron_stare.rewards.registry import RewardError
    from megatron_stare.rewards.sharded import score_once

    texts = _texts(n)
    with RewardPool(RewardConfig(fn=fn, timeout_s=TIMEOUT_S, num_workers=workers)) as pool:
        scored = []
        if workers == 0:  # inline: count the calls this rank makes
            real = pool.fn
            pool.fn = lambda r, a, m: (scored.append(r), real(r, a, m))[1]
        try:
            if mode in ("shared", "item_raises"):
                def item(i):
                    if mode == "item_raises" and rank == 1:
                        raise KeyError(f"no prompt for response {i}")
                    return texts[i], "", {}

                out = score_once(pool, n, item)
                return {"scores": out.scores, "timeouts": out.timeouts, "scored": scored}
            # The guard broken on purpose: this rank scores every response itself.
            fut = pool.submit(texts, [""] * n, [{}] * n)
            return {"scores": fut.result(), "timeouts": fut.num_timeouts, "scored": scored}
        except RewardError as e:
            return {"error": str(e)}


def _reference(n, world=2):
    """One process: rank 1's shard (odd indices) timed out, the rest scored by the rule."""
    return [0.0 if i % world == 1 else parity_reward(t, "", {}) for i, t in enumerate(_texts(n))]


def test_scores_are_shared_so_a_slow_rank_cannot_split_the_ranks():
    ns = [0, 1, 7]  # no response, fewer responses than ranks, an uneven split
    for n, r0, r1 in zip(ns, *run_on_ranks(_score, 2, ns, "shared", SLOW, 0)):
        assert r0["scores"] == r1["scores"] == _reference(n)
        assert r0["timeouts"] == r1["timeouts"] == n // 2
        # Each response scored exactly once over the ranks, each rank its own shard.
        assert r0["scored"] == _texts(n)[0::2] and r1["scored"] == _texts(n)[1::2]


def test_scores_are_shared_with_reward_workers():
    """The same through worker processes (the soft limit in the worker, not the rank)."""
    (r0,), (r1,) = run_on_ranks(_score, 2, [5], "shared", SLOW, 1)
    assert r0["scores"] == r1["scores"] == _reference(5) and r0["timeouts"] == r1["timeouts"] == 2


def test_without_sharing_the_ranks_disagree():
    """The check above, with every rank scoring alone: it fails (the ranks disagree), so the
    agreement above is the sharing's doing and not the data's."""
    n = 7
    (r0,), (r1,) = run_on_ranks(_score, 2, [n], "independent", SLOW, 0)
    assert r0["scores"] != r1["scores"] and r0["timeouts"] != r1["timeouts"]
    assert r0["scored"] == r1["scored"] == _texts(n)  # everything scored twice


def test_a_reward_error_on_one_rank_fails_every_rank_with_one_line():
    (r0,), (r1,) = run_on_ranks(_score, 2, [4], "shared", RAISES, 0, timeout=120)
    assert r0["error"] == r1["error"]
    assert r0["error"].endswith("(scored on rank 1)") and "verifier bug on rank 1" in r0["error"]
    assert "\n" not in r0["error"]


def test_any_failure_while_scoring_on_one_rank_fails_every_rank():
    """Not only the reward function: a failure preparing rank 1's share fails both ranks too."""
    (r0,), (r1,) = run_on_ranks(_score, 2, [4], "item_raises", SLOW, 0, timeout=120)
    assert r0["error"] == r1["error"] == ("reward: scoring failed: KeyError: 'no prompt for response 1' "
                                          "(scored on rank 1)")
