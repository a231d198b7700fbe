"""Rollout engines: generate responses with engine log-probs; take HF-named weight updates.

``build_engine(name, model_path, **kw)`` constructs a registered engine: ``hf`` (embedded
transformers), ``vllm`` (colocated, in-process), ``vllm-server`` (a separate vLLM OpenAI server,
weights over a process group), ``sglang`` / ``sglang-server`` (GPU only). Engine modules import
their heavy dependencies lazily, so importing this package is cheap.
"""

from .base import (ENGINES, GenerationResult, RolloutEngine, SamplingParams, build_engine,
                   register_engine, sample_seed)

__all__ = ["ENGINES", "GenerationResult", "RolloutEngine", "SamplingParams", "build_engine",
           "register_engine", "sample_seed"]

_MODULES = ("hf_engine", "vllm_engine", "vllm_server", "sglang_engine")


def _load_all() -> None:
    """Import every engine module so its ``@register_engine`` runs."""
    import importlib

    for m in _MODULES:
        importlib.import_module(f"{__name__}.{m}")
