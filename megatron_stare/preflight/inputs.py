"""The preflight: everything a run reads is checked before a process group exists.

``check_config`` (``preflight/checks.py``) runs it last, when paths are checked (the trainer on
every rank before process-group init, ``python -m megatron_stare.config``, the launch scripts
before torchrun). It reads what it must and builds nothing: headers of the weight files, the
tokenizer, the data rows, a checkpoint's metadata. Each problem is one ``ConfigError`` line
naming the field or file and the fix; a warning (free disk space) is printed by rank 0 only.
In order:

- ``model.path``: an HF directory whose ``config.json`` names a supported causal-LM architecture
  (``models/registry.py``: by ``architectures``, not ``model_type``), whose weight files are
  real safetensors (not git-lfs pointers) holding every tensor of the model at its shape;
- ``model.ref_path`` (with ``algorithm.kl_loss_coef > 0``): the same checks, and the same model;
- the tokenizer of ``model.path``: its files exist, it loads, its ids fit the model's vocabulary;
- the data files and the reward function (``_check_contracts``);
- ``checkpoint.resume``: a training checkpoint (``step_<N>``) of this model;
- ``checkpoint.dir``: a writable directory, or one that can be created; a warning when its file
  system has less room than one checkpoint (weights and optimizer state);
- optional integrations the config asks for import (``wandb`` for ``logging.wandb_project``).

``--dry-run`` (``plan.py``) plans for a machine whose paths this one cannot see and runs none of
this; it prints ``DRY_RUN_SKIPPED``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from safetensors import SafetensorError

from megatron_stare.config.fields import ConfigError
from megatron_stare.config.sections import Config
from megatron_stare.data import DataError, validate_file
from megatron_stare.checkpoint.dist_ckpt import read_meta
from megatron_stare.models.gpt import GPTSpec
from megatron_stare.models.hf_io import INDEX, SINGLE, HFCheckpointReader, check_hf_tensors
from megatron_stare.models.registry import family_for_config
from megatron_stare.models.sizes import param_counts
from megatron_stare.rewards.contract import check_reward_config
from megatron_stare.runtime import notices

__all__ = ["DRY_RUN_SKIPPED", "preflight"]

#: What ``--dry-run`` does not check (it plans for paths on another machine).
DRY_RUN_SKIPPED = ("model weights and tokenizer", "the KL reference model", "data rows", "the reward function",
                   "checkpoint.resume", "checkpoint.dir (writable, free space)", "optional integrations (wandb)")
#: Files one of which an HF tokenizer directory holds.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
#: A git-lfs pointer file starts with this line.
LFS_POINTER = b"version https://git-lfs"
#: GPTSpec fields that may differ between two checkpoints of one model.
_SAME_MODEL_SKIP = {"make_vocab_size_divisible_by", "extra", "max_position_embeddings"}


def _warn(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        notices.say(f"warning: {msg}", err=True)


def _hf_spec(field: str, path: str, make_divisible: int) -> tuple:
    """``(hf_config, GPTSpec)`` of the HF directory ``path`` (the value of ``field``)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{field}: no config.json in {path}; point {field} at an HF model directory "
                          f"(config.json, safetensors weights, tokenizer)")
    try:
        hf = json.loads(cfg_file.read_text(encoding="utf-8"))
        family = family_for_config(hf)
        return hf, family.spec_from_hf(hf, make_vocab_size_divisible_by=make_divisible)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{field}: {cfg_file} cannot be read ({e})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{field}: {cfg_file}: {e}; point {field} at a supported model") from None


def _check_weights(field: str, path: str, hf: dict, spec: GPTSpec) -> None:
    """The weight files are real safetensors (headers read) holding ``spec``'s tensors."""
    d = Path(path)
    for name in [INDEX, SINGLE] + sorted(p.name for p in d.glob("*.safetensors")):
        f = d / name
        if f.is_file() and f.stat().st_size < 1024 and f.read_bytes().startswith(LFS_POINTER):
            raise ConfigError(f"{field}: {f} is a git-lfs pointer, not the weights; run `git lfs pull` in {d} "
                              f"(or download the model with huggingface-cli)")
    try:
        reader = HFCheckpointReader(d)
        shapes = {n: reader.shape(n) for n in reader.names()}
        check_hf_tensors(shapes, family_for_config(hf).mapping(spec).expected_hf_shapes(), str(d))
    except (ValueError, SafetensorError, OSError, KeyError) as e:
        raise ConfigError(f"{field}: {str(e).splitlines()[0]}") from None


def _same_model(saved: GPTSpec, spec: GPTSpec) -> list:
    return [f.name for f in dataclasses.fields(GPTSpec)
            if f.name not in _SAME_MODEL_SKIP and getattr(saved, f.name) != getattr(spec, f.name)]


def _check_tokenizer(path: str, spec: GPTSpec):
    """The tokenizer of ``model.path`` (loaded: the data rows are counted with it)."""
    from transformers import AutoTokenizer  # heavy: imported only when paths are checked

    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"model.path: no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)}); "
                          f"copy the model's tokenizer files into it")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any loader failure is one line naming the directory
        raise ConfigError(f"model.path: the tokenizer in {path} does not load ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if len(tok) > spec.vocab_size:
        raise ConfigError(f"model.path: the tokenizer in {path} has {len(tok)} tokens but the model's vocab_size "
                          f"is {spec.vocab_size} (ids >= {spec.vocab_size} have no embedding row); use the "
                          f"tokenizer the model was trained with")
    return tok


def _check_contracts(cfg: Config, tokenizer) -> None:
    """Every data file parses in its format and has valid rows (schema, empty fields, templated
    prompt length; ``data.validate_file``, streamed); ``reward.fn`` and every ``reward.by_source``
    entry satisfy the reward contract (``rewards.contract.check_reward_config``)."""
    d = cfg.data
    for name in ("train_path", "eval_path"):
        if getattr(d, name) is not None:
            try:
                validate_file(getattr(d, name), d, tokenizer)
            except DataError as e:
                raise ConfigError(f"data.{name}: {str(e).splitlines()[0].removeprefix('data: ')}") from None
    try:
        check_reward_config(cfg.reward)
    except ValueError as e:  # RewardError: one line naming the field
        raise ConfigError(str(e).splitlines()[0]) from None


def _check_resume(resume: str, spec: GPTSpec) -> None:
    d = Path(resume)
    if not (d / "model").is_dir() or not (d / "trainer_state.json").is_file():
        what = "an HF model directory" if (d / "config.json").is_file() else "not a training checkpoint"
        raise ConfigError(f"checkpoint.resume: {d} is {what} (no model/ and trainer_state.json); point it at a "
                          f"checkpoint.dir/step_<N> directory, or start from an HF model with model.path")
    try:
        saved = read_meta(d / "model").gpt_spec()
    except (ValueError, TypeError) as e:
        raise ConfigError(f"checkpoint.resume: {str(e).splitlines()[0]}") from None
    if diff := _same_model(saved, spec):
        raise ConfigError(f"checkpoint.resume: {d} holds another model than model.path ("
                          + ", ".join(f"{k} {getattr(saved, k)!r} vs {getattr(spec, k)!r}" for k in diff)
                          + "); resume a checkpoint of this model")


def _check_checkpoint_dir(cfg: Config, hf: dict) -> None:
    d = Path(cfg.checkpoint.dir)
    existing = next(p for p in (d, *d.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"checkpoint.dir: {existing} is a file, not a directory; choose another checkpoint.dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"checkpoint.dir: {existing} is not writable by this user; choose a writable "
                          f"checkpoint.dir")
    weight_bytes = 2 if cfg.model.dtype == "bfloat16" else 4
    optimizer_bytes = 12 if weight_bytes == 2 else 8  # Adam m, v (+ fp32 master weights for bf16)
    need = param_counts(hf).total * (weight_bytes + optimizer_bytes)
    free = shutil.disk_usage(existing).free
    if free < need:
        _warn(f"checkpoint.dir: {existing} has {free / 2**30:.2f} GiB free, less than one checkpoint "
              f"({need / 2**30:.2f} GiB of weights and optimizer state): saves will fail; free space "
              f"or choose another checkpoint.dir")


def preflight(cfg: Config) -> None:
    """The checks above, one ``ConfigError`` line for the first problem."""
    m, c = cfg.model, cfg.checkpoint
    if m.format == "megatron":
        raise ConfigError("model.format=megatron: start from an HF directory (model.path) and use "
                          "checkpoint.resume for Megatron checkpoints")
    hf, spec = _hf_spec("model.path", m.path, m.make_vocab_size_divisible_by)
    _check_weights("model.path", m.path, hf, spec)
    if m.ref_path is not None and cfg.algorithm.kl_loss_coef > 0:
        _, ref = _hf_spec("model.ref_path", m.ref_path, m.make_vocab_size_divisible_by)
        if diff := _same_model(ref, spec):
            raise ConfigError(f"model.ref_path: {m.ref_path} is another model than model.path ("
                              + ", ".join(f"{k} {getattr(ref, k)!r} vs {getattr(spec, k)!r}" for k in diff)
                              + "); the KL reference must be the same architecture and size")
        _check_weights("model.ref_path", m.ref_path, hf, spec)
    tokenizer = _check_tokenizer(m.path, spec)
    _check_contracts(cfg, tokenizer)
    if c.resume not in ("auto", "never"):
        _check_resume(c.resume, spec)
    if c.dir is not None:
        _check_checkpoint_dir(cfg, hf)
    if cfg.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"logging.wandb_project={cfg.logging.wandb_project!r} needs wandb: pip install wandb "
                          f"(or set logging.wandb_project=null)")
