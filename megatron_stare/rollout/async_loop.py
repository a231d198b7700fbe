"""Bounded-staleness asynchronous training: generation for the next steps overlaps training.

Design
======

Schedule (``trainer.staleness = k``). Policy version ``v`` is the number of steps trained into
the weights the engine serves: version 0 is the initial policy, and the sync after step ``t``
pushes version ``t + 1``. With ``k = 0`` a step generates, then trains (today's on-policy step,
``Trainer.step``): every sample is version ``t`` when step ``t`` trains on it. With ``k >= 1``
``RolloutPipeline`` keeps the batches of steps ``t + 1 .. t + k`` in flight while step ``t``
trains::

    main thread    | take(t) | launch(t+1..t+k) | train t .............. | drain | sync v=t+1 |
    worker thread                     | generate t+1 (HTTP, version t) |

- Only the engine's ``generate`` (HTTP requests to the vllm-server process, which computes on
  its own devices) runs in the worker thread. Everything with a collective - gather, score,
  the log-prob pass, the update, the weight push - stays on the main thread, so no two threads
  ever share a process group. The prompts of a batch are drawn on the main thread when the batch
  is launched (in step order), and its seed depends on its step alone: the same batch whatever
  the timing.
- Weights are pushed at step boundaries only. Before the push the main thread *drains* the
  pipeline (waits for every launched generation), so a request never sees two weight versions
  and a batch launched under version ``v`` is exactly version ``v``. A batch for step ``s`` is
  launched at the latest at step ``s - k`` (under version ``s - k``), so it is never more than
  ``k`` versions old; ``take`` checks this and each sample records its version in
  ``Sample.metadata["policy_version"]``; the step logs ``async/staleness_{mean,max}``.
- The engine stays awake (a server on devices of its own has nothing to release): in
  asynchronous mode the trainer skips the release / resume phases and only pushes weights.
- Timelines: the pipeline records each generation's ``Span`` (start, end: ``time.perf_counter``)
  and the trainer each training phase's; the step logs ``timeline/*`` so a test (and a user) can
  see that they intersect.

Interruption points and partial rollouts (``trainer.partial_rollout_tokens``,
``rollout/partial.py``). The unit of interruption is counted in tokens and steps, never in
wall-clock time: a run with the same seed draws the same prompts, sends the same seeded requests
under the same weight versions and gets the same tokens, however long each phase takes. Without
partial rollouts a batch is generated whole under the version it was launched at. With them a
batch is generated in segments of ``partial_rollout_tokens`` new tokens: a batch in flight gets one
*round* of ``partial_segments_per_version`` segments per version it lives through (in the worker,
launched by ``launch_ahead`` after each push), and ``take`` finishes it inline under the current
version. Its unfinished responses stop at their segment edge, keep their tokens, behaviour
log-probs and per-token versions, and continue under the new weights from ``prompt + prefix``
with a seed derived from (batch seed, segment, response). The prefix's KV cache is *recomputed*
under the new weights (the server resets its prefix cache after every push; the continuation is
a new request): the safe default - keeping a KV cache computed by the old weights would mix
versions inside one token's context. A sample is still at most ``k`` versions old: its oldest
tokens are those of its launch version.

Off-policy correction: the engine's log-probs are the behaviour log-probs of each token (the
version that produced it). TIS (``algorithm.tis_cap``) and the ratio band
(``trainer.ratio_mask_{low,high}``, default ``[0.5, 2]``: ``actor/tis.py``) use them; the
mismatch metrics (``mismatch/*``) then measure staleness plus engine/trainer numerics. STARE's
controller keeps reading the trainer's entropy of the log-prob pass.

Resume: a checkpoint is written at a step boundary after the drain, so no round is running
there: the checkpoint stores the batches in flight (``encode_in_flight``: prompt indices,
version, tokens, behaviour log-probs, per-token versions; an unfinished partial batch's segment
state) together with the sampler state after their draws,
and a resumed run restores them rather than regenerating: regenerating would need the older
weights they were sampled under, which the checkpoint does not hold. With partial rollouts the
same holds for the finished segments (stored with their versions), and the continuation of an
unfinished response is generated after the resume exactly as in the uninterrupted run: its
seed is fixed and its next round runs under the checkpoint's weights in both.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_stare.errors import UserError

__all__ = ["Launched", "RolloutPipeline", "Span", "decode_in_flight", "encode_in_flight", "overlaps",
           "version_metrics"]


@dataclass(frozen=True)
class Span:
    """One timed piece of work of ``step``: ``kind`` ("generate", "train") from ``start`` to
    ``end`` (``time.perf_counter`` seconds); ``version``: the policy version a generation ran
    under."""

    step: int
    kind: str
    start: float
    end: float
    version: Optional[int] = None


def overlaps(a: Span, b: Span) -> bool:
    """Whether two spans intersect in time."""
    return a.start < b.end and b.start < a.end


@dataclass
class Launched:
    """One generation batch in flight (or done): ``draw`` is what ``launch`` drew for it on the
    main thread (prompts, sampling params: opaque here), ``version`` the policy version it was
    launched under (its oldest tokens'), ``results`` the engine's output once ``finished``.

    A batch is generated in rounds, one per policy version it lives through (a whole batch is one
    round; partial rollouts make several): ``work`` is the caller's state between rounds,
    ``spans`` one per round. ``done`` is set while no round is queued or running."""

    step: int
    version: int
    draw: Any
    results: Any = None
    finished: bool = False
    work: Any = None
    error: Optional[BaseException] = None
    spans: List[Span] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.done.set()

    @property
    def span(self) -> Optional[Span]:
        """The latest round's span."""
        return self.spans[-1] if self.spans else None


class RolloutPipeline:
    """Keeps up to ``staleness`` generation batches ahead of the step being trained.

    ``draw(step)``: on the main thread, the batch's prompts and sampling params (advances the
    prompt sampler: called in step order). ``generate(draw)``: the engine call for a whole
    batch, run in the worker thread when ahead (must not call collectives). Or, for batches
    generated over several versions (partial rollouts), ``advance(job, version)``: one round of
    ``job`` under ``version`` (setting ``job.results`` at the end), True once it is finished. A
    batch in flight gets one round per version it lives through; ``take`` runs the rest of it
    inline under the current version. With ``staleness == 0`` nothing runs ahead: ``take``
    draws and generates inline.
    """

    def __init__(self, staleness: int, draw: Callable[[int], Any], generate: Optional[Callable[[Any], Any]] = None,
                 advance: Optional[Callable[[Launched, int], bool]] = None):
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if (generate is None) == (advance is None):
            raise ValueError("RolloutPipeline takes one of generate (whole batches) or advance (rounds)")
        self.staleness = staleness
        self._draw = draw
        self._advance = advance if advance is not None else self._whole(generate)
        self.pending: Dict[int, Launched] = {}
        self._queue: List[Tuple[Launched, int]] = []
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    # ------------------------------------------------------------------ main thread
    def take(self, step: int, version: int) -> Launched:
        """Step ``step``'s batch, finished (launched and generated now under ``version`` when it
        was not ahead). Raises if it is older than ``staleness`` versions."""
        job = self.pending.pop(step, None)
        if job is None:
            job = Launched(step, version, self._draw(step))
        else:
            self._wait(job)
        while job.error is None and not job.finished:  # inline, under the current version
            self._run(job, version)
        if job.error is not None:
            raise job.error
        if version - job.version > self.staleness:
            raise RuntimeError(f"step {step}: its batch is policy version {job.version}, {version - job.version} "
                               f"versions old, beyond trainer.staleness={self.staleness}")
        return job

    def launch_ahead(self, step: int, version: int, end: Optional[int] = None) -> None:
        """Launch, under ``version``, the batches of steps ``step + 1 .. step + staleness`` (below
        ``end``, the run's step count, when given) not launched yet, after giving each unfinished
        batch in flight its round under ``version``; ``step`` is about to train."""
        for s in sorted(self.pending):
            job = self.pending[s]
            if not job.finished and job.error is None and (job.span is None or job.span.version != version):
                self._submit(job, version)
        stop = step + self.staleness + 1 if end is None else min(step + self.staleness + 1, end)
        for s in range(step + 1, stop):
            if s not in self.pending:
                job = Launched(s, version, self._draw(s))
                self.pending[s] = job
                self._submit(job, version)

    def drain(self) -> None:
        """Wait for every launched round (before a weight push or a checkpoint)."""
        for job in list(self.pending.values()):
            self._wait(job)

    def close(self) -> None:
        """Stop the worker: rounds queued but not started are dropped (their batches fail with
        an error if taken), the round running finishes (an engine call cannot be cut)."""
        with self._cv:
            self._closed = True
            for job, _ in self._queue:
                job.error = RuntimeError(f"step {job.step}'s generation was cancelled: the rollout pipeline closed")
                job.done.set()
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ worker
    @staticmethod
    def _whole(generate: Callable[[Any], Any]) -> Callable[[Launched, int], bool]:
        def advance(job: Launched, version: int) -> bool:
            job.results = generate(job.draw)
            return True
        return advance

    def _run(self, job: Launched, version: int) -> None:
        t0 = time.perf_counter()
        try:
            job.finished = bool(self._advance(job, version))
        except BaseException as e:  # handed to the main thread by take()
            job.error = e
        job.spans.append(Span(job.step, "generate", t0, time.perf_counter(), version))
        job.done.set()

    def _submit(self, job: Launched, version: int) -> None:
        with self._cv:
            job.done.clear()
            self._queue.append((job, version))
            self._cv.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="stare-rollout", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        # One worker, jobs in launch order: the engine sees the same requests in the same order.
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job, version = self._queue.pop(0)
            self._run(job, version)

    @staticmethod
    def _wait(job: Launched) -> None:
        job.done.wait()

    # ------------------------------------------------------------------ checkpoints
    def in_flight(self) -> List[Launched]:
        """The batches launched ahead, finished (drained), in step order: what a checkpoint at
        this step boundary stores."""
        self.drain()
        return [self.pending[s] for s in sorted(self.pending)]

    def restore(self, job: Launched) -> None:
        """Put back a batch from a checkpoint (finished with its ``results``, or its ``work`` at
        a round's end: it continues at the next ``launch_ahead`` or ``take``)."""
        if job.step in self.pending:
            raise ValueError(f"step {job.step}'s batch is in flight already")
        job.done.set()
        self.pending[job.step] = job

    def step_metrics(self, step: int, job: Launched, train: Span, t0: float) -> Dict[str, float]:
        """What a step logs (identical on every rank but the ``timeline/*``, each rank's own
        clock, in seconds since ``t0``): its batch's staleness, the batches in flight, and the
        spans of its training and of the generation launched during it."""
        ahead = [s for j in self.pending.values() for s in j.spans if s.version == step]
        out = {"async/staleness": step - job.version, "async/in_flight": len(self.pending),
               "timeline/train_start": train.start - t0, "timeline/train_end": train.end - t0}
        if ahead:
            out.update({"timeline/generate_start": min(s.start for s in ahead) - t0,
                        "timeline/generate_end": max(s.end for s in ahead) - t0})
        return out


def version_metrics(samples, step: int) -> Dict[str, float]:
    """How old the tokens of step ``step``'s samples are, in policy versions: the mean and max
    over response tokens of ``step - version`` (each token's own version with partial rollouts,
    ``metadata["token_versions"]``; else its sample's ``metadata["policy_version"]``), and the
    share of responses whose tokens span several versions."""
    ages: List[int] = []
    spanning = 0
    for s in samples:
        vs = s.metadata.get("token_versions") or [s.metadata["policy_version"]] * len(s.response_ids)
        ages += [step - v for v in vs]
        spanning += len(set(vs)) > 1
    return {"async/token_staleness_mean": sum(ages) / max(len(ages), 1),
            "async/token_staleness_max": max(ages, default=0),
            "async/multi_version_frac": spanning / max(len(samples), 1)}


def encode_in_flight(jobs: List[Launched]) -> List[dict]:
    """Batches in flight at a round's end as JSON-able dicts: step, version, the prompt indices
    of the draw (``draw[0]``), whether it is finished, its results (tokens, float32 behaviour
    log-probs - exact through JSON -, finish reasons, per-token versions; None on a rank that
    does not generate) and, unfinished, its ``work.state_dict()`` (partial rollouts)."""
    return [{"step": j.step, "version": j.version, "indices": [int(i) for i in j.draw[0]], "finished": j.finished,
             "results": None if j.results is None else
             [[r.prompt_index, r.sample_index, list(r.token_ids), r.logprobs.tolist(), r.finish_reason, r.versions]
              for r in j.results],
             "work": None if j.finished or j.work is None else j.work.state_dict()} for j in jobs]


def decode_in_flight(saved: List[dict], draw: Callable[[int, List[int]], Any], keep_results: bool,
                     work: Optional[Callable[[Launched, dict], Any]] = None) -> List[Launched]:
    """``encode_in_flight``'s batches back: ``draw(step, indices)`` rebuilds each draw (without
    advancing the sampler); ``work(job, state)`` an unfinished batch's work. ``keep_results``
    False drops results and work (a rank that does not generate holds none, as in the
    uninterrupted run)."""
    import torch

    from megatron_stare.rollout.base import GenerationResult

    out = []
    for b in saved:
        res = None if b["results"] is None or not keep_results else [
            GenerationResult(p, i, list(t), torch.tensor(lp, dtype=torch.float32), f, *rest)
            for p, i, t, lp, f, *rest in b["results"]]
        job = Launched(int(b["step"]), int(b["version"]), draw(int(b["step"]), b["indices"]), res,
                       finished=bool(b.get("finished", True)))
        if keep_results and not job.finished and b.get("work") is not None:
            if work is None:
                raise UserError(f"step {job.step}'s batch in flight is a partial rollout; resume with the same "
                                 f"trainer.partial_rollout_tokens")
            job.work = work(job, b["work"])
        out.append(job)
    return out
