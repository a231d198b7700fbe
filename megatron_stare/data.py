"""Prompt datasets: JSONL/Parquet rows -> validated, templated, tokenized prompts; the sampler.

A row has a prompt (``data.prompt_key``) and a reference answer (``data.answer_key``); its other
keys become ``metadata`` (passed to the reward function). A malformed row - not JSON, not an
object, prompt missing / not a string / empty, answer missing / not a string or number, prompt
longer than ``data.max_prompt_length`` tokens (counted on the chat-templated text, which is what
the model sees) - is reported as ``file:line`` (JSONL, 1-based
physical line) or ``file:row N`` (Parquet, 1-based). ``on_malformed='fail'`` raises one
``DataError`` for the first bad row in file order::

    data: train.jsonl:17: missing key 'answer'

``'skip'`` drops bad rows with one warning that gives their count and first locations.

Sampling: every DP rank builds the same ``PromptSampler``; each step it yields the GLOBAL batch of
``prompts_per_step`` dataset indices (so GRPO groups and dynamic sampling see the whole step) and
``shard_for_rank`` hands each rank a contiguous slice (whole prompts, so all ``n`` responses of a
prompt live on one rank). ``state_dict()`` is ``(epoch, position)`` plus what must not change
across a resume; loading it reproduces the exact following batches.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from megatron_stare.config_sections import DataConfig  # not config: the preflight reads data

log = logging.getLogger(__name__)

#: How many malformed-row locations the 'skip' warning lists.
SKIP_REPORT = 5


class DataError(ValueError):
    """A dataset problem; ``str()`` is one line naming the file and row."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"data: {msg}")


@dataclass
class Prompt:
    """One validated dataset row."""

    prompt: str
    """The raw prompt text."""
    answer: str
    """The reference answer (numbers converted with ``str``)."""
    metadata: Dict[str, Any]
    """The row's other keys."""
    text: str
    """What the model sees: the chat-templated prompt, or the raw prompt."""
    token_ids: List[int]
    """``text`` tokenized (``[]`` when loaded without a tokenizer)."""
    source: str
    """``file:line`` (JSONL) or ``file:row N`` (Parquet)."""


def _read_rows(path: str) -> Iterator[Tuple[str, Any, Optional[str]]]:
    """``(location, row, problem)`` for every non-blank row; ``problem`` None if it parsed."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path}:row {i}", row, None
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield where, None, f"not valid JSON ({e.msg} at column {e.colno})"
                continue
            yield where, row, None if isinstance(row, dict) else f"expected a JSON object, got {type(row).__name__}"


def _check_row(row: Dict[str, Any], cfg: DataConfig) -> Optional[str]:
    prompt, answer = row.get(cfg.prompt_key), row.get(cfg.answer_key)
    if prompt is None:
        return f"missing key {cfg.prompt_key!r}"
    if not isinstance(prompt, str):
        return f"{cfg.prompt_key!r} must be a string, got {type(prompt).__name__}"
    if not prompt.strip():
        return f"{cfg.prompt_key!r} is empty"
    if answer is None:
        return f"missing key {cfg.answer_key!r}"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return f"{cfg.answer_key!r} must be a string or a number, got {type(answer).__name__}"
    return None


def apply_template(prompts: Sequence[str], tokenizer: Any, use_template: bool) -> Tuple[List[str], bool]:
    """``(texts, templated)``: each prompt as one user turn + generation prompt when
    ``use_template`` and the tokenizer has a chat template, else the raw prompts."""
    if not (use_template and tokenizer is not None and getattr(tokenizer, "chat_template", None)):
        return list(prompts), False
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=False) for p in prompts], True


def tokenize(texts: Sequence[str], tokenizer: Any, templated: bool) -> List[List[int]]:
    """Token ids of ``texts``. A chat template writes its own BOS/special tokens, so they are
    added by the tokenizer only for raw prompts (no doubled BOS)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=not templated)["input_ids"]]


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


def load_prompts(path: str, cfg: DataConfig, tokenizer: Any = None) -> PromptDataset:
    """Read, validate, template and tokenize ``path`` (``.jsonl``/``.json`` lines or ``.parquet``).

    Without a tokenizer the raw prompts are kept, ``token_ids`` are empty and the length limit
    is not checked (inspection, tests).
    """
    if not os.path.isfile(path):
        raise DataError(f"file not found: {path}")
    good: List[Tuple[int, str, Dict[str, Any]]] = []
    bad: List[Tuple[int, str, str]] = []  # (row order, location, problem)
    for k, (where, row, problem) in enumerate(_read_rows(path)):
        problem = problem or _check_row(row, cfg)
        if problem:
            bad.append((k, where, problem))
        else:
            good.append((k, where, row))
    texts, templated = apply_template([r[cfg.prompt_key] for _, _, r in good], tokenizer, cfg.apply_chat_template)
    ids = tokenize(texts, tokenizer, templated) if tokenizer is not None else [[] for _ in texts]
    prompts = []
    for (k, where, row), text, tok in zip(good, texts, ids):
        if len(tok) > cfg.max_prompt_length:
            bad.append((k, where, f"prompt has {len(tok)} tokens, over data.max_prompt_length={cfg.max_prompt_length}"))
            continue
        meta = {key: v for key, v in row.items() if key not in (cfg.prompt_key, cfg.answer_key)}
        prompts.append(Prompt(row[cfg.prompt_key], str(row[cfg.answer_key]), meta, text, tok, where))
    bad.sort()
    if bad and cfg.on_malformed == "fail":
        _, where, problem = bad[0]
        extra = f" (and {len(bad) - 1} more; data.on_malformed=skip drops them)" if len(bad) > 1 else ""
        raise DataError(f"{where}: {problem}{extra}")
    if bad:
        first = "; ".join(f"{w}: {p}" for _, w, p in bad[:SKIP_REPORT])
        log.warning("data: skipped %d malformed row(s) of %s: %s%s", len(bad), path, first,
                    "; ..." if len(bad) > SKIP_REPORT else "")
    if not prompts:
        raise DataError(f"no valid rows in {path}" + (f" ({len(bad)} malformed)" if bad else ""))
    return PromptDataset(prompts, path, num_skipped=len(bad))


# ------------------------------------------------------------------------------------------------
@dataclass
class PromptSampler:
    """Deterministic global batches of prompt indices, resumable.

    Epoch ``e`` visits every index once, in the order of a permutation drawn from
    ``(seed, e)`` (identity when not ``shuffle``). A batch takes the next ``prompts_per_step``
    indices and continues into the next epoch when the current one runs out, so no prompt is
    dropped (a dataset smaller than a batch repeats prompts within it).
    """

    num_prompts: int
    prompts_per_step: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    """Epoch of the next index to be drawn."""
    position: int = 0
    """Offset of the next index in that epoch's order."""
    _order: Optional[np.ndarray] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.num_prompts < 1 or self.prompts_per_step < 1:
            raise DataError(f"sampler needs >= 1 prompts and prompts_per_step >= 1, got "
                            f"{self.num_prompts} and {self.prompts_per_step}")

    def epoch_order(self, epoch: int) -> np.ndarray:
        """``[num_prompts]`` int64: the visiting order of ``epoch``."""
        if not self.shuffle:
            return np.arange(self.num_prompts, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts).astype(np.int64)

    def next_batch(self) -> List[int]:
        """The next ``prompts_per_step`` dataset indices (the whole step, every DP rank)."""
        out: List[int] = []
        while len(out) < self.prompts_per_step:
            if self._order is None:
                self._order = self.epoch_order(self.epoch)
            take = self._order[self.position:self.position + self.prompts_per_step - len(out)]
            out.extend(int(i) for i in take)
            self.position += len(take)
            if self.position == self.num_prompts:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return out

    def __iter__(self) -> Iterator[List[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_prompts": self.num_prompts,
                "prompts_per_step": self.prompts_per_step, "seed": self.seed, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Resume at ``state``'s cursor; the dataset size, batch size, seed and shuffle must match
        (else the following batches would silently differ from the interrupted run's)."""
        for key in ("num_prompts", "prompts_per_step", "seed", "shuffle"):
            if int(state[key]) != int(getattr(self, key)):
                raise DataError(f"cannot resume the sampler: checkpoint has {key}={state[key]}, this run has "
                                f"{int(getattr(self, key))} (did the dataset, data.on_malformed or the batch "
                                f"size change?)")
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


def shard_for_rank(batch: Sequence[int], dp_rank: int, dp_size: int) -> List[int]:
    """Rank ``dp_rank``'s contiguous slice of a global batch; the slices partition it in order."""
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
    if len(batch) % dp_size:
        raise DataError(f"a batch of {len(batch)} prompts does not split over {dp_size} data-parallel "
                        f"ranks; make trainer.prompts_per_step a multiple of the DP size")
    per = len(batch) // dp_size
    return list(batch[dp_rank * per:(dp_rank + 1) * per])
