"""The trainer's memory leaves the device while a colocated engine generates (``trainer.offload``).

Levels (``trainer.offload``):

- ``none``: everything stays resident (the default).
- ``optimizer``: the DDP gradient buffers (fp32, 4 bytes per parameter), the optimizer's fp32
  main params (bf16 models: 4 bytes per parameter, /dp*cp with the distributed optimizer) and
  Adam's moments (8 bytes per parameter, same sharding) leave the device. Cost per step: one
  device-to-host and one host-to-device copy of the main params and moments (the gradients are
  dropped, not copied: every update starts with ``zero_grad_buffer``), and pinned host memory of
  that size, held for the run.
- ``all``: also the model's parameters (bf16 or fp32; Megatron DDP's contiguous param buffer
  with the distributed optimizer, else each parameter) and a KL reference model's. The engine
  generates from its own weights, so nothing of the trainer is needed until the log-prob pass.
  Cost: a further copy each way of the weights, and their size in pinned host memory.

How: the unit moved is a tensor's *storage*. Megatron's param and grad buffers, their buckets,
``param.main_grad`` and the distributed optimizer's shard views all alias a few large storages;
moving a storage's bytes to a host buffer and ``resize_(0)``-ing the storage releases the
memory while every view stays valid, and ``resize_`` back plus a copy restores it bit-exact
(megatron-core's ``_ParamAndGradBuffer.offload_to_cpu`` does the same). On CUDA the host
buffers are pinned and the device allocator's cache is emptied after the offload, so the engine
can take the memory; on CPU the same code path copies host to host and really frees the
original allocation. ``torch_memory_saver`` (slime, verl) is not used: this plain move needs no
extra package and works everywhere.

Phases (``runtime/phases.py``): ``offload`` after the weight sync (before the engine restores
its KV cache), ``onload`` after the engine released its memory (before the log-prob pass).
``Handover`` runs that order, for a step and outside it (a resume, the first sync, a checkpoint
save or HF export: ``Handover.trainer_turn``): the engine releases, the state comes back for the work, the engine's weights are
restored and re-synced, the state leaves, the KV cache returns. So the engine is never awake
while the state that leaves is resident, and its memory fraction may count on the freed bytes
(the trainer offloads before the engine starts, which sizes its memory from what is free).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, Iterator, List, Literal, Optional, Tuple

import torch

from megatron_stare.rollout.base import RolloutEngine
from megatron_stare.runtime.phases import OFFLOAD, ONLOAD, RELEASE, RESUME_KV, RESUME_WEIGHTS, SYNC, Phase

__all__ = ["OFFLOAD_LEVELS", "Handover", "Offloader", "StorageMove"]

OFFLOAD_LEVELS = ("none", "optimizer", "all")
Level = Literal["none", "optimizer", "all"]


@dataclass
class StorageMove:
    """One storage that leaves the device: its owner and size, its host copy (None: dropped)."""

    storage: torch.UntypedStorage
    nbytes: int
    kind: str
    """``grads`` (dropped, zeroed on return), ``optimizer`` (main params, moments) or ``params``."""
    host: torch.Tensor = None
    """``[nbytes]`` uint8 host buffer (pinned on CUDA), reused every step; None for ``grads``."""


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A ``[nbytes]`` uint8 tensor over ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _sub_optimizers(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", [optimizer])


@dataclass
class Offloader:
    """Moves the actor's state (at ``level``) off the device and back. ``offload`` and
    ``onload`` are idempotent; ``offloaded_bytes`` is what is off this rank's device now."""

    actor: object
    level: Level = "none"
    moves: List[StorageMove] = field(default_factory=list)
    _hosts: Dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    """Host buffers by storage, kept for the run (pinning is slow; the state's size is fixed)."""

    def __post_init__(self) -> None:
        if self.level not in OFFLOAD_LEVELS:
            raise ValueError(f"trainer.offload={self.level!r}: choose one of {', '.join(OFFLOAD_LEVELS)}")

    # ------------------------------------------------------------------ what moves
    def _collect(self) -> List[StorageMove]:
        """The storages of this level, each once (views alias a few large buffers)."""
        if self.level == "none" or getattr(self.actor, "optimizer", None) is None:
            return []
        seen: Dict[int, StorageMove] = {}

        def add(t, kind: str) -> None:
            if not isinstance(t, torch.Tensor):
                return
            s = t.untyped_storage()
            if s.nbytes() and s._cdata not in seen:  # _cdata: the storage itself (stable across resize_)
                seen[s._cdata] = StorageMove(s, s.nbytes(), kind, self._hosts.get(s._cdata))

        models = [self.actor.module] + ([self.actor.ref] if getattr(self.actor, "ref", None) is not None else [])
        param_ptrs = {p.untyped_storage()._cdata for m in models for p in m.parameters()}
        if self.level == "all":
            for m in models:
                for p in m.parameters():
                    add(p, "params")
        ddp = self.actor.model  # Megatron DDP's contiguous buffers: dense, and the experts' (MoE)
        for buf in list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", [])):
            add(buf.grad_data, "grads")
        for p in self.actor.module.parameters():
            add(getattr(p, "main_grad", None), "grads")
        for opt in _sub_optimizers(self.actor.optimizer):
            inner = opt.optimizer
            for group in inner.param_groups:
                for main in group["params"]:
                    # fp32 models: the main params are the model's (moved with "all" only).
                    if main.untyped_storage()._cdata not in param_ptrs:
                        add(main, "optimizer")
            for state in inner.state.values():
                for v in state.values():
                    add(v, "optimizer")
        return list(seen.values())

    @property
    def offloaded(self) -> bool:
        """Some of the state is off the device now."""
        return any(m.storage.nbytes() == 0 for m in self.moves)

    @property
    def offloaded_bytes(self) -> int:
        """Device bytes off the device now on this rank."""
        return sum(m.nbytes for m in self.moves if m.storage.nbytes() == 0)

    # ------------------------------------------------------------------ moves
    @torch.no_grad()
    def offload(self) -> int:
        """Move this level's state that is on the device off it; returns the bytes freed."""
        if self.level == "none":
            return 0
        still_out = [m for m in self.moves if m.storage.nbytes() == 0]
        fresh = self._collect()  # what is on the device now (Adam's moments appear at the first step)
        cuda = False
        for m in fresh:
            cuda = cuda or m.storage.device.type == "cuda"
            if m.kind != "grads":
                if m.host is None or m.host.numel() != m.nbytes:
                    m.host = torch.empty(m.nbytes, dtype=torch.uint8,
                                         pin_memory=m.storage.device.type == "cuda")
                    self._hosts[m.storage._cdata] = m.host
                m.host.copy_(_bytes_view(m.storage), non_blocking=True)
        if cuda:
            torch.cuda.synchronize()  # the copies are done before their source is freed
        for m in fresh:
            m.storage.resize_(0)
        if cuda:
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver (the engine's)
        self.moves = still_out + fresh
        return sum(m.nbytes for m in fresh)

    @torch.no_grad()
    def onload(self, kinds: Optional[Tuple[str, ...]] = None) -> None:
        """Bring the moved storages (of ``kinds``; None: all) back: the same bytes, gradient
        buffers zeroed."""
        cuda = False
        for m in self.moves:
            if m.storage.nbytes() or (kinds is not None and m.kind not in kinds):
                continue
            m.storage.resize_(m.nbytes)
            view = _bytes_view(m.storage)
            cuda = cuda or view.is_cuda
            if m.host is None:
                view.zero_()
            else:
                view.copy_(m.host, non_blocking=True)
        if cuda:
            torch.cuda.synchronize()

    @contextmanager
    def resident(self, kinds: Optional[Tuple[str, ...]] = None) -> Iterator[None]:
        """The state (of ``kinds``; None: all) on the device for the block (a save, a resume,
        the first sync: ``("params",)``), offloaded again after it if any was offloaded before."""
        was = self.offloaded
        self.onload(kinds)
        try:
            yield
        finally:
            if was:
                self.offload()

    def host_bytes(self) -> int:
        """Bytes of the host copies (pinned on CUDA)."""
        return sum(m.host.numel() for m in self.moves if m.host is not None)


def _untimed(phase: Phase) -> ContextManager[None]:
    return nullcontext()


@dataclass
class Handover:
    """The engine <-> trainer handover around the trainer's work, in the order of
    ``runtime/phases.py`` (release, onload, the work, resume_w, sync, offload, resume_kv): the
    one place that order is spelled out, for a step (``around``, phase by phase, timed) and for
    work outside a step (``trainer_turn``).

    What it needs of the trainer is this, not the trainer: its engine on this rank (None: none),
    its ``Offloader``, the weight sync, and how a phase is timed and watched (``phase``)."""

    engine: Optional[RolloutEngine]
    offload: "Offloader"
    sync: Callable[[], None]
    """Streams the trainer's weights into the engine (every rank: a collective)."""
    phase: Callable[[Phase], ContextManager[None]] = _untimed

    @contextmanager
    def around(self, kinds: Optional[Tuple[str, ...]] = None, *, timed: bool = True, engine_sleeps: bool = True,
               on_device: Callable[[], None] = lambda: None,
               before_sync: Callable[[], None] = lambda: None) -> Iterator[None]:
        """Phases 4-5 before the block (the trainer's work: ``train``), 7-10 after it, each in
        ``self.phase`` when ``timed`` (a step's). ``engine_sleeps``: False for an engine that
        generates through the step (asynchronous); ``on_device``: once the state is back (a
        deferred probe); ``before_sync``: after the engine's weights are back (the pipeline
        drains there)."""
        eng = self.engine if engine_sleeps else None
        phase = self.phase if timed else _untimed
        with phase(RELEASE):
            if eng is not None:
                eng.release_memory()
        with phase(ONLOAD):
            self.offload.onload(kinds)
            on_device()
        yield
        with phase(RESUME_WEIGHTS):
            if eng is not None:
                eng.resume_weights()  # an engine may lose its weights while released: re-synced next
        before_sync()
        with phase(SYNC):
            self.sync()
        with phase(OFFLOAD):
            self.offload.offload()
        with phase(RESUME_KV):
            if eng is not None:
                eng.resume_kv_cache()  # sized from what the weights and the offload leave

    @contextmanager
    def trainer_turn(self, kinds: Optional[Tuple[str, ...]] = None, sync: bool = False) -> Iterator[None]:
        """Work outside the step that needs the offloaded state (``kinds``; None: all) on the
        device (a resume, a save, an HF export, the first sync): with offload, the step's
        handover around it (the engine's weights re-synced after it); without, just the block
        (then a sync if ``sync``)."""
        if self.offload.level == "none":
            yield
            if sync:
                self.sync()
            return
        with self.around(kinds, timed=False):
            yield

    def first_sync(self) -> None:
        """The run's first weight sync (the engine serves the trainer's initial or resumed
        weights), with only the parameters back on the device."""
        with self.trainer_turn(("params",), sync=True):
            pass
