"""Rollout engines, one folder each, found by the folder: ``engines/<name>/__init__.py`` holds the
engine's light descriptor (``ENGINE = EngineDescriptor(...)``), the rest of the folder its code.

A descriptor says what the config checks, the planner and the trainer need before an engine is
built, and imports no torch and no engine library:

- ``traits``: where the engine lives and what it can do (``EngineTraits``);
- ``checks``: the engine's own config checks, each ``check(EngineCheck) -> None`` raising one
  ``ConfigError`` line (the generic ones, trait by trait, are in ``preflight/checks.py``);
- ``memory``: the planner's model of its memory on the trainer's GPUs (``EngineMemoryModel``);
- ``implementation``: ``"pkg.module:Class"``, imported only when the engine is built
  (``engine_class``); the class builds itself from an ``EngineSpec`` (``from_spec``);
- ``server_command``: for a server engine, ``"pkg.module:function"`` giving the command that
  starts its server (``python -m megatron_stare.rollout.server_cmd``), and its default port.

``descriptors()`` imports every subpackage of this package (``pkgutil`` over ``__path__``), so
adding an engine is adding a folder; ``rollout.engine`` is checked against them
(``descriptor``). ``tests/unit/test_plugin_folders.py`` registers a toy engine this way.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Literal, Optional, Tuple

from megatron_stare.config.dotted import import_subpackages
from megatron_stare.config.fields import ConfigError

if TYPE_CHECKING:
    from megatron_stare.config.sections import Config

__all__ = ["EngineCheck", "EngineDescriptor", "EngineMemoryModel", "EngineTraits", "descriptor", "descriptors",
           "engine_class", "require"]


@dataclass(frozen=True)
class EngineTraits:
    """What an engine is, independently of the run: where it lives, what it needs."""

    placement: Literal["every_rank", "group_leader", "driver"]
    """``every_rank``: a shard on every trainer rank; ``group_leader``: one engine per group of
    ``rollout.tp`` ranks, held by the group's first rank; ``driver``: a client on rank 0."""
    cuda_only: bool
    """No CPU path (SGLang's wheels need CUDA)."""
    server: bool
    """Generation goes over HTTP to a server process."""
    can_spawn: bool = False
    """Starts its own server when ``rollout.server_urls`` is empty."""
    routed_experts: bool = False
    """Returns each token's routed experts (MoE), for ``rollout.routing_replay=r3``."""
    several_servers: bool = False
    """Balances several ``rollout.server_urls`` behind one client (``rollout/dispatch.py``)."""
    restarts_servers: bool = False
    """Restarts a lost server and re-syncs it (``rollout.max_engine_restarts``)."""
    reports_checksums: bool = True
    """Can report checksums of the weights it received (``rollout.verify_sync=checksums``)."""
    cpu_kv_cache: bool = False
    """On CPU, takes an explicit KV cache size (vLLM-CPU's ``kv_cache_memory_bytes``)."""

    @property
    def colocated(self) -> bool:
        """Runs inside the trainer's ranks (its TP groups tile the world)."""
        return self.placement != "driver"

    def on_trainer_gpus(self, server_urls) -> bool:
        """Whether it holds memory on the trainer's GPUs: in a trainer process, or a server the
        driver spawns there (an attached server runs on GPUs of its own)."""
        return not self.server or (self.can_spawn and not server_urls)


@dataclass(frozen=True)
class EngineMemoryModel:
    """How the planner (``plan/planner.py``) models the engine on the trainer's GPUs."""

    kind: Literal["budgeted", "whole_copy"]
    """``budgeted``: takes ``rollout.gpu_memory_utilization`` of each GPU for bf16 weights split by
    ``rollout.tp``, a workspace, and a KV cache pool of the rest (vLLM, SGLang); ``whole_copy``:
    one full copy of the policy in its dtype on one GPU, with the KV cache of the whole batch,
    moved to host memory when released (the embedded hf engine)."""
    ipc_context_per_tp_rank: bool = False
    """Every TP rank but the first maps the weight buckets on its leader's GPU and keeps a CUDA
    context there (SGLang colocated)."""


@dataclass(frozen=True)
class EngineCheck:
    """What an engine's config check sees."""

    cfg: "Config"
    cuda: bool
    world_size: Optional[int]
    """Ranks of the run; None when the check runs without a layout."""
    model: object = None
    """The policy's ``GPTSpec`` when its shape is known, else None."""


@dataclass(frozen=True)
class EngineDescriptor:
    """One engine, as its folder declares it (see the module docstring)."""

    name: str
    """``rollout.engine``."""
    summary: str
    traits: EngineTraits
    memory: EngineMemoryModel
    implementation: str
    """``"pkg.module:Class"``: the ``RolloutEngine`` subclass, imported on ``engine_class``."""
    checks: Tuple[Callable[[EngineCheck], None], ...] = ()
    server_command: Optional[str] = None
    """Server engines: ``"pkg.module:function"``, ``function(spec, host, port) -> ServerCommand``."""
    default_port: int = 0


def require(ok: bool, msg: str) -> None:
    """A check's one line: ``ConfigError(msg)`` unless ``ok``."""
    if not ok:
        raise ConfigError(msg)


_FOUND: Dict[str, EngineDescriptor] = {}


def descriptors(refresh: bool = False) -> Dict[str, EngineDescriptor]:
    """name -> descriptor of every engine folder, CPU engines first (then in-process first)."""
    if _FOUND and not refresh:
        return _FOUND
    found: Dict[str, EngineDescriptor] = {}
    for module in import_subpackages(__name__):
        d = getattr(module, "ENGINE", None)
        if not isinstance(d, EngineDescriptor):
            raise ImportError(f"{module.__name__} is an engine folder without an ENGINE = EngineDescriptor(...)")
        if d.name in found:
            raise ImportError(f"rollout engine {d.name!r} is declared twice ({module.__name__})")
        found[d.name] = d
    _FOUND.clear()
    _FOUND.update(sorted(found.items(), key=lambda kv: (kv[1].traits.cuda_only, kv[1].traits.server, kv[0])))
    return _FOUND


def descriptor(name: str) -> EngineDescriptor:
    """The descriptor of ``rollout.engine=name``; one ``ConfigError`` line naming the choices."""
    found = descriptors()
    if name not in found:
        raise ConfigError(f"rollout.engine must be one of {', '.join(map(repr, found))}, got {name!r} "
                          f"(an engine is a folder of megatron_stare/rollout/engines/)")
    return found[name]


def engine_class(name: str) -> type:
    """The engine's class, a ``rollout.base.RolloutEngine``: imports its implementation (and with it
    torch or the engine library)."""
    d = descriptor(name)
    module, _, attr = d.implementation.partition(":")
    return getattr(importlib.import_module(module), attr)
