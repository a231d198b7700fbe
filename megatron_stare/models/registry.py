"""Registry of HF architectures this project can map to Megatron (a dict and a decorator).

Each architecture family (``qwen2``, ``llama``, ``qwen3``, ``qwen3_moe``, ``qwen2_moe``) is a class registered under its HF
``architectures`` names (``Qwen2ForCausalLM`` ...) and its ``model_type``. ``family_for_config``
picks the family of an HF ``config.json``; an unknown architecture is one ValueError that names
it and lists the supported ones. The family modules register themselves on import;
``_ensure_loaded`` imports them so callers only need this module.
"""

from __future__ import annotations

import importlib
from typing import Dict, Type

#: HF architecture name or model_type -> family class.
ARCHITECTURES: Dict[str, Type] = {}
#: family name ("qwen2") -> family class.
FAMILIES: Dict[str, Type] = {}

_FAMILY_MODULES = ("megatron_stare.models.qwen2", "megatron_stare.models.llama",
                   "megatron_stare.models.qwen3", "megatron_stare.models.qwen3_moe",
                   "megatron_stare.models.qwen2_moe")


def register_architecture(family: str, *hf_names: str):
    """Class decorator: register a family under ``family`` and the HF names it handles."""

    def deco(cls):
        cls.family = family
        FAMILIES[family] = cls
        for name in hf_names:
            ARCHITECTURES[name] = cls
        return cls

    return deco


def _ensure_loaded() -> None:
    for mod in _FAMILY_MODULES:
        importlib.import_module(mod)


def family_by_name(name: str):
    """The family class registered as ``name`` (e.g. ``"qwen2"``, stored in ``GPTSpec.architecture``)."""
    _ensure_loaded()
    if name not in FAMILIES:
        raise ValueError(f"unknown architecture family {name!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_for_config(hf_config: dict):
    """The family class of an HF config dict, chosen by ``architectures`` (``model_type`` only
    when a config names no architecture): a ``Qwen2ForSequenceClassification`` or a
    vision-language model shares its ``model_type`` with the causal LM but not its weights."""
    _ensure_loaded()
    archs = list(hf_config.get("architectures") or [])
    names = archs or [hf_config.get("model_type")]
    if "vision_config" not in hf_config:
        for name in names:
            if name in ARCHITECTURES:
                return ARCHITECTURES[name]
    supported = sorted(k for k in ARCHITECTURES if k.endswith("ForCausalLM"))
    kind = " (a vision-language model)" if "vision_config" in hf_config else ""
    raise ValueError(
        f"unsupported HF architecture {archs or hf_config.get('model_type')!r}{kind}; supported: "
        f"{supported} (a causal language model)"
    )
