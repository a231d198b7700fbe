"""Prepare a math dataset as users have it on disk into verl's format::

    python -m megatron_stare.data.prepare --format gsm8k|math|dapo|aime IN OUT.parquet

``IN`` is a ``.jsonl`` / ``.json`` / ``.parquet`` file or an Arrow directory written by
``datasets``' ``save_to_disk``. ``OUT`` (``.parquet``, or ``.jsonl``) has verl's columns, so
both this project and verl read it::

    prompt        [{"role": "user", "content": problem + instruction}]
    reward_model  {"style": "rule", "ground_truth": "<final answer>"}
    data_source   e.g. "openai/gsm8k" (``--data-source`` overrides; ``reward.by_source`` routes on it)
    ability       "math"
    extra_info    {"split": ..., "index": <row>, ...the row's own fields}

Train on it with ``data.prompt_key=prompt data.answer_key=reward_model.ground_truth``.

Inputs per ``--format``:

- ``gsm8k``: GSM8K's ``question`` and ``answer`` (a worked solution ending in ``#### N``); the
  ground truth is ``N`` without thousands separators; prompt = question + verl's GSM8K
  instruction (final answer after ``####``).
- ``math``: MATH / MATH-500's ``problem`` and ``solution``; the ground truth is MATH-500's
  ``answer`` column when present, else the last ``\\boxed{...}`` of the solution (nested braces
  kept whole); prompt = problem + "output the final answer within \\boxed{}".
- ``dapo``: DAPO-Math-17k as published (already verl's format: ``prompt`` messages and
  ``reward_model.ground_truth``; rows kept as given, a missing ``style``/``ability``/
  ``extra_info`` filled in), or its common raw columns: a ``prompt`` / ``problem`` string with
  ``solution`` / ``answer`` / ``ground_truth`` (open-r1's processed copy), wrapped in DAPO's
  "Answer: $Answer" instruction.
- ``aime``: AIME in verl's format (as DAPO's AIME-2024, kept as given), or the raw columns of the
  common copies: ``problem`` / ``Problem`` / ``question`` with ``answer`` / ``Answer`` (integers
  written as strings), in DAPO's instruction.

A row that lacks the columns, or whose answer cannot be found (no ``####``, no ``\\boxed{}``),
stops the command with its location in one line (``--on-malformed skip`` drops such rows and
says how many).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_stare.data.prompts import describe_columns
from megatron_stare.data.readers import DataError, read_rows
from megatron_stare.rewards.math_verify_reward import extract_boxed

__all__ = ["FORMATS", "prepare", "main"]

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of "
                 "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
                 "{problem}\n\nRemember to put your answer on its own line after \"Answer:\".")

Converted = Tuple[Optional[Dict[str, Any]], Optional[str]]  # (verl row, problem)


def _first(row: Dict[str, Any], keys: Sequence[str]) -> Any:
    for k in keys:
        v = row.get(k)
        if v is not None and (not isinstance(v, str) or v.strip()):
            return v
    return None


def _need(fmt: str, what: str, keys: Sequence[str], row: Dict[str, Any]) -> str:
    return f"--format {fmt} needs {what} ({' or '.join(keys)}); the row has: {describe_columns(row)}"


def _verl_row(source: str, content: str, truth: Any, extra: Dict[str, Any], ability: str = "math") -> Dict[str, Any]:
    return {"data_source": source, "prompt": [{"role": "user", "content": content}], "ability": ability,
            "reward_model": {"style": "rule", "ground_truth": str(truth).strip()}, "extra_info": extra}


def _gsm8k(row: Dict[str, Any], index: int, split: str) -> Converted:
    q, a = row.get("question"), row.get("answer")
    if not isinstance(q, str) or not isinstance(a, str):
        return None, _need("gsm8k", "string columns", ("question", "answer"), row)
    if "####" not in a:
        return None, "the answer has no '#### N' final line"
    truth = a.rsplit("####", 1)[1].strip().replace(",", "")
    if not truth:
        return None, "nothing after '####' in the answer"
    return _verl_row("openai/gsm8k", f"{q} {GSM8K_INSTRUCTION}", truth,
                     {"split": split, "index": index, "answer": a, "question": q}), None


def _math(row: Dict[str, Any], index: int, split: str) -> Converted:
    problem, solution = row.get("problem"), row.get("solution")
    if not isinstance(problem, str):
        return None, _need("math", "a string problem", ("problem",), row)
    truth = _first(row, ("answer",))
    if truth is None:
        if not isinstance(solution, str):
            return None, _need("math", "an answer or a solution with \\boxed{}", ("answer", "solution"), row)
        truth = extract_boxed(solution, max_chars=len(solution))
        if not truth:
            return None, "the solution has no complete \\boxed{...} (and there is no answer column)"
    source = "HuggingFaceH4/MATH-500" if "unique_id" in row or "answer" in row else "DigitalLearningGmbH/MATH-lighteval"
    extra = {"split": split, "index": index, **{k: row[k] for k in ("level", "type", "subject", "unique_id")
                                                   if row.get(k) is not None}}
    return _verl_row(source, f"{problem} {MATH_INSTRUCTION}", truth, extra), None


def _as_verl(row: Dict[str, Any], index: int, split: str, source: str, ability: str) -> Converted:
    """A row already in verl's format, kept as given (missing fields filled in). A string prompt
    becomes one user turn, in DAPO's instruction unless it already asks for "Answer:" (open-r1's
    processed DAPO copy keeps the bare problem in ``prompt``)."""
    rm = row.get("reward_model")
    truth = rm.get("ground_truth") if isinstance(rm, dict) else None
    if truth is None or (isinstance(truth, str) and not truth.strip()):
        return None, "reward_model.ground_truth is missing or empty"
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt if "Answer:" in prompt else DAPO_TEMPLATE.format(problem=prompt)}]
    elif not isinstance(prompt, list):
        return None, f"'prompt' must be a string or a list of chat messages, got {type(prompt).__name__}"
    out = dict(row)
    out["prompt"] = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in prompt]
    out["reward_model"] = {**rm, "style": rm.get("style") or "rule", "ground_truth": str(truth).strip()}
    out.setdefault("data_source", source)
    out["data_source"] = out["data_source"] or source
    out["ability"] = out.get("ability") or ability
    extra = out.get("extra_info")
    out["extra_info"] = extra if isinstance(extra, dict) else {"split": split, "index": index}
    return out, None


def _dapo_like(fmt: str, source: str, problem_keys: Sequence[str], answer_keys: Sequence[str]):
    def convert(row: Dict[str, Any], index: int, split: str) -> Converted:
        if isinstance(row.get("reward_model"), dict) and row.get("prompt") is not None:
            return _as_verl(row, index, split, source, "MATH" if fmt == "dapo" else "math")
        problem, truth = _first(row, problem_keys), _first(row, answer_keys)
        if not isinstance(problem, str):
            return None, _need(fmt, "verl's columns (prompt, reward_model.ground_truth) or a problem",
                               problem_keys, row)
        if truth is None or isinstance(truth, (list, dict, bool)):
            return None, _need(fmt, "an answer", answer_keys, row)
        extra = {"split": split, "index": index}
        if isinstance(row.get("extra_info"), dict):
            extra = {**row["extra_info"], **extra}
        return _verl_row(row.get("data_source") or source, DAPO_TEMPLATE.format(problem=problem), truth, extra,
                         ability="MATH" if fmt == "dapo" else "math"), None
    return convert


#: format -> (row converter, what it reads: for --help).
FORMATS: Dict[str, Callable[[Dict[str, Any], int, str], Converted]] = {
    "gsm8k": _gsm8k,
    "math": _math,
    "dapo": _dapo_like("dapo", "math_dapo", ("prompt", "problem"), ("solution", "answer", "ground_truth")),
    "aime": _dapo_like("aime", "aime", ("problem", "Problem", "question", "prompt"), ("answer", "Answer")),
}


def prepare(fmt: str, src: str, out: str, *, split: str = "train", data_source: Optional[str] = None,
            on_malformed: str = "fail") -> Tuple[int, int]:
    """Convert ``src`` (format ``fmt``) into verl's format at ``out``; ``(rows written, rows
    skipped)``. Raises ``DataError`` (one line) for an unreadable input or a bad row (with
    ``on_malformed='fail'``)."""
    if fmt not in FORMATS:
        raise DataError(f"prepare: unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not out.lower().endswith((".parquet", ".jsonl")):
        raise DataError(f"prepare: the output must be a .parquet (or .jsonl) file, got {out}")
    convert = FORMATS[fmt]
    rows: List[Dict[str, Any]] = []
    bad: List[Tuple[str, str]] = []
    for index, (where, row, problem) in enumerate(read_rows(src)):
        new, problem = (None, problem) if problem else convert(row, index, split)
        if problem:
            bad.append((where, problem))
            if on_malformed == "fail":
                raise DataError(f"{where}: {problem} (--on-malformed skip drops such rows)")
            continue
        if data_source:
            new["data_source"] = data_source
        rows.append(new)
    if not rows:
        first = f"; first: {bad[0][0]}: {bad[0][1]}" if bad else ""
        raise DataError(f"prepare: no rows to write from {src} ({len(bad)} bad{first})")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if out.lower().endswith(".jsonl"):
        with open(out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    else:
        import pyarrow as pa  # lazily, as in readers.py
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out)
    return len(rows), len(bad)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.data.prepare",
                                 description="Write a math dataset in verl's format (see the module docstring).")
    ap.add_argument("--format", required=True, choices=sorted(FORMATS))
    ap.add_argument("input", help=".jsonl / .json / .parquet file or a save_to_disk directory")
    ap.add_argument("output", help="OUT.parquet (or .jsonl)")
    ap.add_argument("--split", default="train", help="extra_info.split of the rows (default: train)")
    ap.add_argument("--data-source", default=None, help="data_source of every row (default: the format's)")
    ap.add_argument("--on-malformed", choices=("fail", "skip"), default="fail")
    args = ap.parse_args(argv)
    try:
        n, skipped = prepare(args.format, args.input, args.output, split=args.split,
                             data_source=args.data_source, on_malformed=args.on_malformed)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"prepare: wrote {n} rows to {args.output}" + (f" ({skipped} bad rows skipped)" if skipped else "")
          + "; train with data.prompt_key=prompt data.answer_key=reward_model.ground_truth")
    return 0


if __name__ == "__main__":
    sys.exit(main())
