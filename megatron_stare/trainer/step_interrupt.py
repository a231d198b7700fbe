"""Preemption inside a step: a signal during the rollout stops it and saves the step's start.

The trainer's state at the start of a step (weights, optimizer, sampler, controller, RNG, the
batches in flight) is unchanged until the step's first optimizer update (phase ``train``). So a
preemption signal during ``generate`` or ``score`` (``runtime/phases.py``) need not wait for the
step to end: the engines stop (``RolloutEngine.interrupted``: the hf engine between decode steps,
the colocated vLLM between engine steps by aborting its requests, its TP ranks agreeing on the
step; the server engines, the colocated ``sglang`` one included, by aborting theirs over HTTP),
scoring stops (the reward pool between responses, an inline reward call from
the signal handler), and the checkpoint of ``step`` (= the steps done) is written from the state
recorded as the step started, exactly as if the signal had come at the boundary; the rerun
regenerates the step as the uninterrupted run did. In any other phase (the update, the weight
sync, which are bounded) the step finishes and the ranks stop at the boundary (``preemption.py``).

Agreement. The ranks leave an interruptible phase together: at its exit every rank all-reduces
(MAX) the signal it knows of, one ``[1]`` int64, so all stop or none does, after the same phase
of the same step. A rank whose generation was cut arrives early; a rank with nothing to
generate (the hf engine lives on rank 0) waits there, as it waited in the gather before. A
signal that reaches only some ranks reaches the others through the rendezvous store within
``RELAY_POLL_S`` (``_Relay``): each rank's relay thread hears its own signals at once (the
interpreter's wakeup fd, written by the C-level handler even while the main thread is blocked in
a collective), publishes the first, and polls for one published elsewhere; so the generating rank
stops within a poll however the signal was delivered, and no rank is left in a collective.

Asynchronous runs (``trainer.staleness > 0``): the gather and scoring of the step's batch stop the
same way (the batches in flight at the step's start are part of the saved state); the
generation ahead runs in the pipeline's thread while the step trains, so a signal then lets the
step finish (its drain included) and saves at the boundary.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from megatron_stare.checkpoint.async_save import BackgroundSaves
from megatron_stare.checkpoint.core import rng_state, set_rng_state
from megatron_stare.config.sections import Config
from megatron_stare.rewards.pool import RewardPool
from megatron_stare.rollout.base import RolloutEngine
from megatron_stare.runtime.parallel import ParallelGroups
from megatron_stare.checkpoint.dist_ckpt import start_writer_results_queue
from megatron_stare.runtime.preemption import PREEMPTION_SIGNALS, Preemption, StepInterrupted, exit_code
from megatron_stare.rollout.async_loop import encode_in_flight
from megatron_stare.runtime.phases import GENERATE, SCORE, Phase

__all__ = ["INTERRUPTIBLE", "RELAY_POLL_S", "InterruptibleTrainer", "StepInterrupts"]

#: The phases a signal stops at once; their exits are the ranks' agreement points.
INTERRUPTIBLE = (GENERATE.name, SCORE.name)
#: How often a rank's relay thread looks for a signal published by another rank (seconds).
RELAY_POLL_S = 0.25


@dataclass
class StepStart:
    """What the checkpoint of ``step`` holds besides the model and optimizer, as the step started."""

    step: int
    trainer_state: Dict[str, Any]
    rng: Dict[str, Any]
    in_flight: list
    """The rollout pipeline's batches (``async_loop.Launched``), encoded only if saved: they do
    not change before the update, and encoding them every step would cost a JSON dump of every
    log-prob in flight."""

    def state(self) -> Dict[str, Any]:
        return {**self.trainer_state, "in_flight": encode_in_flight(self.in_flight) if self.in_flight else []}


class InterruptibleTrainer(Protocol):
    """What the interrupts use of the trainer (``trainer.loop.Trainer``): what a signal must reach
    (engine, reward pool), what a save at the stop needs, and where the run stands."""

    cfg: Config
    preemption: Preemption
    engine: Optional[RolloutEngine]
    pool: RewardPool
    groups: ParallelGroups
    console: Any
    """``trainer.console.Console``: ``preempted(...)``."""
    saves: BackgroundSaves
    rollouts: Any
    """``AsyncRollouts`` (None before ``fit``): runs a step (``step``) and holds its batches in flight."""
    start_step: int
    saved_step: int

    def save(self, step: int, state: Optional[dict] = None) -> None: ...

    def trainer_state(self, step: int) -> dict: ...


class StepInterrupts:
    """One per ``Trainer``: runs each step (``run``), tracks its phases (``phase``), and makes
    the stop decision at the interruptible phases' exits and at the step boundary."""

    def __init__(self, trainer: InterruptibleTrainer) -> None:
        self.tr = trainer
        self.pre: Preemption = trainer.preemption
        self.where = "the set-up"  # what the trainer is doing now, for the console line
        self.heard: Optional[Tuple[str, float, float]] = None
        """Where the first signal (on any rank) found its rank, and when: ``time.monotonic()`` here
        and ``time.time()`` (which the relay carries to the other ranks)."""
        self._armed = False  # inside an interruptible phase
        self._step = -1  # the running step (0-based)
        self.pre.on_signal = self._heard
        if self.pre.received is not None:  # during the set-up, before this existed
            self._heard(self.pre.received)
        if trainer.engine is not None:
            trainer.engine.set_interrupt(self.requested)
        trainer.pool.interrupt = self
        self._relay = _Relay(self)
        if trainer.cfg.checkpoint.dir:
            # The checkpoint writer's results queue is a spawned process, started on a rank's
            # first save (seconds on a busy host): start it now, not in the preemption's save.
            start_writer_results_queue()

    # ------------------------------------------------------------------ what engines ask
    def requested(self) -> bool:
        """True inside an interruptible phase once this rank knows of a signal: stop now. Only
        the main thread is stopped (the rollout pipeline's thread generates while the step
        trains: that generation finishes with the step)."""
        return (self._armed and self.pre.received is not None
                and threading.current_thread() is threading.main_thread())

    @contextmanager
    def raising(self) -> Iterator[None]:
        """Around a call only the signal handler can cut (an inline reward call): inside an
        interruptible phase, a signal raises ``StepInterrupted`` there. A signal that reaches
        another rank only is relayed here without a handler: the call ends first."""
        if not self._armed:
            yield
            return
        if self.requested():
            raise StepInterrupted(self.where)
        self.pre.raise_now = True
        try:
            yield
        finally:
            self.pre.raise_now = False

    # ------------------------------------------------------------------ the trainer's side
    @contextmanager
    def phase(self, p: Phase) -> Iterator[None]:
        """Phase ``p`` of the running step; at an interruptible phase's exit the ranks agree
        whether to stop (a collective: every rank runs the same phases)."""
        armed = p.name in INTERRUPTIBLE
        self.where, self._armed = f"{p.name} of step {self._step + 1}", armed
        cut = False
        try:
            yield
        except StepInterrupted:
            if not armed:
                raise
            cut = True
        finally:
            self._armed = False
        if armed:  # waiting here for the others is still the phase
            self._agree(p.name, cut)
        self.where = f"step {self._step + 1} after its {p.name}"

    def run(self, step: int) -> bool:
        """Run step ``step`` (0-based, ``step`` steps done); True if a signal stopped it inside,
        after its start was saved and the console said so."""
        tr = self.tr
        self._step = step
        rollouts, tr.rollouts = tr.rollouts, None  # trainer_state without the batches in flight
        try:
            state = tr.trainer_state(step)
        finally:
            tr.rollouts = rollouts
        jobs = rollouts.pipeline.in_flight() if rollouts.pipeline.staleness else []
        start = StepStart(step, state, rng_state(), jobs)
        try:
            tr.rollouts.step(step)
        except StepInterrupted as e:
            self._stop(start, e.phase)
            return True
        self.where = f"the end of step {step + 1}"
        return False

    def at_boundary(self, step: int) -> bool:
        """At the boundary after ``step`` steps, collectively: did any rank get a signal? Then
        save the finished step (unless it is saved already) and say so."""
        sig = self.pre.agreed(device=self.tr.groups.device)
        if sig is None:
            return False
        tr, c, t = self.tr, self.tr.cfg.checkpoint, time.monotonic()
        if c.dir and step > tr.saved_step:
            tr.save(step)
        self._say(sig, step, "the step finished", t)
        return True

    def close(self) -> None:
        self._relay.close()
        self.pre.on_signal = None

    # ------------------------------------------------------------------ internals
    def _heard(self, signum: int) -> None:
        # In the signal handler (or the relay thread, which may have set it from another rank's
        # report first): only record.
        if self.heard is None:
            self.heard = (self.where, time.monotonic(), time.time())

    def learned(self, where: str, wall: float) -> None:
        """Another rank's signal, as the relay found it: that rank's phase and clock."""
        if self.heard is None:
            self.heard = (where, time.monotonic() - max(0.0, time.time() - wall), wall)

    def _agree(self, name: str, cut: bool) -> None:
        mine = self.pre.received or (signal.SIGTERM if cut else 0)
        if dist.is_initialized():
            flag = torch.tensor([int(mine)], dtype=torch.int64, device=self.tr.groups.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mine = int(flag.item())
        if mine:
            self.pre.stopped_by = signal.Signals(mine)
            raise StepInterrupted(name)

    def _stop(self, start: StepStart, phase: str) -> None:
        """The ranks agreed to stop inside step ``start.step``: save its start, say so."""
        tr, c, t = self.tr, self.tr.cfg.checkpoint, time.monotonic()
        set_rng_state(start.rng)  # the rollout may have drawn from the global generators
        if c.dir and start.step > tr.saved_step:
            tr.save(start.step, state=start.state())
        self._say(self.pre.stopped_by, start.step, f"{phase} stopped", t)

    def _say(self, sig: signal.Signals, step: int, what: str, stopped_at: float) -> None:
        """Rank 0's line: the phase the signal came in, how long until that phase (or the step)
        ended, how long the save took (a background save is finalized first: async_save.py)."""
        self.tr.saves.wait()
        now = time.monotonic()
        where, t, _ = self.heard or (self.where, stopped_at, 0.0)
        how = (f"signal during {where}: {what} {max(0.0, stopped_at - t):.1f}s after it, "
               f"saved in {now - stopped_at:.1f}s")
        c = self.tr.cfg.checkpoint
        self.tr.console.preempted(sig.name, step, c.dir, self.tr.start_step, exit_code(sig), how=how)


class _Relay:
    """This rank's preemption signals to the rendezvous store, and other ranks' back: a thread
    woken by the interpreter's signal wakeup fd (each handled signal's number, written by the
    C-level handler, so it is heard even while the main thread is blocked in a collective), which
    publishes the first signal under one key (``signum|unix time|phase``) and polls that key
    every ``RELAY_POLL_S``. Without a process group (or a store) it only hears this rank's own
    signals."""

    def __init__(self, owner: StepInterrupts) -> None:
        self.owner, self.pre = owner, owner.pre
        self._closed = threading.Event()
        self._store = None
        if dist.is_initialized():
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except (RuntimeError, ValueError):
                self._store = None
        # One key per launch attempt: torchrun's restarts share the store.
        self._key = f"megatron_stare/preempted/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._r, w = os.pipe()
        os.set_blocking(w, False)
        self._w = w
        try:
            self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: the handler's own record is all there is
            self._old_fd = None
        self._thread = threading.Thread(target=self._loop, name="preemption-relay", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        published = False
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self._r], [], [], RELAY_POLL_S)
                heard = os.read(self._r, 64) if ready else b""
            except (OSError, ValueError):  # closed under us
                return
            for b in heard:
                if b in PREEMPTION_SIGNALS:
                    self.pre.note(b)
            if self._store is None:
                continue
            try:
                if self.pre.received is not None and not published:
                    where, _, wall = self.owner.heard or (self.owner.where, 0.0, time.time())
                    self._store.set(self._key, f"{int(self.pre.received)}|{wall}|{where}")
                    published = True
                elif self.pre.received is None and self._store.check([self._key]):
                    sig, wall, where = self._store.get(self._key).decode().split("|", 2)
                    self.owner.learned(where, float(wall))
                    self.pre.note(int(sig))
            except Exception:  # noqa: BLE001 - the store is gone: the run is ending
                return

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._old_fd is not None:
            try:
                signal.set_wakeup_fd(self._old_fd)
            except ValueError:
                pass
        self._thread.join(2 * RELAY_POLL_S + 1)
        os.close(self._w)
        os.close(self._r)
