"""The phases of one training step, in order: ONE definition, used by the loop and the planner.

``train.py`` runs them in this order (phases 1-3 repeat while DAPO dynamic sampling asks for
more prompt groups), and ``plan.py`` takes each phase's resident memory from the same list:

1. ``generate``   the engine generates ``n`` responses per prompt;
2. ``gather``     every rank receives the same samples (where data-parallel rollout shards
                  will be gathered);
3. ``score``      each response is scored once, on one rank, and the scores are shared, so
                  every rank makes the same dynamic-sampling decision;
4. ``release``    the engine releases its weights and KV cache at the level it supports;
5. ``onload``     the trainer's offloaded state comes back (``trainer.offload``; else nothing);
6. ``train``      log-prob pass, controller, update;
7. ``resume_w``   the engine restores its weight memory;
8. ``sync``       the trainer's weights stream into the engine;
9. ``offload``    the trainer's state leaves the GPU (``offload.py``; else nothing);
10. ``resume_kv`` the engine restores its KV cache (sized from what the weights leave).

``Phase.trainer_offloaded``: the phases in which the offloaded state is off the GPU (from the
offload to the onload, the first step's included: the trainer offloads before the engine starts).

``EngineMemory`` names what a colocated engine holds in a phase. An engine that cannot
release (vLLM-CPU, the hf engine on CPU) keeps everything in every phase, and says so.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Tuple

__all__ = ["EngineMemory", "PHASES", "Phase", "GENERATE", "GATHER", "SCORE", "RELEASE", "ONLOAD", "TRAIN",
           "RESUME_WEIGHTS", "SYNC", "OFFLOAD", "RESUME_KV"]


class EngineMemory(enum.Enum):
    """A colocated engine's memory in a phase."""

    AWAKE = "weights + KV cache + workspace"
    RELEASED = "released (what a sleeping engine keeps)"
    WEIGHTS = "weights only (KV cache still released)"


@dataclass(frozen=True)
class Phase:
    """One phase of a step: its name, what happens, and what memory it holds."""

    name: str
    what: str
    engine: EngineMemory
    trainer_work: bool = False
    """Activations and logits of the log-prob pass and update are alive."""
    sync_bucket: bool = False
    """One weight-sync bucket is in flight."""
    trainer_offloaded: bool = False
    """The state ``trainer.offload`` moves is off the GPU (with ``trainer.offload=none``: resident)."""


_OFF = dict(trainer_offloaded=True)
GENERATE = Phase("generate", "the engine generates n responses per prompt", EngineMemory.AWAKE, **_OFF)
GATHER = Phase("gather", "every rank receives the same samples", EngineMemory.AWAKE, **_OFF)
SCORE = Phase("score", "each response scored once, scores shared by every rank", EngineMemory.AWAKE, **_OFF)
RELEASE = Phase("release", "the engine releases its weights and KV cache", EngineMemory.RELEASED, **_OFF)
ONLOAD = Phase("onload", "the trainer's offloaded state comes back", EngineMemory.RELEASED)
TRAIN = Phase("train", "log-prob pass, controller, update", EngineMemory.RELEASED, trainer_work=True)
RESUME_WEIGHTS = Phase("resume_w", "the engine restores its weight memory", EngineMemory.WEIGHTS)
SYNC = Phase("sync", "the trainer's weights stream into the engine", EngineMemory.WEIGHTS, sync_bucket=True)
OFFLOAD = Phase("offload", "the trainer's state leaves the GPU", EngineMemory.WEIGHTS)
RESUME_KV = Phase("resume_kv", "the engine restores its KV cache", EngineMemory.AWAKE, **_OFF)

PHASES: Tuple[Phase, ...] = (GENERATE, GATHER, SCORE, RELEASE, ONLOAD, TRAIN, RESUME_WEIGHTS, SYNC, OFFLOAD,
                             RESUME_KV)
"""The step's phases in the order the loop runs them."""
