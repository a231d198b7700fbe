"""Test-only launcher: ``python -m megatron_stare.train`` with one fault injected on one rank.

    torchrun ... tests/e2e/_fault_train.py --fault KIND@STEP[:RANK] --config X.yaml [a.b=c ...]

STEP is the 1-based step (as in metrics.jsonl) during which the fault strikes; RANK the global
rank it strikes (default: every rank). Kinds:

- ``kill``: the rank dies like a SIGKILL (a real one) as the step starts (asynchronous runs:
  as its training starts, its batch taken from the rollout pipeline);
- ``kill-in-generate``: the rank's rollout engine takes the rank down mid-rollout (a colocated
  engine's death is its rank's death; the ``hf`` engine lives on rank 0 only);
- ``kill-in-save``: the rank dies inside the step's checkpoint save, at its first file move
  into the ``.partial`` directory (the save was under way and is not finished);
- ``kill-engine-core``: the driver rank's server engine (``vllm-server``) loses its engine-core
  process mid-generation (the step's first generation only): the process is stopped (SIGSTOP)
  before the requests go out and SIGKILLed once they are in flight, so none can finish first;
  the server answers, or dies, for itself;
- ``slow-write``: the step's checkpoint save (``checkpoint.async_save``: in the background) is
  slow: each of megatron-core's writer workers, once it has opened its file, writes an empty file
  ``slow_writer.r<rank>.<pid>`` into ``logging.dir`` and sleeps ``SLOW_WRITE_S`` before writing
  (the test kills the job in that window, deterministically: the write cannot end in it);
- ``sigterm`` / ``sigusr1``: the rank sends itself the signal mid-step (after the rollout, as
  the update starts); the step goes on, and the run must stop at the step boundary.
- ``sigterm-in-generate``: the step's generation is made long (``ignore_eos``,
  ``LONG_NEW_TOKENS`` new tokens, each decode step of the hf engine ``SLOW_DECODE_S`` longer:
  at least ``LONG_NEW_TOKENS * SLOW_DECODE_S`` seconds), and the rank sends itself SIGTERM
  ``SIGNAL_AFTER_S`` after the step's generate phase began (on a rank that does not generate:
  after it went to wait for the one that does); the step must stop at once. The phase is long
  on every rank; RANK only says who is signalled (as for ``sigterm-in-score``).
- ``sigterm-in-score``: the step's reward calls (inline, ``reward.num_workers=0``) each take
  ``SLOW_REWARD_S`` longer, and the rank signals itself ``SIGNAL_AFTER_S`` into its scoring.
- ``sigterm-in-sync``: the rank signals itself as the step's weight sync starts; the sync and
  the step finish, and the run stops at the boundary.
- ``stale-sync``: the step's weight sync does not reach the rank's (colocated or hf) engine's
  embedding: every other tensor arrives, the embedding stays at the previous step's values (a
  stale engine; ``rollout.verify_sync=probe`` must stop the run).

Each signal is announced on stderr as ``[fault] rank R sends SIGTERM at <unix time>`` (the tests
measure the time to exit from it).

``--linger RANK:SECONDS`` makes that rank wait before its process exits, after ``train.main``
returned: a slow shutdown (an engine's teardown), so that the other ranks exit first and
torchrun SIGTERMs this one while it is still alive.

The production trainer knows nothing of this: the fault is a ``Trainer`` subclass, swapped in
before ``train.main`` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import List, Optional, Tuple
from unittest import mock

from megatron_stare import train
from megatron_stare.runtime.preemption import leave

KINDS = ("kill", "kill-in-generate", "kill-in-save", "kill-engine-core", "sigterm", "sigusr1",
         "sigterm-in-generate", "sigterm-in-score", "sigterm-in-sync", "slow-write", "stale-sync")
LONG_NEW_TOKENS, SLOW_DECODE_S = 400, 0.05  # a generation of >= 20 s
SLOW_REWARD_S = 3.0  # 8 responses per rank: >= 24 s of scoring
SIGNAL_AFTER_S = 2.0


def _signal_self(sig=signal.SIGTERM) -> None:
    print(f"[fault] rank {os.environ.get('RANK')} sends {sig.name} at {time.time():.3f}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), sig)


def _signal_later(delay: float) -> None:
    timer = threading.Timer(delay, _signal_self)
    timer.daemon = True
    timer.start()


#: How long a ``slow-write`` writer sleeps before writing its file.
SLOW_WRITE_S = 120.0


def _slow_open(log_dir: str, real_open):
    def slow_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)  # the writer's own set-up first (checkpoint_writer)
        if mode == "wb":
            Path(log_dir, f"slow_writer.r{os.environ.get('RANK')}.{os.getpid()}").touch()
            time.sleep(SLOW_WRITE_S)
        return f

    return slow_open


def _die(*_args, **_kwargs):
    # The time lets a test measure how long the other ranks take to go (nobody may hang).
    print(f"[fault] rank {os.environ.get('RANK')} dies at {time.time():.3f}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _engine_cores() -> List[int]:
    """The pids of this process's descendants that vLLM titled ``VLLM::EngineCore...``."""
    parents = {}
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit():
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    mine, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {c for c, par in parents.items() if par in frontier} - mine
        mine |= frontier
    found = []
    for pid in mine:
        try:
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    if not found:
        raise SystemExit("--fault kill-engine-core: no engine-core process found (rollout.engine=vllm-server?)")
    return found


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def parse_fault(spec: str) -> Tuple[str, int, Optional[int]]:
    kind, _, where = spec.partition("@")
    step, _, rank = where.partition(":")
    if kind not in KINDS or not step.isdigit():
        raise SystemExit(f"--fault: expected KIND@STEP[:RANK] with KIND in {KINDS}, got {spec!r}")
    return kind, int(step), int(rank) if rank else None


class FaultyTrainer(train.Trainer):
    fault: Tuple[str, int, Optional[int]] = ("kill", -1, None)

    def step(self, step: int) -> dict:
        """A synchronous step (``trainer.staleness`` 0)."""
        with self._fault(step, asynchronous=False):
            return super().step(step)

    def finish_step(self, step: int, *args, job=None, **kwargs) -> dict:
        """An asynchronous step's second half (its batch came from the rollout pipeline)."""
        if job is None:  # inside step(): the fault is in place already
            return super().finish_step(step, *args, **kwargs)
        with self._fault(step, asynchronous=True):
            return super().finish_step(step, *args, job=job, **kwargs)

    @contextmanager
    def _fault(self, step: int, asynchronous: bool):
        kind, at, rank = self.fault
        here = rank in (None, self.rank)  # the slow phases below are slow on every rank
        if step + 1 != at or not (here or kind in ("sigterm-in-generate", "sigterm-in-score")):
            yield
            return
        with ExitStack() as stack:
            if kind == "kill":
                _die()
            elif kind == "kill-in-generate":
                if self.engine is None or asynchronous:
                    raise SystemExit(f"--fault {kind}: rank {self.rank} has no rollout engine, or the run is "
                                     f"asynchronous (its generation runs ahead, in the pipeline)")
                stack.enter_context(mock.patch.object(self.engine, "generate", _die))
            elif kind == "kill-engine-core":
                # The fleet's generation (the trainer calls generate_partial when it recovers).
                name = "generate_partial" if hasattr(self.engine, "generate_partial") else "generate"
                generate, fired = getattr(self.engine, name), []

                def kill_when_busy(cores):  # once the server has requests in flight
                    deadline = time.monotonic() + 30
                    while not len(self.engine.servers[0].in_flight) and time.monotonic() < deadline:
                        time.sleep(0.01)
                    time.sleep(0.5)  # the requests reach the (stopped) engine core's queue
                    _signal_all(cores, signal.SIGKILL)
                    print(f"[fault] killed engine core(s) {cores}", file=sys.stderr, flush=True)

                def generate_without_core(*args, **kwargs):
                    if not fired:  # the step's first generation only (not its regeneration)
                        # Stopped before the requests go out, the engine core cannot finish them
                        # before the kill lands (a short generation on a fast machine would).
                        cores = _engine_cores()
                        _signal_all(cores, signal.SIGSTOP)
                        fired.append(threading.Thread(target=kill_when_busy, args=(cores,), daemon=True))
                        fired[0].start()
                    return generate(*args, **kwargs)

                stack.enter_context(mock.patch.object(self.engine, name, generate_without_core))
            elif kind == "slow-write":  # in effect when the save forks its writer, which keeps it
                from megatron.core.dist_checkpointing.strategies import filesystem_async

                from megatron_stare.checkpoint import writer as checkpoint_writer

                checkpoint_writer.install()
                stack.enter_context(mock.patch.object(filesystem_async, "open",
                                                      _slow_open(self.cfg.logging.dir, filesystem_async.open)))
            elif kind == "kill-in-save":
                real = os.replace

                def replace(src, dst, *args, **kwargs):
                    if ".partial" in str(src):
                        _die()
                    return real(src, dst, *args, **kwargs)

                stack.enter_context(mock.patch("os.replace", replace))
            elif kind == "sigterm-in-generate":
                stack.enter_context(self._long_generation(signal_here=here))
            elif kind == "sigterm-in-score":
                fn = self.pool.fn

                def slow_reward(*args, **kwargs):
                    time.sleep(SLOW_REWARD_S)
                    return fn(*args, **kwargs)

                score = self.score

                def signalled_score(*args, **kwargs):
                    _signal_later(SIGNAL_AFTER_S)
                    return score(*args, **kwargs)

                stack.enter_context(mock.patch.object(self.pool, "fn", slow_reward))
                if here:
                    stack.enter_context(mock.patch.object(self, "score", signalled_score))
            elif kind == "stale-sync":
                if self.engine is None:
                    raise SystemExit(f"--fault {kind}: rank {self.rank} has no rollout engine")
                update = self.engine.update_weights

                def without_embedding(named_tensors):
                    return update((n, t) for n, t in named_tensors if "embed_tokens" not in n)

                stack.enter_context(mock.patch.object(self.engine, "update_weights", without_embedding))
            elif kind == "sigterm-in-sync":
                sync = self.sync_weights

                def signalled_sync(*args, **kwargs):
                    _signal_self()
                    return sync(*args, **kwargs)

                stack.enter_context(mock.patch.object(self, "sync_weights", signalled_sync))
            else:
                sig = signal.SIGTERM if kind == "sigterm" else signal.SIGUSR1
                update = self.actor.update

                def signalled_update(*args, **kwargs):
                    os.kill(os.getpid(), sig)
                    return update(*args, **kwargs)

                stack.enter_context(mock.patch.object(self.actor, "update", signalled_update))
            yield


    @contextmanager
    def _long_generation(self, signal_here: bool):
        """This step's generation: long on purpose (see the module docstring); SIGTERM after
        ``SIGNAL_AFTER_S``."""
        with ExitStack() as stack:
            if self.engine is not None:
                generate, forward = self.engine.generate, self.engine.model.forward
                steps = [0]

                def slow_forward(*args, **kwargs):
                    steps[0] += 1
                    time.sleep(SLOW_DECODE_S)
                    return forward(*args, **kwargs)

                def long_generate(prompts, params, **kwargs):
                    try:
                        return generate(prompts, dataclasses.replace(params, max_new_tokens=LONG_NEW_TOKENS,
                                                                     ignore_eos=True), **kwargs)
                    finally:
                        print(f"[fault] rank {self.rank}: {steps[0]} forward passes of {LONG_NEW_TOKENS} run",
                              file=sys.stderr, flush=True)

                stack.enter_context(mock.patch.object(self.engine.model, "forward", slow_forward))
                stack.enter_context(mock.patch.object(self.engine, "generate", long_generate))
            trainer_generate = self.generate

            def signalled_generate(*args, **kwargs):
                _signal_later(SIGNAL_AFTER_S)
                return trainer_generate(*args, **kwargs)

            if signal_here:
                stack.enter_context(mock.patch.object(self, "generate", signalled_generate))
            yield


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--fault", required=True)
    ap.add_argument("--linger", default=None, help="RANK:SECONDS")
    args, rest = ap.parse_known_args(argv)
    FaultyTrainer.fault = parse_fault(args.fault)
    train.Trainer = FaultyTrainer
    code = train.main(rest)
    if args.linger:
        rank, seconds = args.linger.split(":")
        if os.environ.get("RANK") == rank:
            time.sleep(float(seconds))  # a signal handler that returns does not cut it short (PEP 475)
    return code


if __name__ == "__main__":
    sys.exit(leave(main()))  # as python -m megatron_stare.train
