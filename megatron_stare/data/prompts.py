"""Prompt datasets: rows -> validated, templated, tokenized prompts; ``validate_file`` for preflights.

A row has a prompt (``data.prompt_key``) and a reference answer (``data.answer_key``); either key
may be a dotted path into nested columns (verl's ``reward_model.ground_truth``; a column whose
name contains the dot itself wins). The prompt is a string or a list of chat messages
(``[{"role": "system"|"user"|..., "content": str}, ...]``, verl's format). A string prompt
becomes one user turn (after ``data.system_prompt`` as a system turn, if set) rendered with the
tokenizer's chat template; a message list is rendered with its turns as given. A message list
with ``data.apply_chat_template=false`` or a tokenizer without a chat template is refused (one
``DataError``), never joined into text by a guess. The row's other top-level keys become
``metadata`` as the row gives them (``data_source``, ``extra_info``, ...: rewards see them).

A malformed row - not JSON, not an object, prompt missing / mistyped / empty, answer missing /
not a string or number / empty, prompt longer than ``data.max_prompt_length`` tokens (counted on
the chat-templated text, which is what the model sees) - is reported at its location
(``readers.py``). ``on_malformed='fail'`` raises one ``DataError`` for the first bad row in file
order::

    data: train.jsonl:17: missing key 'answer' (columns: prompt, reward_model{ground_truth, style})

``'skip'`` drops bad rows with one warning that gives their count and first locations.
``load_prompts`` and ``validate_file`` share one pass (``_scan``): same checks, same errors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from megatron_stare.config.sections import DataConfig  # not config: the preflight (under config) reads data
from megatron_stare.data.readers import DataError, read_rows

__all__ = ["DataReport", "Prompt", "PromptDataset", "SKIP_REPORT", "apply_template", "check_row", "describe_columns",
           "get_key", "load_prompts", "tokenize", "validate_file"]

log = logging.getLogger("megatron_stare.data")

#: How many malformed-row locations the 'skip' warning (and ``DataReport.first_bad``) lists.
SKIP_REPORT = 5
#: Rows templated and tokenized at once.
CHUNK_ROWS = 512

Messages = List[Dict[str, Any]]


@dataclass
class Prompt:
    """One validated dataset row."""

    prompt: Union[str, Messages]
    """The raw prompt: text, or the row's chat messages."""
    answer: str
    """The reference answer (numbers converted with ``str``)."""
    metadata: Dict[str, Any]
    """The row's other top-level keys, as the row gives them."""
    text: str
    """What the model sees: the chat-templated prompt, or the raw prompt ('' for messages
    loaded without a tokenizer)."""
    token_ids: List[int]
    """``text`` tokenized (``[]`` when loaded without a tokenizer)."""
    source: str
    """``file:line`` (JSONL) or ``file:row N`` (Parquet, Arrow)."""
    ground_truth: Any = None
    """The answer as the row gives it (a string or a number): what a verl-style reward receives
    as ``ground_truth``. Defaults to ``answer``."""

    def __post_init__(self) -> None:
        if self.ground_truth is None:
            self.ground_truth = self.answer


@dataclass
class DataReport:
    """What ``validate_file`` found in one file."""

    path: str
    num_rows: int
    """Rows read (blank lines not counted)."""
    num_valid: int
    num_bad: int
    first_bad: List[Tuple[str, str]] = field(default_factory=list)
    """``(location, problem)`` of the first ``SKIP_REPORT`` bad rows, in file order."""


class PromptDataset(Sequence[Prompt]):
    """The valid rows of one file, in file order; ``num_skipped`` counts dropped malformed rows."""

    def __init__(self, prompts: List[Prompt], path: str, num_skipped: int = 0):
        self.prompts, self.path, self.num_skipped = prompts, path, num_skipped

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i):
        return self.prompts[i]

    def batch(self, indices: Sequence[int]) -> List[Prompt]:
        return [self.prompts[i] for i in indices]


# ------------------------------------------------------------------------------------------------
_MISSING = object()


def get_key(row: Dict[str, Any], key: str) -> Any:
    """``row[key]``, or the value at dotted path ``key`` in nested dicts; ``_MISSING`` if absent."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _some(keys: List[str], limit: int) -> str:
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def describe_columns(row: Dict[str, Any]) -> str:
    """The row's keys, one level down: ``prompt, reward_model{ground_truth, style}`` (the first
    20 keys, 8 nested ones each)."""
    return _some([f"{k}{{{_some([str(x) for x in v], 8)}}}" if isinstance(v, dict) and v else str(k)
                  for k, v in row.items()], 20)


def _missing(row: Dict[str, Any], key: str, field_name: str) -> str:
    hint = ""
    if field_name == "answer_key" and get_key(row, "reward_model.ground_truth") is not _MISSING:
        hint = "; verl's format: set data.answer_key=reward_model.ground_truth"
    elif field_name == "prompt_key" and any(k in row for k in ("question", "problem")):
        hint = "; raw GSM8K/MATH: python -m megatron_stare.data.prepare --format gsm8k|math IN OUT.parquet"
    return f"missing key {key!r} (data.{field_name}; columns: {describe_columns(row)}){hint}"


def _check_messages(msgs: list, key: str) -> Optional[str]:
    if not msgs:
        return f"{key!r} is an empty list of messages"
    for j, m in enumerate(msgs, 1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            got = sorted(m) if isinstance(m, dict) else type(m).__name__
            return f"{key!r} message {j} must be {{'role': str, 'content': str}}, got {got}"
    if not any(m["content"].strip() for m in msgs):
        return f"{key!r}: every message is empty"
    return None


def check_row(row: Dict[str, Any], cfg: DataConfig) -> Tuple[Optional[str], Any, Any]:
    """``(problem, prompt, answer)``: ``problem`` None for a good row."""
    pk, ak = cfg.prompt_key, cfg.answer_key
    prompt, answer = get_key(row, pk), get_key(row, ak)
    if prompt is _MISSING or prompt is None:
        return _missing(row, pk, "prompt_key"), None, None
    if isinstance(prompt, list):
        problem = _check_messages(prompt, pk)
        if problem:
            return problem, None, None
    elif not isinstance(prompt, str):
        return f"{pk!r} must be a string or a list of chat messages, got {type(prompt).__name__}", None, None
    elif not prompt.strip():
        return f"{pk!r} is empty", None, None
    if answer is _MISSING or answer is None:
        return _missing(row, ak, "answer_key"), None, None
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return f"{ak!r} must be a string or a number, got {type(answer).__name__}", None, None
    if isinstance(answer, str) and not answer.strip():
        return f"{ak!r} is empty", None, None
    return None, prompt, answer


def _has_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def apply_template(prompts: Sequence[Union[str, Messages]], tokenizer: Any, use_template: bool,
                   system_prompt: Optional[str] = None) -> Tuple[List[str], bool]:
    """``(texts, templated)``. With ``use_template`` and a tokenizer that has a chat template:
    each string prompt as one user turn (after ``system_prompt`` as a system turn) and each
    message list as given, plus the generation prompt. Else the raw strings (after
    ``system_prompt`` and a blank line); a message list then raises ``DataError``."""
    templated = use_template and _has_template(tokenizer)
    out: List[str] = []
    for p in prompts:
        if isinstance(p, list):
            if not templated:
                raise DataError(_no_template(use_template, tokenizer))
            out.append(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False))
        elif templated:
            turns = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                [{"role": "user", "content": p}]
            out.append(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
        else:
            out.append(f"{system_prompt}\n\n{p}" if system_prompt else p)
    return out, templated


def _no_template(use_template: bool, tokenizer: Any) -> str:
    why = "data.apply_chat_template=false" if not use_template else "the tokenizer has no chat template"
    return (f"prompts are chat messages, which need a chat template, but {why}; set "
            f"data.apply_chat_template=true with a tokenizer that has a chat_template, or give string prompts")


def tokenize(texts: Sequence[str], tokenizer: Any, templated: bool) -> List[List[int]]:
    """Token ids of ``texts``. A chat template writes its own BOS/special tokens, so they are
    added by the tokenizer only for raw prompts (no doubled BOS)."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if hasattr(backend, "encode_batch_fast"):  # a fast tokenizer: the same ids, without offsets (2x faster)
        return [e.ids for e in backend.encode_batch_fast(list(texts), add_special_tokens=not templated)]
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=not templated)["input_ids"]]


# ------------------------------------------------------------------------------------------------
def _scan(path: str, cfg: DataConfig, tokenizer: Any, keep: bool):
    """One pass over ``path``: ``(prompts, bad, num_rows)``; ``bad`` = ``[(order, location,
    problem)]``. Prompts are built only when ``keep`` (``validate_file`` counts)."""
    prompts: List[Prompt] = []
    bad: List[Tuple[int, str, str]] = []
    chunk: List[Tuple[int, str, Dict[str, Any], Any, Any]] = []
    num_valid = 0
    drop = {cfg.prompt_key, cfg.answer_key}

    def flush() -> None:
        nonlocal num_valid
        if not chunk:
            return
        msgs = [c for c in chunk if isinstance(c[3], list)]
        if msgs and (not cfg.apply_chat_template or (tokenizer is not None and not _has_template(tokenizer))):
            raise DataError(f"{msgs[0][1]}: {_no_template(cfg.apply_chat_template, tokenizer)}")
        if tokenizer is None:  # inspection: raw prompts, no length check
            texts, ids = [c[3] if isinstance(c[3], str) else "" for c in chunk], [[] for _ in chunk]
        else:
            texts, templated = apply_template([c[3] for c in chunk], tokenizer, cfg.apply_chat_template,
                                              cfg.system_prompt)
            ids = tokenize(texts, tokenizer, templated)
        for (k, where, row, prompt, answer), text, tok in zip(chunk, texts, ids):
            if len(tok) > cfg.max_prompt_length:
                bad.append((k, where, f"prompt has {len(tok)} tokens, over data.max_prompt_length="
                                      f"{cfg.max_prompt_length}"))
                continue
            num_valid += 1
            if keep:
                meta = {key: v for key, v in row.items() if key not in drop}
                prompts.append(Prompt(prompt, str(answer), meta, text, tok, where, ground_truth=answer))
        chunk.clear()

    n = 0
    for k, (where, row, problem) in enumerate(read_rows(path)):
        n += 1
        prompt = answer = None
        if problem is None:
            problem, prompt, answer = check_row(row, cfg)
        if problem:
            bad.append((k, where, problem))
            continue
        chunk.append((k, where, row, prompt, answer))
        if len(chunk) >= CHUNK_ROWS:
            flush()
    flush()
    bad.sort()
    if n == 0:
        raise DataError(f"no rows in {path} (empty file)")
    if bad and cfg.on_malformed == "fail":
        _, where, problem = bad[0]
        if num_valid == 0:
            extra = f" (and {len(bad) - 1} more; no row is valid)" if len(bad) > 1 else " (no row is valid)"
        else:
            extra = f" (and {len(bad) - 1} more; data.on_malformed=skip drops them)" if len(bad) > 1 else ""
        raise DataError(f"{where}: {problem}{extra}")
    if num_valid == 0:
        _, where, problem = bad[0]
        raise DataError(f"no valid rows in {path} ({len(bad)} malformed; first: {where}: {problem})")
    return prompts, bad, n


def load_prompts(path: str, cfg: DataConfig, tokenizer: Any = None) -> PromptDataset:
    """Read, validate, template and tokenize ``path`` (see ``readers.py`` for the formats).

    Without a tokenizer the raw prompts are kept, ``token_ids`` are empty and the length limit
    is not checked (inspection, tests).
    """
    prompts, bad, _ = _scan(path, cfg, tokenizer, keep=True)
    if bad:
        first = "; ".join(f"{w}: {p}" for _, w, p in bad[:SKIP_REPORT])
        log.warning("data: skipped %d malformed row(s) of %s: %s%s", len(bad), path, first,
                    "; ..." if len(bad) > SKIP_REPORT else "")
    return PromptDataset(prompts, path, num_skipped=len(bad))


def validate_file(path: str, cfg: DataConfig, tokenizer: Any = None) -> DataReport:
    """Check ``path`` as ``load_prompts`` would, keeping no rows (for a preflight before any
    process group starts; needs no model). With a tokenizer, prompt lengths are counted on the
    chat-templated text. Raises ``DataError`` (one line) when the file cannot be read in its
    format, has no valid row, or has a bad row while ``cfg.on_malformed == 'fail'``."""
    _, bad, n = _scan(path, cfg, tokenizer, keep=False)
    return DataReport(path=path, num_rows=n, num_valid=n - len(bad), num_bad=len(bad),
                      first_bad=[(w, p) for _, w, p in bad[:SKIP_REPORT]])
