"""Study v2's task: pick digits that add up to N, with a scratchpad of the running sums.

``pick_sum`` (study v1) has 5-token responses: nothing for STARE's lever to act on inside a
response. ``sum_steps`` keeps its several correct answers and makes each one a short chain of
work whose *order* is free::

    prompt:   "Pick 4 of 3 7 1 8 5 2 9 6 that sum to 20:"
    response: " 7+5=12 12+2=14 14+6=20"    (or " 2+6=8 8+5=13 13+7=20", " 9+1=10 ...", ...)

Every pick (the digit after ``+``) is a forking decision: which subset, in which order; the
running sums between them are forced by the picks (and are where a tiny model makes arithmetic
mistakes). With ``terms`` k the response is ``8k - 8`` model tokens (each digit is one token;
k = 3, 4, 5 give 16, 24, 32 tokens plus EOS).

Row keys: ``prompt``; ``answer`` (N); ``digits`` (offered, space separated, distinct);
``terms`` (k); ``subsets`` (every unordered choice of k offered digits that sums to N, as
``"2 5 6 7|..."``: the warm start writes a random order of a random one; the reward does not read
them). A row's k is drawn from ``terms`` (a comma list, e.g. ``"3,4,5"``) so difficulty varies
between prompts; its target is reached by at least ``min_solutions`` subsets.

Reward (``sum_steps``, registered): 1.0 iff the response is k whitespace-separated steps
``a+d=s`` where the first ``a`` is an offered digit, every later ``a`` is the previous ``s``,
every ``s`` is correct, the k digits used (the first ``a`` and every ``d``) are distinct and
offered, and the last ``s`` is N (the final answer); else 0.0.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Dict, List, Optional, Sequence

from megatron_stare.study.tasks.common import parsed_and_offered, target_with_solutions

Row = Dict[str, str]
_STEP = re.compile(r"^(\d{1,2})\+(\d)=(\d{1,2})$")
MAX_RESPONSE_CHARS = 200


def scratchpad(order: Sequence[int]) -> str:
    """``[7, 5, 2, 6]`` -> ``"7+5=12 12+2=14 14+6=20"`` (the correct chain for this order)."""
    steps, acc = [], order[0]
    for d in order[1:]:
        steps.append(f"{acc}+{d}={acc + d}")
        acc += d
    return " ".join(steps)


def subsets(digits: Sequence[int], terms: int, target: int) -> List[str]:
    """Every unordered choice of ``terms`` offered digits summing to ``target``, ``"2 5 6 7"``."""
    return [" ".join(map(str, c)) for c in itertools.combinations(sorted(digits), terms) if sum(c) == target]


def random_solution(row: Row, rng: random.Random) -> str:
    """A correct response of ``row``: a random subset in a random order, as a scratchpad."""
    order = [int(x) for x in rng.choice(row["subsets"].split("|")).split()]
    rng.shuffle(order)
    return " " + scratchpad(order)


def sum_steps_row(rng: random.Random, length: int = 8, terms: str = "3,4,5", min_solutions: int = 2) -> Row:
    ks = [int(k) for k in str(terms).split(",")]
    if not all(2 <= k <= length <= 10 for k in ks):
        raise ValueError(f"sum_steps needs 2 <= terms <= length <= 10, got terms={terms!r} length={length}")
    for _ in range(1000):
        k = rng.choice(ks)
        ds = rng.sample(range(1, 10) if length <= 9 else range(10), length)
        n = target_with_solutions(rng, ds, k, min_solutions)
        if n is not None:
            return {"prompt": f"Pick {k} of {' '.join(map(str, ds))} that sum to {n}:", "answer": str(n),
                    "digits": " ".join(map(str, ds)), "terms": str(k), "subsets": "|".join(subsets(ds, k, n))}
    raise ValueError(f"sum_steps: no target with >= {min_solutions} subsets for length={length} terms={terms!r}")


def parse_steps(text: str) -> Optional[List[tuple]]:
    """``" 7+5=12 12+2=14"`` -> ``[(7, 5, 12), (12, 2, 14)]``, or None if any step is malformed."""
    if len(text) > MAX_RESPONSE_CHARS:
        return None
    parts = text.split()
    out = []
    for p in parts:
        m = _STEP.match(p)
        if m is None:
            return None
        out.append(tuple(int(g) for g in m.groups()))
    return out or None


def sum_steps_reward(response_text: str, answer: str, metadata: Optional[dict] = None) -> float:
    """1.0 iff the scratchpad is a correct chain of ``terms`` distinct offered digits ending at ``answer``."""
    found = parsed_and_offered(response_text, metadata, parse_steps, "digits")
    if found is None:
        return 0.0
    steps, meta, offered = found
    k = int(meta.get("terms", 0))
    if len(steps) != k - 1 or steps[0][0] > 9:
        return 0.0
    used, acc = [steps[0][0]], steps[0][0]
    for a, d, s in steps:
        if a != acc or s != a + d:
            return 0.0
        used.append(d)
        acc = s
    ok = len(set(used)) == k and set(used) <= offered and acc == int(str(answer).strip())
    return 1.0 if ok else 0.0


sum_steps = sum_steps_reward
