"""Registry of HF architectures this project can map to Megatron (a dict and a decorator).

Each architecture family is a folder of ``models/families/`` (``qwen2``, ``llama``, ``qwen3``,
``qwen3_moe``, ``qwen2_moe``) whose ``__init__.py`` defines a class - the family's spec from an
HF config and its HF <-> Megatron mapping - registered under its HF ``architectures`` names
(``Qwen2ForCausalLM`` ...) and its ``model_type``. ``family_for_config`` picks the family of an
HF ``config.json``; an unknown architecture is one ValueError that names it and lists the
supported ones. ``_ensure_loaded`` imports every family folder (``import_subpackages``), so
adding a family is adding a folder and callers only need this module.
"""

from __future__ import annotations

from typing import Dict, Type

from megatron_stare.config.dotted import import_subpackages

#: HF architecture name or model_type -> family class.
ARCHITECTURES: Dict[str, Type] = {}
#: family name ("qwen2") -> family class.
FAMILIES: Dict[str, Type] = {}

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
    import_subpackages("megatron_stare.models.families")  # each family registers itself on import


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
