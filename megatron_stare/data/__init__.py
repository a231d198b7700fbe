"""Prompt datasets: readers, row checks and templating, the sampler, and a preparation command.

- ``readers.py``: JSONL / JSON, Parquet and Arrow dataset directories (``datasets``'
  ``save_to_disk``), streamed; a file unreadable in its format is one ``DataError`` line.
- ``prompts.py``: ``load_prompts`` (rows -> validated, chat-templated, tokenized ``Prompt``s)
  and ``validate_file`` (the same checks, nothing kept: for a preflight without the model).
- ``sampler.py``: ``PromptSampler`` (the global batch of indices per step, resumable) and
  ``shard_for_rank``.
- ``prepare.py``: ``python -m megatron_stare.data.prepare --format gsm8k|math|dapo|aime IN OUT``
  writes verl's format from the files users have.

The schema (verl's): ``prompt`` a string or chat messages, ``reward_model.ground_truth`` (or
``answer``) the reference answer, and any other columns (``data_source``, ``ability``,
``extra_info``) passed to the reward as ``metadata``.
"""

from typing import Any, Optional, Tuple

from megatron_stare.config.sections import DataConfig
from megatron_stare.data.prompts import (SKIP_REPORT, DataReport, Prompt, PromptDataset, apply_template, get_key,
                                         load_prompts, tokenize, validate_file)
from megatron_stare.data.readers import DataError, read_rows
from megatron_stare.data.sampler import PromptSampler, shard_for_rank

__all__ = ["SKIP_REPORT", "DataError", "DataReport", "Prompt", "PromptDataset", "PromptSampler", "apply_template",
           "get_key", "load_prompts", "load_run_data", "read_rows", "shard_for_rank", "tokenize", "validate_file"]


def load_run_data(cfg: DataConfig, prompts_per_step: int,
                  tokenizer: Any) -> Tuple[PromptDataset, Optional[PromptDataset], PromptSampler]:
    """A run's ``(train set, eval set or None, sampler)``: both files loaded with ``cfg``'s
    checks and template, the sampler over the train set (the same on every DP rank)."""
    train = load_prompts(cfg.train_path, cfg, tokenizer)
    ev = load_prompts(cfg.eval_path, cfg, tokenizer) if cfg.eval_path else None
    return train, ev, PromptSampler(len(train), prompts_per_step, seed=cfg.seed, shuffle=cfg.shuffle)
