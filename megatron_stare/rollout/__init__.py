"""Rollout engines: generate responses with engine log-probs; take HF-named weight updates.

``engine_for_rank(cfg, world)`` is how the trainer gets its engine: it builds the run's
``EngineSpec`` (``spec.py``) and, on a rank that hosts an engine, the engine class's
``from_spec``. Engines, a folder each under ``engines/`` with a light descriptor: ``hf``
(embedded transformers), ``vllm`` (colocated, in-process), ``vllm-server`` (a vLLM OpenAI
server, spawned or attached, weights over a process group), ``sglang`` / ``sglang-server`` (GPU
only). ``build_engine(name, model_path, **kw)`` calls an
in-process engine's constructor directly (tests, benchmarks).

Importing this package (or ``rollout.spec``, ``rollout.engines``) imports no torch: the config
checks read the engines' descriptors and must stay light. The names of ``base.py``
resolve on first use; engine modules import their heavy dependencies lazily too.
"""

from typing import TYPE_CHECKING, Optional, Tuple

from megatron_stare.rollout.engines import descriptors, engine_class
from megatron_stare.rollout.spec import EngineSpec, EngineWorld

if TYPE_CHECKING:
    from megatron_stare.rollout.base import RolloutEngine

_FROM_BASE = ("GenerationResult", "MemoryRelease", "RolloutEngine", "SamplingParams", "sample_seed")


def __getattr__(name: str):
    if name in _FROM_BASE:
        from megatron_stare.rollout import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["EngineSpec", "EngineWorld", "GenerationResult", "MemoryRelease", "RolloutEngine",
           "SamplingParams", "build_engine", "engine_for_rank", "sample_seed"]


def build_engine(name: str, model_path: str, **kwargs) -> "RolloutEngine":
    """Construct the registered in-process engine ``name`` for the HF checkpoint at ``model_path``
    with explicit constructor arguments (the trainer uses ``engine_for_rank`` instead)."""
    if name not in descriptors():
        raise ValueError(f"unknown rollout engine {name!r}; choose one of {sorted(descriptors())}")
    return engine_class(name)(model_path, **kwargs)


def engine_for_rank(cfg, world: EngineWorld) -> Tuple[EngineSpec, Optional["RolloutEngine"]]:
    """``(spec, engine)`` for this rank of a run of ``cfg`` (a ``Config``): the engine is None
    on a rank that hosts none (see ``spec.py`` for the placement of each engine)."""
    spec = EngineSpec.from_config(cfg, world)
    return spec, engine_class(spec.engine).from_spec(spec) if spec.devices.hosts_engine else None
