"""The trainer's side of a lost rollout server (``engines/vllm_server/fleet.py`` recovers the server itself).

Only the driver rank holds the fleet; a re-sync is collective (every rank exports its shards of
the weights). So after each generation and each weight push, every rank takes part in one small
all-reduce (``agree``) of what the driver's fleet reports:

- ``unfinished``: prompts no live server answered (their servers are back, with stale weights):
  every rank joins a weight sync, then the driver generates those prompts again (their own
  seeds: the answers an uninterrupted run would have got), until none is left;
- ``resync``: a push broke mid-way (a server died or hung in it): push again;
- ``probe``: a server came back since the last probe: the sync probe checks the push that
  reached it (``trainer/sync_probe.py``), whatever ``verify_sync_every`` says;
- ``fatal``: a server was lost past ``rollout.max_engine_restarts``: every rank raises
  ``EngineLost`` (the driver's holds the line), and nothing of the step is saved.

Runs whose generation happens in the rollout pipeline's worker thread (``trainer.staleness`` >
0) cannot hold a collective there: their lost requests are placed on the other servers, and
with none left the generation fails (the rerun resumes from the last checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_stare.rollout.base import GenerationResult
from megatron_stare.rollout.engines.vllm_server.fleet import EngineLost, PartialGeneration, VLLMServerFleet

__all__ = ["Agreement", "EngineRecovery"]


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed the driver's fleet needs (see the module docstring)."""

    unfinished: bool = False
    resync: bool = False
    probe: bool = False
    fatal: bool = False


class EngineRecovery:
    """Args:
        engine: this rank's engine (the fleet on the driver, None elsewhere).
        active: the run's engine is ``vllm-server`` with recovery on (every rank knows it from
            the config; only the driver has the fleet).
        device: where the all-reduce's tensor lives (the trainer's process group's device).
        say: a console line (the driver's fleet's events).
    """

    def __init__(self, engine, active: bool, device: torch.device, say: Callable[[str], None]):
        self.fleet: Optional[VLLMServerFleet] = engine if isinstance(engine, VLLMServerFleet) else None
        self.active, self.device, self.say = active, device, say
        if self.fleet is not None:
            self.fleet.deferred = active

    def new_step(self) -> None:
        if self.fleet is not None:
            self.fleet.new_step()

    def agree(self, unfinished: bool = False, probing: bool = True) -> Agreement:
        """One all-reduce (MAX) over every rank of the driver's flags; the fleet's events are
        said on the way. Raises ``EngineLost`` on every rank when the fleet gave up.
        ``probing``: the caller acts on ``probe`` (the fleet's flag is then cleared)."""
        f = self.fleet
        flags = [unfinished, False, False, False]
        if f is not None:
            for line in f.take_events():
                self.say(line)
            flags[1:] = [f.needs_resync, f.needs_probe, f.fatal is not None]
        t = torch.tensor([float(x) for x in flags], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        a = Agreement(*(bool(x) for x in t.tolist()))
        if a.fatal:
            raise EngineLost(f.fatal if f is not None and f.fatal else "the driver rank's rollout server was lost "
                             "past rollout.max_engine_restarts (its line is on rank 0)")
        if a.probe and probing and f is not None:
            f.needs_probe = False  # the caller probes now (or at the next chance)
        return a

    def generate(self, part: Optional[Sequence[int]], run: Callable[[Sequence[int]], PartialGeneration],
                 resync: Callable[[], None]) -> Optional[List[GenerationResult]]:
        """Generate the batch indices ``part`` with ``run`` (None on ranks that do not
        generate), regenerating what a lost server left unfinished after a collective
        ``resync``; results prompt-major, as ``RolloutEngine.generate`` gives them."""
        done: List[GenerationResult] = []
        todo = list(part) if part is not None else []
        while True:
            if todo:
                got = run(todo)
                done += got.results
                todo = list(got.unfinished)
            if not self.agree(unfinished=bool(todo), probing=False).unfinished:  # the re-sync probes
                break
            resync()
        if part is None:
            return None
        return sorted(done, key=lambda r: (r.prompt_index, r.sample_index))
