"""What the study's tasks share: a target sum with several solutions; a response parsed against
its row's offered numbers."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from typing import Any, Callable, Optional, Sequence, Set, Tuple


def target_with_solutions(rng: random.Random, digits: Sequence[int], terms: int, min_solutions: int) -> Optional[int]:
    """A sum that at least ``min_solutions`` unordered choices of ``terms`` of ``digits`` reach,
    drawn by ``rng`` among all such sums (sorted); None when there is none (draw other digits)."""
    counts = Counter(sum(c) for c in itertools.combinations(digits, terms))
    targets = sorted(t for t, c in counts.items() if c >= min_solutions)
    return rng.choice(targets) if targets else None


def parsed_and_offered(text: str, metadata: Optional[dict], parse: Callable[[str], Any],
                       key: str) -> Optional[Tuple[Any, dict, Set[int]]]:
    """``(parse(text), the row's metadata, the numbers offered in metadata[key])``; None when the
    response does not parse or the row lacks ``key`` (the reward is then 0)."""
    meta = metadata or {}
    parsed = parse(text)
    if parsed is None or key not in meta:
        return None
    return parsed, meta, {int(c) for c in str(meta[key]).split()}
