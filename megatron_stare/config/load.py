"""Typed configuration: one dataclass per concern, loaded from YAML with ``a.b=c`` overrides.

The sections are in ``config_sections`` (every numeric field with its range), the checks in
``config_checks``. ``load_config(path, overrides)`` builds a ``Config`` and checks every key
and type; then ``validate_config(cfg, world_size)`` (``megatron_stare.preflight.checks``) checks ranges and the consistency between
fields (parallel degrees against the world size and the model's shape, lengths, paths that
must exist, features that need CUDA); ``resolve_config`` does both, for the trainer, this CLI
and the dry-run planner alike. Both run before any process group exists, and every problem is
one ``ConfigError`` line that names the field and the fix, e.g.::

    config: unknown key 'optimizer.lrr'; did you mean 'optimizer.lr'?
    config: optimizer.lr must be a float, got 'fast' (str)
    config: algorithm.stare.w must be >= 1 (W amplifies the selected A>0 tokens; ...), got 0.9
    config: parallel.tp=3 does not divide the 4 attention heads; ...

``python -m megatron_stare.config --config X.yaml [a.b=c ...]`` prints the resolved config.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any, Dict, List, Literal, Optional, Sequence

import yaml

from megatron_stare.config.algorithm import AlgorithmConfig
from megatron_stare.config.fields import ConfigError
from megatron_stare.config.yaml_io import read_yaml
from megatron_stare.config.sections import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig,
                                            OptimizerConfig, ParallelConfig, RewardConfig, RolloutConfig,
                                            TrainerConfig)

__all__ = ["AlgorithmConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LoggingConfig",
           "ModelConfig", "OptimizerConfig", "ParallelConfig", "RewardConfig", "RolloutConfig", "TrainerConfig",
           "apply_overrides", "from_dict", "load_config", "to_dict"]


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
        data = read_yaml(path) or {}  # UTF-8, no key twice (config/yaml_io.py)
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return from_dict(Config, apply_overrides(data, overrides))


def to_dict(cfg: Any) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)
