"""A synthetic task with several correct answers per prompt: pick digits that add up to N.

The entropy study (``megatron_stare.study.v2``) needs a task on which collapse has a cost:
responses of several tokens, several correct responses per prompt, so that a policy can keep
entropy *among correct answers* (what STARE's reweighting protects) or collapse onto one of them
(what GRPO does). ``pick_sum`` is such a task::

    prompt:   "Pick 2 of 3 7 1 8 5 2 that sum to 9:"
    response: " 7+2"   (or " 2+7", " 1+8", " 8+1": four correct responses)

Row keys: ``prompt``; ``answer`` (N, the target sum); ``digits`` (the offered digits, space
separated, all distinct); ``solutions`` (every correct response, ``|``-separated, sorted: the
warm start samples its targets from them; the reward does not read them). The generator draws
``length`` distinct digits and a target reached by at least ``min_solutions`` unordered choices
of ``terms`` digits, so every prompt has at least ``2 * min_solutions`` correct ordered responses
(``terms`` = 2) and a pass@k above pass@1 is possible.

Reward (``pick_sum``, registered): 1.0 iff the response, stripped, is ``d1+d2(+...)`` with
exactly the row's ``terms`` single digits, all distinct, all among the offered digits, adding up
to N; else 0.0.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Dict, List, Optional

from megatron_stare.study.tasks.common import parsed_and_offered, target_with_solutions

Row = Dict[str, str]
_RESPONSE = re.compile(r"^\s*(\d(?:\s*\+\s*\d)*)\s*$")
MAX_DIGITS = 10


def solutions(digits: List[int], terms: int, target: int) -> List[str]:
    """Every correct ordered response (``"7+2"``) choosing ``terms`` distinct digits summing to ``target``."""
    out = []
    for combo in itertools.combinations(digits, terms):
        if sum(combo) == target:
            out += ["+".join(map(str, p)) for p in itertools.permutations(combo)]
    return sorted(out)


def pick_sum_row(rng: random.Random, length: int = 6, terms: int = 2, min_solutions: int = 2) -> Row:
    if not 1 <= terms <= length <= MAX_DIGITS:
        raise ValueError(f"pick_sum needs 1 <= terms <= length <= {MAX_DIGITS}, got terms={terms} length={length}")
    for _ in range(1000):
        ds = rng.sample(range(MAX_DIGITS), length)
        n = target_with_solutions(rng, ds, terms, min_solutions)
        if n is not None:
            return {"prompt": f"Pick {terms} of {' '.join(map(str, ds))} that sum to {n}:", "answer": str(n),
                    "digits": " ".join(map(str, ds)), "terms": str(terms),
                    "solutions": "|".join(solutions(ds, terms, n))}
    raise ValueError(f"pick_sum: no target with >= {min_solutions} solutions for length={length} terms={terms}")


def parse_response(text: str) -> Optional[List[int]]:
    """The digits of ``"d1+d2+..."`` (whitespace around them allowed), or None if malformed."""
    if len(text) > 64:  # a response this long is not a short sum; do not regex-scan it
        return None
    m = _RESPONSE.match(text)
    return None if m is None else [int(c) for c in m.group(1) if c.isdigit()]


def pick_sum_reward(response_text: str, answer: str, metadata: Optional[dict] = None) -> float:
    """1.0 iff the response picks the row's number of distinct offered digits that add up to ``answer``."""
    found = parsed_and_offered(response_text, metadata, parse_response, "digits")
    if found is None:
        return 0.0
    picked, meta, offered = found
    terms = int(meta.get("terms", 2))
    ok = (len(picked) == terms and len(set(picked)) == len(picked) and set(picked) <= offered
          and sum(picked) == int(str(answer).strip()))
    return 1.0 if ok else 0.0


pick_sum = pick_sum_reward
