"""Rollout engines: generate responses with engine log-probs; take HF-named weight updates.

``build_engine(name, model_path, **kw)`` constructs a registered engine: ``hf`` (embedded
transformers), ``vllm`` (colocated, in-process), ``vllm-server`` (a separate vLLM OpenAI server,
weights over a process group), ``sglang`` / ``sglang-server`` (GPU only). Engine modules import
their heavy dependencies lazily, so importing this package is cheap.
"""

from .base import ENGINES, GenerationResult, RolloutEngine, SamplingParams, register_engine, sample_seed

__all__ = ["ENGINES", "GenerationResult", "RolloutEngine", "SamplingParams", "build_engine",
           "register_engine", "sample_seed"]


def build_engine(name: str, model_path: str, **kwargs) -> RolloutEngine:
    """Construct the registered engine ``name`` for the HF checkpoint at ``model_path``.

    Lives above the engine modules (they import ``base`` to register themselves); importing
    them here registers every engine, while their heavy dependencies stay lazy inside them.
    """
    from . import hf_engine, sglang_engine, vllm_engine, vllm_server  # noqa: F401 - registers them

    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; choose one of {sorted(ENGINES)}")
    return ENGINES[name](model_path, **kwargs)
