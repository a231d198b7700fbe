"""Study v2's task: reach N from 0 in hops of the offered sizes, avoiding two positions, writing every
position on the way.

A scratchpad that *is* the work: each number is the previous one plus a hop the response chooses,
so every number carries a forking decision (which hop next) and an addition (the running total)::

    prompt:   "Hop 2 3 5 from 0 to 23 avoiding 7 12:"
    response: " 2 5 10 13 15 18 23"     (or " 5 10 15 18 20 23", " 3 6 8 13 ...", ...)

The number of correct responses is the number of ordered hop sequences summing to N that step on
neither avoided position (hundreds to millions here); a hop onto a position from which the
avoided ones cannot be passed is a dead end found only later: the forks matter. A response is
``2-3 x hops`` model tokens (a space and one or two digits per position: digits are single
tokens), 10-60 for N in 15-50 (study v2); shorter hops give longer responses, so length is a choice.

Row keys: ``prompt``; ``answer`` (N); ``hops`` (the offered hop sizes, space separated, distinct);
``avoid`` (the two avoided positions, in 1..N-1). The generator draws ``sizes`` distinct hops from
``1..max_hop``, N from ``targets`` (``"lo,hi"``) and two avoided positions, such that N is reachable.

Reward (``hop_path``, registered): 1.0 iff the response is whitespace-separated integers, each
the previous one (0 before the first) plus an offered hop, none avoided, the last one N; else 0.0.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence

from megatron_stare.study.tasks.common import parsed_and_offered

Row = Dict[str, str]
MAX_RESPONSE_CHARS = 300


def random_path(row: Row, rng: random.Random) -> str:
    """A correct response of ``row``: hops drawn uniformly among those that can still reach N."""
    hops = [int(h) for h in row["hops"].split()]
    n = int(row["answer"])
    ok = reachable(hops, n, _avoid(row))
    pos, out = 0, []
    while pos < n:
        h = rng.choice([h for h in hops if pos + h <= n and ok[pos + h]])
        pos += h
        out.append(pos)
    return " " + " ".join(map(str, out))


def reachable(hops: Sequence[int], n: int, avoid: Sequence[int] = ()) -> List[bool]:
    """``ok[p]``: from position p (0..n), N can be reached exactly by the hops without stepping on
    an avoided position (``ok[p]`` is False for an avoided p)."""
    ok = [False] * n + [True]
    for p in range(n - 1, -1, -1):
        ok[p] = p not in avoid and any(p + h <= n and ok[p + h] for h in hops)
    return ok


def _avoid(row: Row) -> List[int]:
    return [int(x) for x in str(row.get("avoid", "")).split()]


def hop_path_row(rng: random.Random, sizes: int = 3, max_hop: int = 5, targets: str = "15,35") -> Row:
    lo, hi = (int(x) for x in str(targets).split(","))
    if not 1 <= sizes <= max_hop <= 9 or not 1 <= lo <= hi:
        raise ValueError(f"hop_path needs 1 <= sizes <= max_hop <= 9 and 1 <= lo <= hi, got "
                         f"sizes={sizes} max_hop={max_hop} targets={targets!r}")
    for _ in range(1000):
        hops = sorted(rng.sample(range(1, max_hop + 1), sizes))
        n = rng.randint(lo, hi)
        avoid = sorted(rng.sample(range(1, n), 2))
        if reachable(hops, n, avoid)[0]:
            return {"prompt": f"Hop {' '.join(map(str, hops))} from 0 to {n} avoiding {avoid[0]} {avoid[1]}:",
                    "answer": str(n), "hops": " ".join(map(str, hops)), "avoid": f"{avoid[0]} {avoid[1]}"}
    raise ValueError(f"hop_path: no reachable target for sizes={sizes} max_hop={max_hop} targets={targets!r}")


def parse_path(text: str) -> Optional[List[int]]:
    """``" 2 5 10"`` -> ``[2, 5, 10]``, or None if it is not whitespace-separated integers."""
    if len(text) > MAX_RESPONSE_CHARS:
        return None
    parts = text.split()
    if not parts or not all(p.isdigit() and len(p) <= 3 for p in parts):
        return None
    return [int(p) for p in parts]


def hop_path_reward(response_text: str, answer: str, metadata: Optional[dict] = None) -> float:
    """1.0 iff every position is the previous one plus an offered hop, none is avoided, and the last
    one is ``answer``."""
    found = parsed_and_offered(response_text, metadata, parse_path, "hops")
    if found is None:
        return 0.0
    path, meta, hops = found
    avoid = set(_avoid(meta))
    prev = 0
    for p in path:
        if p - prev not in hops or p in avoid:
            return 0.0
        prev = p
    return 1.0 if prev == int(str(answer).strip()) else 0.0


hop_path = hop_path_reward
