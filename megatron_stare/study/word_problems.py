"""Templated multi-step arithmetic word problems, in verl's format, with a verl ``compute_score``.

The real-model task (``python -m megatron_stare.study.word_problems OUT_DIR``): what a pretrained
chat model (SmolLM2-135M-Instruct) can partly solve, so GRPO groups have mixed rewards.

- Rows are verl parquet rows as users bring them: ``prompt`` chat messages (one user turn),
  ``data_source``, ``ability``, ``reward_model.ground_truth`` and ``extra_info`` (tier, index).
- Tiers (``TIERS``: tier -> arithmetic steps), easiest first: 0 a bare single-digit sum
  ("What is 4 + 3?"), 1 a one-step word problem with single-digit operands, 2, 3 and 4 word
  problems of 1, 2 and 3 steps with operands up to 20. ``make_rows(..., tiers=...)`` deals the
  given tiers round-robin: ``DEFAULT_TIERS`` (2, 3, 4) is the original mix (the benchmark's);
  ``STUDY_TIERS`` is the mix study v3 and the real-model demo train on, chosen so that the pretrained
  SmolLM2-135M-Instruct starts between 0.1 and 0.6 accuracy (docs/study.md, study v3 validity).
  The split is deterministic in ``(split, n, seed, tiers)`` and train / held-out problems are
  disjoint (the held-out split draws from another seed stream and drops any train duplicate).
- ``compute_score(data_source, solution_str, ground_truth, extra_info)``: 1.0 when the response's
  answer (``extract_answer``: the last ``\\boxed{}``, else the last explicit "the answer is N" /
  "Answer: N", else the last equation's result, else the last number) equals the answer, else
  ``format_score`` (default 0) when the response ends with a number as the instruction asks, else
  0. ``compute_score_format`` is the same with a format credit of 0.2 (study v3's reward).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ["DEFAULT_TIERS", "FORMAT_SCORE", "STUDY_TIERS", "TIERS", "compute_score", "compute_score_format",
           "ends_with_number", "extract_answer", "make_rows", "states_answer", "write_split"]

DATA_SOURCE = "word_problems"
NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Ivy", "Jack", "Lena", "Omar")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards")
#: tier -> number of arithmetic steps (0: a bare sum). Tiers 0 and 1 have single-digit operands.
TIERS = {0: 0, 1: 1, 2: 1, 3: 2, 4: 3}
DEFAULT_TIERS = (2, 3, 4)
STUDY_TIERS = (0, 1)
INSTRUCTION = "Solve the problem. End your answer with the final number."


#: Tier 0's 81 sums, split once: every fifth pair is held out, the other 64 are train's; a split
#: repeats its sums only once each has appeared.
_SUMS = [(a, b) for a in range(1, 10) for b in range(1, 10)]


def _sums(split: str) -> List[tuple]:
    return [p for i, p in enumerate(_SUMS) if (i % 5 == 0) == (split == "test")]


def _sum(rng: random.Random, split: str) -> Dict[str, object]:
    a, b = rng.choice(_sums(split))
    return {"question": f"What is {a} + {b}?", "answer": a + b}


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


def make_rows(split: str, n: int, seed: int = 0, tiers: Sequence[int] = DEFAULT_TIERS,
              exclude: Optional[set] = None) -> List[dict]:
    """``n`` rows of ``split`` ("train" or "test"), tiers dealt round-robin; deterministic.
    ``exclude``: questions (without the instruction) not to produce."""
    if not tiers or set(tiers) - set(TIERS):
        raise ValueError(f"word-problem tiers must be some of {sorted(TIERS)}, got {list(tiers)}")
    rng = random.Random(f"{split}:{seed}")
    rows, seen = [], set(exclude or ())
    sums = {f"What is {a} + {b}?" for a, b in _sums(split)}
    while len(rows) < n:
        tier = tiers[len(rows) % len(tiers)]
        p = _sum(rng, split) if tier == 0 else _problem(rng, TIERS[tier], small=tier == 1)
        if p["question"] in seen and not (tier == 0 and sums <= seen):  # every sum seen: repeat
            continue
        seen.add(p["question"])
        rows.append({"data_source": DATA_SOURCE, "ability": "math",
                     "prompt": [{"role": "user", "content": f"{p['question']} {INSTRUCTION}"}],
                     "reward_model": {"style": "rule", "ground_truth": str(p["answer"])},
                     "extra_info": {"split": split, "index": len(rows), "tier": tier}})
    return rows


def write_split(out_dir, n_train: int = 512, n_test: int = 64, seed: int = 0,
                tiers: Sequence[int] = DEFAULT_TIERS) -> Dict[str, Path]:
    """``train.parquet`` and ``test.parquet`` in ``out_dir`` (disjoint questions, the same tiers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = make_rows("train", n_train, seed, tiers)
    test = make_rows("test", n_test, seed, tiers, exclude={r["prompt"][0]["content"].rsplit(" " + INSTRUCTION, 1)[0]
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


def states_answer(solution_str: str) -> bool:
    """Whether the response states its answer explicitly: a ``\\boxed{}`` or an answer statement
    ("the answer is N", "Answer: N") that holds a number."""
    return any(_NUMBER.search(span) for span in _BOXED.findall(solution_str) + _ANSWER.findall(solution_str))


#: A number at the very end, after which only closing marks may follow ("... is 7.", "\\boxed{7}").
_ENDS_WITH_NUMBER = re.compile(_NUM + r"[\s.!)\]}*$\"'`]*$")


def ends_with_number(solution_str: str) -> bool:
    """Whether the response ends with a number, as the task's instruction asks ("End your answer
    with the final number."); only closing marks (``.``, ``!``, brackets, ``*``, ``$``, quotes)
    may follow it."""
    return bool(_ENDS_WITH_NUMBER.search(solution_str.strip()))


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None,
                  format_score: float = 0.0) -> float:
    """verl's reward signature: 1.0 if the response's answer (``extract_answer``: a ``\\boxed{}``
    one, else an explicit "answer is N", else the last equation's result, else the last number)
    equals ``ground_truth``; else ``format_score`` when the response is in the instruction's format
    (``ends_with_number``: verl's gsm8k scorer credits its format the same way); else 0.0."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    try:
        correct = answer == float(ground_truth)
    except ValueError:
        correct = False
    if correct:
        return 1.0
    return float(format_score) if format_score and ends_with_number(solution_str) else 0.0


#: The format credit of ``compute_score_format`` (verl's gsm8k scorer takes the same ``format_score``).
FORMAT_SCORE = 0.2


def compute_score_format(data_source: str, solution_str: str, ground_truth: str,
                         extra_info: Optional[dict] = None) -> Dict[str, float]:
    """``compute_score`` with ``FORMAT_SCORE`` for a wrong answer in the instruction's format (the
    response ends with a number): study v3's reward (docs/study.md). A config names it as ``megatron_stare.study.word_problems:compute_score_format``.
    Returns verl's dict: ``score``, and ``acc`` (1.0 for a right answer), which the trainer's
    accuracy and held-out avg@k / pass@k count instead of ``score > 0``."""
    score = compute_score(data_source, solution_str, ground_truth, extra_info, format_score=FORMAT_SCORE)
    return {"score": score, "acc": float(score == 1.0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.study.word_problems", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=512)
    ap.add_argument("--test", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiers", type=int, nargs="+", default=list(DEFAULT_TIERS),
                    help=f"tiers dealt round-robin (study v3: {' '.join(map(str, STUDY_TIERS))})")
    a = ap.parse_args(argv)
    for name, path in write_split(a.out_dir, a.train, a.test, a.seed, a.tiers).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
