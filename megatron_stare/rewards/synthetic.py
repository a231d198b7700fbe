"""Synthetic verifiable tasks for the CPU demo, and the ``exact_match`` reward that scores them.

``make_task(name, n, seed, **kw) -> [{"prompt": ..., "answer": ...}]`` is deterministic in
``(name, n, seed, kw)``; ``write_jsonl`` writes the rows as a prompt dataset. Tasks:

- ``add``: ``a + b`` with ``digits``-digit operands (default 2).
- ``sort``: ``length`` digits (default 4) sorted ascending, answered as space-separated digits.
- ``count``: how many times a digit occurs in a ``length``-digit string (default 8).
- ``mul``: ``a * b`` with ``digits``- and ``digits2``-digit operands (default 3 and 2): the
  tool-use task (``demo/tool_use.py``), which a tiny model cannot do in its head.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from megatron_stare.config.dotted import registrar, with_plugins
from megatron_stare.rewards.math_verify_reward import extract_after_marker
from megatron_stare.rewards.registry import register_reward

Row = Dict[str, str]
TaskFn = Callable[..., Row]

#: name -> row generator ``fn(rng: random.Random, **kw) -> {"prompt", "answer"}``.
TASKS: Dict[str, TaskFn] = {}
#: The entry-point group through which an installed package registers tasks by name.
TASK_PLUGINS = "megatron_stare.tasks"


register_task = registrar(TASKS, "synthetic task")


@register_task("add")
def _add(rng: random.Random, digits: int = 2) -> Row:
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return {"prompt": f"What is {a} + {b}? Answer:", "answer": str(a + b)}


@register_task("sort")
def _sort(rng: random.Random, length: int = 4) -> Row:
    xs = [rng.randint(0, 9) for _ in range(length)]
    return {"prompt": f"Sort the digits {' '.join(map(str, xs))} ascending. Answer:",
            "answer": " ".join(map(str, sorted(xs)))}


@register_task("count")
def _count(rng: random.Random, length: int = 8) -> Row:
    s = "".join(str(rng.randint(0, 9)) for _ in range(length))
    d = rng.choice(s)
    return {"prompt": f"How many times does {d} occur in {s}? Answer:", "answer": str(s.count(d))}


@register_task("mul")
def _mul(rng: random.Random, digits: int = 3, digits2: int = 2) -> Row:
    a, b = rng.randint(10 ** (digits - 1), 10 ** digits - 1), rng.randint(10 ** (digits2 - 1), 10 ** digits2 - 1)
    return {"prompt": f"What is {a} * {b}? Answer:", "answer": str(a * b)}


def make_task(name: str, n: int, seed: int, **kwargs) -> List[Row]:
    """``n`` rows of task ``name``, deterministic from ``seed`` (and ``kwargs``): a task registered
    here, or by an installed package in the entry-point group ``megatron_stare.tasks`` (the
    study's tasks: ``setup.py``)."""
    tasks = with_plugins(TASKS, TASK_PLUGINS)
    if name not in tasks:
        raise ValueError(f"synthetic task must be one of {list(tasks)}, got {name!r}{tasks.missing_hint()}")
    if n < 0:
        raise ValueError(f"synthetic task size n must be >= 0, got {n}")
    # Seed mixes in the name so 'add' and 'sort' at the same seed are unrelated streams.
    rng = random.Random(f"{name}:{seed}")
    task = tasks[name]
    return [task(rng, **kwargs) for _ in range(n)]


def write_jsonl(rows: Sequence[Row], path: str) -> str:
    """Write ``rows`` one JSON object per line (parent directories created); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


@dataclass
class ExactMatch:
    """1.0 if the extracted final answer equals ``answer.strip()`` exactly, else 0.0.

    Extraction: the text after the last of ``markers`` (see ``extract_after_marker``); with no
    marker, the whole stripped response if ``whole_response_fallback`` else no answer (0.0).
    Register a differently configured instance by dotted path (``reward.fn=my.mod:my_match``).
    """

    markers: Sequence[str] = ("answer:", "the answer is", "####")
    whole_response_fallback: bool = True

    def __call__(self, response_text: str, answer: str, metadata: Optional[dict] = None) -> float:
        pred = extract_after_marker(response_text, self.markers)
        if pred is None and self.whole_response_fallback:
            pred = response_text.strip()
        return 1.0 if pred is not None and pred == str(answer).strip() else 0.0


exact_match = register_reward("exact_match")(ExactMatch())
