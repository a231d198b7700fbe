"""Templated multi-step arithmetic word problems, in verl's format, with a verl ``compute_score``.

The real-model task (``python -m megatron_stare.demo.word_problems OUT_DIR``): what a pretrained
chat model (SmolLM2-135M-Instruct) can partly solve, so GRPO groups have mixed rewards.

- Rows are verl parquet rows as users bring them: ``prompt`` chat messages (one user turn),
  ``data_source``, ``ability``, ``reward_model.ground_truth`` and ``extra_info`` (tier, index).
- Tiers (``TIERS``) set the number of operations: 1 (``a + b``), 2 and 3 steps, with small
  operands; tier 0 (opt-in: ``make_rows(..., tiers=...)``) is one step with single-digit operands.
  The split is deterministic in ``(split, n, seed)`` and train / held-out problems are disjoint
  (the held-out split draws from another seed stream and drops any train duplicate).
- ``compute_score(data_source, solution_str, ground_truth, extra_info)``: 1.0 when the response's
  answer (``extract_answer``: the last ``\\boxed{}``, else the last explicit "the answer is N" /
  "Answer: N", else the last equation's result, else the last number) equals the answer, else 0.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ["TIERS", "compute_score", "extract_answer", "make_rows", "write_split"]

DATA_SOURCE = "word_problems"
NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Ivy", "Jack", "Lena", "Omar")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards")
#: tier -> number of arithmetic steps. Tier 0 is one step with single-digit operands.
TIERS = {0: 1, 1: 1, 2: 2, 3: 3}
INSTRUCTION = "Solve the problem. End your answer with the final number."


def _problem(rng: random.Random, steps: int, small: bool = False) -> Dict[str, object]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(2, 9) if small else rng.randint(3, 20)
    text = [f"{name} has {total} {item}."]
    for _ in range(steps):
        op = rng.choice(("buy", "give", "double") if total <= 40 else ("give",))
        if op == "buy":
            k = rng.randint(1, 9) if small else rng.randint(2, 15)
            text.append(f"Then {name} buys {k} more.")
            total += k
        elif op == "give" and total > 1:
            k = rng.randint(1, total - 1)
            text.append(f"Then {name} gives {k} to a friend.")
            total -= k
        else:
            text.append(f"Then the number of {item} doubles.")
            total *= 2
    text.append(f"How many {item} does {name} have now?")
    return {"question": " ".join(text), "answer": total}


def make_rows(split: str, n: int, seed: int = 0, tiers: Sequence[int] = (1, 2, 3),
              exclude: Optional[set] = None) -> List[dict]:
    """``n`` rows of ``split`` ("train" or "test"), tiers dealt round-robin; deterministic."""
    rng = random.Random(f"{split}:{seed}")
    rows, seen = [], set(exclude or ())
    while len(rows) < n:
        tier = tiers[len(rows) % len(tiers)]
        p = _problem(rng, TIERS[tier], small=tier == 0)
        if p["question"] in seen:
            continue
        seen.add(p["question"])
        rows.append({"data_source": DATA_SOURCE, "ability": "math",
                     "prompt": [{"role": "user", "content": f"{p['question']} {INSTRUCTION}"}],
                     "reward_model": {"style": "rule", "ground_truth": str(p["answer"])},
                     "extra_info": {"split": split, "index": len(rows), "tier": tier}})
    return rows


def write_split(out_dir, n_train: int = 512, n_test: int = 64, seed: int = 0) -> Dict[str, Path]:
    """``train.parquet`` and ``test.parquet`` in ``out_dir`` (disjoint questions)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = make_rows("train", n_train, seed)
    test = make_rows("test", n_test, seed, exclude={r["prompt"][0]["content"].rsplit(" " + INSTRUCTION, 1)[0]
                                                    for r in train})
    paths = {}
    for name, rows in (("train", train), ("test", test)):
        paths[name] = out / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[name])
    return paths


_NUM = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
_NUMBER = re.compile(_NUM)
#: a number that is a result, not an operand: no digit and no arithmetic operator on after it.
_RESULT = _NUM + r"(?![\d.,]\d)(?!\s*[-+*/×÷x]\s*\d)"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
#: an explicit answer statement: "the answer is N", "Answer: N", "final answer = N"; its span runs
#: to the end of the sentence (". " or a line break).
_ANSWER = re.compile(r"\banswer\b\s*(?:is|was|:|=)\s*:?\s*(.*?)(?:\.(?:\s|$)|\n|$)", re.IGNORECASE)
_EQUALS = re.compile(r"=\s*\$?\s*(" + _RESULT + r")")


def _to_float(num: str) -> float:
    return float(num.replace(",", ""))


def extract_answer(solution_str: str) -> Optional[float]:
    """The response's answer, or None when it states no number. In order of precedence:

    1. the last ``\\boxed{...}``: its last number;
    2. the last explicit answer statement ("the answer is N", "Answer: N", "final answer = N"):
       within its sentence, the result of an equation there ("The answer is 3 + 4 = 7" -> 7), else its
       first number that is not an operand ("The answer is: Ava has 7 apples" -> 7);
    3. the result of the last equation ("... 15 - 12 = 3 books left. To find out ..." -> 3);
    4. the last number.
    """
    boxed = _BOXED.findall(solution_str)
    if boxed:
        nums = _NUMBER.findall(boxed[-1])
        return _to_float(nums[-1]) if nums else None
    stated = _ANSWER.findall(solution_str)
    for span in reversed(stated):
        eq = _EQUALS.findall(span)
        if eq:
            return _to_float(eq[-1])
        first = re.search(_RESULT, span)
        if first:
            return _to_float(first.group(0))
    eq = _EQUALS.findall(solution_str)
    if eq:
        return _to_float(eq[-1])
    nums = _NUMBER.findall(solution_str)
    return _to_float(nums[-1]) if nums else None


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None) -> float:
    """verl's reward signature: 1.0 if the response's answer (``extract_answer``: a ``\\boxed{}``
    one, else an explicit "answer is N", else the last equation's result, else the last number)
    equals ``ground_truth``, else 0.0."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    try:
        return float(answer == float(ground_truth))
    except ValueError:
        return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.demo.word_problems", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=512)
    ap.add_argument("--test", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for name, path in write_split(a.out_dir, a.train, a.test, a.seed).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
