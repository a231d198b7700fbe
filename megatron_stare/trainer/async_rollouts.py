"""The trainer's side of asynchronous training: ``AsyncRollouts`` runs ``Trainer.fit``'s steps
through the rollout pipeline (``rollout/async_loop.py``, whose design note this follows).

- ``trainer.staleness = 0``: a step is ``Trainer.step`` exactly (the whole rollout inline).
- ``k > 0``: a step takes its batch from the pipeline, draws and launches the next ones (their
  generation runs in the pipeline's worker thread while this step trains), then gathers and
  scores its batch on the main thread (collectives never leave it) and trains
  (``Trainer.finish_step``, which drains the pipeline before the weight push).
- With ``trainer.partial_rollout_tokens`` a batch is generated in token segments
  (``rollout/partial.py``), one round of ``trainer.partial_segments_per_version`` segments per
  policy version it lives through, the rest inline once taken; each token records its version.

The batches in flight are part of a checkpoint (``state`` / the constructor's ``saved``):
finished ones are restored, not regenerated (they were sampled under older weights than the
checkpoint holds); an unfinished partial batch is restored at its segment edge and continues
under the checkpoint's weights exactly as the uninterrupted run did.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Optional, Protocol

from megatron_stare.config.sections import Config
from megatron_stare.errors import UserError
from megatron_stare.runtime.phases import GATHER, SCORE, Phase
from megatron_stare.rollout.base import RolloutEngine
from megatron_stare.rollout.spec import EngineSpec
from megatron_stare.rollout.async_loop import RolloutPipeline, Span, decode_in_flight, encode_in_flight, version_metrics
from megatron_stare.rollout.data_parallel import replica_slice
from megatron_stare.rollout.partial import SegmentedBatch
from megatron_stare.trainer.generation import GroupSelector, ScoredBatch, sampling_params

if TYPE_CHECKING:
    from megatron_stare.rollout.async_loop import Launched

__all__ = ["AsyncRollouts", "SteppedTrainer"]


class SteppedTrainer(Protocol):
    """What the pipeline uses of the trainer (``trainer.loop.Trainer``): its rollout phases, its
    step and the step's second half, and the state a batch is drawn from."""

    cfg: Config
    engine: Optional[RolloutEngine]
    engine_spec: EngineSpec
    version: int
    """Policy versions trained into the engine's weights."""
    sampler: Any
    """The prompt sampler (``data.sampler``): ``next_batch()``."""
    train_set: Any
    """The prompts (``data.prompts``): ``batch(indices)``."""
    phases_run: List[str]

    def step(self, step: int) -> dict: ...

    def rollout(self, step: int) -> Any: ...

    def generate(self, prompts, params) -> Any: ...

    def gather(self, results, num_prompts: int, n: int) -> Any: ...

    def score(self, prompts, results) -> Any: ...

    def finish_step(self, step: int, samples, rollout, t0: float, job=None) -> dict: ...

    def phase(self, p: Phase) -> ContextManager[None]: ...


class AsyncRollouts:
    """Drives ``trainer``'s steps through a ``RolloutPipeline``; ``saved``: the batches in flight
    of the checkpoint the trainer resumed from (``state()`` of the run that wrote it)."""

    def __init__(self, trainer: SteppedTrainer, saved: Optional[List[dict]] = None):

        self.tr = trainer
        t = trainer.cfg.trainer
        self.t_start = time.perf_counter()  # the zero of the logged timelines
        # Staleness 0 never uses its pipeline (``step`` is ``Trainer.step``); it is there for
        # the checks that a checkpoint has no batches in flight.
        self.pipeline = (RolloutPipeline(0, lambda step: step, trainer.rollout) if t.staleness == 0 else
                         RolloutPipeline(t.staleness, self._draw, advance=self._advance_partial)
                         if t.partial_rollout_tokens else
                         RolloutPipeline(t.staleness, self._draw, lambda d: trainer.generate(d[1], d[2])))
        self._restore(saved or [])

    def step(self, step: int) -> dict:
        """One step: with staleness 0 exactly ``Trainer.step``; above 0 the batch comes from the
        pipeline, the next batches generate while this one trains, and the engine stays awake."""
        tr = self.tr
        if self.pipeline.staleness == 0:
            return tr.step(step)
        t0 = time.perf_counter()
        tr.phases_run = []
        job = self.pipeline.take(step, tr.version)
        samples, rollout = self._select(job)
        self.pipeline.launch_ahead(step, tr.version, end=tr.cfg.trainer.total_steps)
        return tr.finish_step(step, samples, rollout, t0=t0, job=job)

    def drain(self) -> None:
        self.pipeline.drain()

    def step_metrics(self, step: int, job: "Launched", samples, train_start: float, train_end: float
                     ) -> Dict[str, float]:
        """The asynchronous step's ``async/*`` and ``timeline/*`` metrics."""

        out = self.pipeline.step_metrics(step, job, Span(step, "train", train_start, train_end), self.t_start)
        out.update(version_metrics(samples, step))
        return out

    def state(self) -> list:
        """The batches in flight at this step boundary, for the checkpoint (JSON: the float32
        log-probs round-trip exactly)."""

        return [] if self.pipeline.staleness == 0 else encode_in_flight(self.pipeline.in_flight())

    def close(self) -> None:
        self.pipeline.close()

    # ------------------------------------------------------------------ internals
    def _restore(self, saved: List[dict]) -> None:

        if saved and self.pipeline.staleness == 0:
            raise UserError(f"the checkpoint holds {len(saved)} generation batch(es) in flight from an "
                             f"asynchronous run; resume it with trainer.staleness >= 1")
        # Results live on the generating ranks only, as in the uninterrupted run.
        work = ((lambda job, state: self._segmented(job.draw, state))
                if self.tr.cfg.trainer.partial_rollout_tokens else None)
        for job in decode_in_flight(saved, self._draw, keep_results=self.tr.engine_spec.devices.generates,
                                    work=work):
            self.pipeline.restore(job)

    def _draw(self, step: int, idx=None):
        """A step's one generation batch, drawn on the main thread in step order (or ``idx``,
        restored from a checkpoint): ``(prompt indices, prompts, params)``, seeded as
        ``Trainer.rollout``'s first batch of ``step``."""
        tr = self.tr
        idx = tr.sampler.next_batch() if idx is None else list(idx)
        seed = (tr.cfg.trainer.seed * 100_003 + step) * 1009
        return idx, tr.train_set.batch(idx), sampling_params(tr.engine_spec.sampling, seed=seed)

    def _segmented(self, draw, state: Optional[dict] = None):
        """A partial-rollout batch of ``draw``: this replica's slice of its prompts, cut in
        segments of ``trainer.partial_rollout_tokens`` (``state``: restored from a checkpoint);
        None on ranks that do not generate."""
        d = self.tr.engine_spec.devices
        if not d.generates:
            return None
        _, prompts, params = draw
        part = replica_slice(len(prompts), d.replica, d.replicas)
        batch = SegmentedBatch([prompts[i].token_ids for i in part], part, params,
                               self.tr.cfg.trainer.partial_rollout_tokens)
        if state is not None:
            batch.load_state_dict(state)
        return batch

    def _advance_partial(self, job: "Launched", version: int) -> bool:
        """One round of a partial-rollout batch under ``version`` (the engine's weights):
        ``trainer.partial_segments_per_version`` segments; True once every response finished."""
        if job.work is None:
            job.work = self._segmented(job.draw)
            if job.work is None:
                return True  # nothing generates here; gather brings the results
        for _ in range(self.tr.cfg.trainer.partial_segments_per_version):
            job.work.advance(self.tr.engine, version)
            if job.work.finished:
                job.results = job.work.results()
                return True
        return False

    def _select(self, job: "Launched"):
        """Phases 2-3 of a pipelined batch on the main thread (their collectives stay here); each
        sample records the policy version it was launched under (its oldest tokens')."""
        tr = self.tr
        _, prompts, params = job.draw
        with tr.phase(GATHER):
            results = tr.gather(job.results, len(prompts), params.n)
        with tr.phase(SCORE):
            shared = tr.score(prompts, results)
        selector = GroupSelector(tr.cfg)
        selector.add(ScoredBatch(prompts, results, shared.scores, params.n, shared.timeouts, shared.crashes,
                                 shared.extras))
        samples, stats = selector.finish()
        for s in samples:
            s.metadata["policy_version"] = job.version
        return samples, stats
