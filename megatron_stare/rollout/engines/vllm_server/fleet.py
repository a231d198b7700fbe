"""``vllm-server``: one vLLM server, or several behind the dispatcher (``rollout.server_urls``),
watched and recovered.

``VLLMServerFleet.from_spec`` builds ``vllm_server.VLLMServerEngine`` for a spawned server or
each URL (each checked against the spec), and the fleet is one engine to the trainer:

- generation: each prompt is one request, placed by ``dispatch.Dispatcher`` on the server
  with the least outstanding tokens when a slot of the window (``max_concurrency`` per
  server) frees up, seeded by its batch index (so the answer does not depend on the server);
  results come back in prompt order;
- weights: ONE process group holds the trainer (rank 0) and every worker of every server
  (``weights.open_weight_group``, on ``weight_sync.form_group``), so each bucket is
  broadcast once and reaches all servers; every server then resets its prefix cache;
- checksums: a tensor's checksum is reported only where every server holds the same bytes
  (otherwise None, which the trainer's verification reports as a mismatch);
- memory: a spawned server sleeps while the trainer trains (on a GPU); attached servers run on
  GPUs of their own and release nothing.

Faults (``docs/fault-matrix.md``). While requests run, a watchdog thread asks each busy server
for its generated-token counter (``VLLMServerEngine.progress``) every ``POLL_S``; a server whose
counter stood still for ``request_timeout_s`` is declared hung (killed if spawned, its calls cut).
A server whose call fails (dead process, HTTP 5xx, cut or refused connection) is *lost*:

- its requests are placed again on the live servers (same seeds, so the same answers); with no
  live server left they stay unfinished, and ``generate_partial`` returns them as such;
- it is restarted (spawned: the same command; attached: its URL awaited and checked again) in a
  thread, while the others serve; it then holds the checkpoint's weights, so it is *stale* and
  serves nothing until a push has given it the trainer's, and ``needs_probe`` asks the trainer
  to verify that push with its sync probe;
- the weight group loses a member, so it is formed again before the next push; a push that
  breaks (a server died or hung mid-push) leaves every server with a mix of versions:
  ``needs_resync`` asks the trainer to push again, once the lost server is back;
- restarts are bounded by ``max_restarts`` over the run and ``max_restarts_per_step`` in a step
  (``new_step``); past either, ``fatal`` holds the one line that ends the run (the engine, pid,
  URL, what happened, its log file) and the fleet stops recovering.

With ``max_restarts`` 0 there is no recovery: the first failure is raised as it is. A push that
breaks raises its failure (after marking the server lost), unless ``deferred`` (the trainer's
``rollout/recovery.py`` reads the flags on every rank instead).
``generate`` (the plain engine interface, used by the probe and tests) raises the first failure
whenever a request is left unfinished.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from torch import Tensor

from megatron_stare.weight_sync import SyncStats, TensorChecksum
from megatron_stare.rollout.base import GenerationResult, MemoryRelease, RolloutEngine, SamplingParams, batch_indices
from megatron_stare.rollout.dispatch import UNFINISHED, BackendLost, Dispatcher, DispatchStats
from megatron_stare.rollout.http import EngineFailure
from megatron_stare.rollout.spec import EngineSpec, RecoveryLimits
from megatron_stare.rollout.engines.vllm_server.server import VLLMServerEngine
from megatron_stare.rollout.engines.vllm_server.weights import open_weight_group, push_weights

__all__ = ["EngineLost", "PartialGeneration", "VLLMServerFleet"]

log = logging.getLogger(__name__)

#: How often the watchdog reads a busy server's token counter, seconds (at most).
POLL_S = 2.0


class EngineLost(EngineFailure):
    """A server was lost past ``rollout.max_engine_restarts``: the run ends (one line, exit 1)."""


@dataclass
class PartialGeneration:
    """What ``generate_partial`` got: the finished prompts' results (prompt-major within each
    prompt) and the batch indices of the prompts no live server answered."""

    results: List[GenerationResult] = field(default_factory=list)
    unfinished: List[int] = field(default_factory=list)


class _Watchdog:
    """While a generation runs: every ``poll_s``, each server with calls in flight is asked for
    its token counter; one that did not advance for ``timeout_s`` is declared hung."""

    def __init__(self, servers: Sequence[VLLMServerEngine], timeout_s: float, on_hung: Callable[[int], None]):
        self.servers, self.timeout_s, self.on_hung = servers, timeout_s, on_hung
        self.poll_s = min(POLL_S, timeout_s / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stare-server-watchdog", daemon=True)

    def __enter__(self) -> "_Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        now = time.monotonic()
        last: Dict[int, Tuple[Optional[float], float]] = {b: (None, now) for b in range(len(self.servers))}
        while not self._stop.wait(self.poll_s):
            for b, s in enumerate(self.servers):
                if s.hung is not None:
                    continue
                now = time.monotonic()
                if not len(s.in_flight):
                    last[b] = (last[b][0], now)  # idle is not stuck
                    continue
                count = s.progress()
                seen, since = last[b]
                if count is not None and count != seen:
                    last[b] = (count, now)
                elif now - since >= self.timeout_s:
                    s.declare_hung(f"made no tokens for {now - since:.0f}s with {len(s.in_flight)} request(s) in "
                                   f"flight (rollout.request_timeout_s={self.timeout_s:g}); declared hung")
                    self.on_hung(b)


class VLLMServerFleet(RolloutEngine):
    """vLLM servers as one engine (see the module docstring).

    Args:
        servers: ``VLLMServerEngine`` clients, spawned or attached (the fleet shuts them down).
        policy: the dispatcher's placement policy (``least_work``; ``round_robin`` for tests).
        window_per_server: requests in flight per server (the dispatcher's window is this
            times the number of servers).
        limits: timeouts and restart bounds (``rollout.*``).
    """

    name = "vllm-server"

    def __init__(self, servers: Sequence[VLLMServerEngine], *, policy: str = "least_work",
                 window_per_server: Optional[int] = None, limits: RecoveryLimits = RecoveryLimits()):
        if len(servers) < 1:
            raise ValueError("a vllm-server fleet needs at least one server")
        self.servers = list(servers)
        first = self.servers[0]
        self.weight_backend, self.sync_timeout_s = first.weight_backend, first.sync_timeout_s
        self.record_checksums = first.record_checksums
        self.host = first.host
        per = window_per_server or first.max_concurrency
        self.dispatcher = Dispatcher(len(self.servers), window=per * len(self.servers), policy=policy)
        self.limits = limits
        self._group = None
        self.last_sync: Optional[SyncStats] = None
        self._lock = threading.Lock()
        self.down: Set[int] = set()  # lost: restarting, or to restart
        self.stale: Set[int] = set()  # back, with the checkpoint's weights: no requests until a push
        self._restarting: Dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="stare-restart")
        self.restarts_run = self.restarts_step = 0
        self.events: List[str] = []  # console lines (``take_events``)
        self.needs_resync = False
        self.needs_probe = False
        self.fatal: Optional[str] = None
        #: The trainer agrees on ``needs_resync`` and ``fatal`` with every rank (``recovery.py``):
        #: a push that breaks, or is refused past the bound, returns instead of raising.
        self.deferred = False

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> "VLLMServerFleet":
        if not spec.server_urls:
            return cls([VLLMServerEngine.from_spec(spec)], limits=spec.recovery)
        servers: List[VLLMServerEngine] = []
        try:
            for url in spec.server_urls:
                servers.append(VLLMServerEngine.from_spec(spec, url=url))
        except BaseException:
            for s in servers:
                s.shutdown()
            raise
        return cls(servers, limits=spec.recovery)

    @property
    def recovers(self) -> bool:
        return self.limits.max_restarts > 0

    @property
    def dispatch_stats(self) -> DispatchStats:
        """Where the last ``generate`` sent its requests."""
        return self.dispatcher.last

    # ---------------------------------------------------------------- faults
    def new_step(self) -> None:
        """A step begins: the per-step restart bound starts over."""
        self.restarts_step = 0

    def take_events(self) -> List[str]:
        """The console lines of what was lost and restarted since the last call."""
        with self._lock:
            out, self.events = self.events, []
        return out

    def _lost(self, b: int, err: BaseException) -> None:
        """Server ``b`` failed with ``err``: route around it and start bringing it back (once)."""
        s = self.servers[b]
        with self._lock:
            if b in self.down:
                return
            self.down.add(b)
            what = str(err).splitlines()[0] if str(err) else type(err).__name__
            what = re.sub(r"; its log tail \((\S+), kept\):$", r" (log \1)", what)  # the tail is in the log
            if self.fatal is not None:
                return
            self.restarts_run += 1
            self.restarts_step += 1
            if self.restarts_run > self.limits.max_restarts or self.restarts_step > self.limits.max_restarts_per_step:
                self.fatal = (f"{what} [{s.describe()}]; not restarted: that would be restart "
                              f"{self.restarts_step} of this step (rollout.max_engine_restarts_per_step="
                              f"{self.limits.max_restarts_per_step}) and {self.restarts_run} of the run "
                              f"(rollout.max_engine_restarts={self.limits.max_restarts})")
                return
            self.events.append(f"rollout server lost: {what}; restarting it ({self.restarts_step} of at most "
                               f"{self.limits.max_restarts_per_step} this step, {self.restarts_run} of "
                               f"{self.limits.max_restarts} in the run)")
            self._restarting[b] = self._pool.submit(self._restart, b)

    def _restart(self, b: int) -> None:
        s = self.servers[b]
        t0 = time.monotonic()
        try:
            s.restart()
        except BaseException as e:  # noqa: BLE001 - becomes the run's last line
            with self._lock:
                self.fatal = self.fatal or f"restarting {s.describe()} failed: {str(e).splitlines()[0]}"
            return
        with self._lock:
            self.stale.add(b)
            self.down.discard(b)
            self.needs_probe = True
            self.events.append(f"rollout server back after {time.monotonic() - t0:.1f}s: {s.describe()}; it "
                               f"serves again once the next weight push reaches it")

    def _await_restarts(self) -> None:
        """Wait for every restart under way (each ends in ``stale`` or in ``fatal``)."""
        for b, f in list(self._restarting.items()):
            f.result()
            self._restarting.pop(b, None)

    def _check_fatal(self) -> None:
        if self.fatal is not None:
            raise EngineLost(self.fatal)

    # ---------------------------------------------------------------- generation
    def generate_partial(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                         prompt_indices: Optional[Sequence[int]] = None) -> PartialGeneration:
        """``generate``, keeping what finished when servers are lost (module docstring): the
        results of every prompt some live server answered, and the batch indices of the rest.
        Lost servers are back (stale) or ``fatal`` is set when this returns with unfinished
        prompts."""
        self.check_can_generate()
        idx = batch_indices(prompt_token_ids, prompt_indices)
        # Outstanding work of a request, in tokens: its prompt and all it may generate.
        costs = [len(p) + params.n * params.max_new_tokens for p in prompt_token_ids]
        down = set(self.down) | set(self.stale)

        def call(b: int, j: int):
            try:
                return self.servers[b].complete(prompt_token_ids[j], params, idx[j])
            except EngineFailure as e:
                if not self.recovers:
                    raise
                self._lost(b, e)
                raise BackendLost() from e

        def hung(b: int) -> None:
            down.add(b)  # no new request goes there; those in flight fail as their calls are cut

        live = [s for b, s in enumerate(self.servers) if b not in down]
        with _Watchdog(self.servers, self.limits.request_timeout_s, hung) if live else nullcontext():
            outs = self.dispatcher.run(costs, call, interrupted=self.interrupted, down=down,
                                       abort=lambda: [s.abort_requests() for s in live if s.alive()])
        part = PartialGeneration()
        for j, out in enumerate(outs):
            if out is UNFINISHED:
                part.unfinished.append(idx[j])
            else:
                part.results += out
        if part.unfinished:
            self._await_restarts()
        return part

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                 prompt_indices: Optional[Sequence[int]] = None) -> List[GenerationResult]:
        part = self.generate_partial(prompt_token_ids, params, prompt_indices)
        if part.unfinished:
            self._check_fatal()
            raise EngineFailure(f"vllm-server: {len(part.unfinished)} prompt(s) unanswered: every server was lost "
                                f"and is back with stale weights (a weight push must reach it first)")
        return part.results

    # ---------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        self._push(lambda sender: sender.send(named_tensors, self.servers[0].bucket_bytes), drain=lambda: None)

    def update_weights_from_buckets(self, buckets: Iterable) -> None:
        buckets = iter(buckets)
        self._push(lambda sender: sender.send_buckets(buckets), drain=lambda: [None for _ in buckets])

    def _push(self, send, drain: Callable[[], object]) -> None:
        """Push to every server, lost ones brought back first. A push that breaks, with
        recovery on: the rest of the stream is drained (the trainer's other ranks are exporting
        it with this one), the server that broke it is lost, ``needs_resync`` set."""
        self.check_can_load_weights()
        self._await_restarts()  # a server lost in a generation or a lifecycle call is back (or fatal)
        if self.fatal is not None:
            drain()
            if self.deferred:
                return
            raise EngineLost(self.fatal)
        if self.stale and self._group is not None:  # a new member: the group is formed again
            self._destroy_group()
        try:
            if self._group is None:
                self._group = open_weight_group(self.servers, self.host, self.weight_backend,
                                                                 self.sync_timeout_s)
            self.last_sync = push_weights(self.servers, self._group, self.weight_backend, send)
        except (EngineFailure, RuntimeError) as e:
            if not self.recovers:
                raise
            drain()
            self._destroy_group()
            broken = [b for b, s in enumerate(self.servers) if not s.alive()] or [0]
            for b in broken:
                self._lost(b, e if isinstance(e, EngineFailure) else self.servers[b].failure("the weight push", e))
            self.needs_resync = True
            if self.deferred:
                return
            raise
        self.stale.clear()
        self.needs_resync = False

    def checksum(self, names: Sequence[str]) -> Dict[str, Optional[TensorChecksum]]:
        per = [s.checksum(names) for s in self.servers]
        out: Dict[str, Optional[TensorChecksum]] = {}
        for n in names:
            got = [p.get(n) for p in per]
            same = all(g is not None and got[0] is not None and g.digest == got[0].digest for g in got)
            out[n] = got[0] if same else None
        return out

    # ---------------------------------------------------------------- memory & life cycle
    @property
    def memory_release(self) -> MemoryRelease:
        if len(self.servers) == 1:
            return self.servers[0].memory_release
        return MemoryRelease(False, "attached servers run on GPUs of their own; nothing to release there")

    def _each(self, what: Callable[[VLLMServerEngine], object]) -> List[object]:
        """``what(server)`` on every server not lost; a failure loses the server (recovered at
        the next push) instead of ending the step, with recovery on."""
        out = []
        for b, s in enumerate(self.servers):
            if b in self.down:
                continue
            try:
                out.append(what(s))
            except EngineFailure as e:
                if not self.recovers:
                    raise
                self._lost(b, e)
        return out

    def _release(self) -> bool:
        return any(self._each(lambda s: s._release()))

    def _resume_weights(self) -> None:
        self._each(lambda s: s._resume_weights())

    def _resume_kv(self) -> None:
        self._each(lambda s: s._resume_kv())

    def is_sleeping(self) -> bool:
        """Every server's own answer (``/is_sleeping``), for checks of the phase order."""
        return all(s.is_sleeping() for s in self.servers)

    def _destroy_group(self) -> None:
        if self._group is not None:
            try:
                from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

                stateless_destroy_torch_distributed_process_group(self._group)
            except Exception as e:  # noqa: BLE001 - the servers stay up regardless
                log.debug("weight group teardown: %s", e)
            self._group = None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._destroy_group()
        for s in self.servers:
            s.shutdown()
