"""Rewards for a batch, computed beside the trainer: ``RewardPool``; and DAPO overlong shaping.

``pool.submit(responses, answers, metadatas)`` returns at once with a ``RewardFuture``;
``.result()`` gives the ``[N]`` scores in submission order. Every trainer rank holds one pool
and scores its share of each batch in it; ``rewards/sharded.py`` shares the scores, so a time
limit hit on one rank gives every rank the same 0. ``reward.num_workers`` worker processes each score one response
at a time, so every call has two limits:

- soft: the worker runs the call under ``registry.deadline(timeout_s)``; past it, score 0;
- hard: the parent kills a worker whose call is not back ``timeout_s + HARD_KILL_GRACE_S``
  after it was sent (stuck inside one C call, where signals are not delivered) and starts a
  replacement; the response scores 0. A worker that dies mid-call is replaced the same way
  (logged, counted in ``RewardFuture.num_crashes``). Workers ignore the trainer's preemption
  signals (SIGTERM, SIGUSR1: ``preemption.py``), which reach them too; the pool ends them.

``num_workers=0`` scores inline in ``submit`` (tests, tiny CPU runs) under the soft limit
only, which needs the main thread (it is ``SIGALRM`` based); ``math`` is always bounded there.
A reward function that raises (a bug, not a hostile response) fails ``.result()`` with one
``RewardError`` line naming the response index. How the function is called, what it may return
and which one scores a row (``reward.by_source``): ``rewards/contract.py``; a dict's extra
numbers come back per response as ``RewardFuture.extras()``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Sequence, Tuple

from megatron_stare.runtime.preemption import PREEMPTION_SIGNALS, StepInterrupted, ignore_preemption_signals
from megatron_stare.rewards.contract import build_reward, load_worker_spec, normalize_return, worker_spec
from megatron_stare.rewards.registry import RewardError, RewardTimeout, deadline, deadline_supported

if TYPE_CHECKING:  # importing the config pulls in torch; workers import this module
    from megatron_stare.config.load import RewardConfig

log = logging.getLogger(__name__)

#: Seconds past ``timeout_s`` before the parent kills a worker (the soft limit fires first).
HARD_KILL_GRACE_S = 2.0
#: How often ``RewardPool.wait`` asks whether a preemption signal stops the scoring (seconds).
INTERRUPT_POLL_S = 0.1


def score_one(fn, response: str, answer: Any, metadata: dict,
              timeout_s: float, interrupt=None) -> Tuple[float, str, Dict[str, float]]:
    """``(score, status, extras)`` of one call under the soft limit; status 'ok', 'timeout' or
    'error: ...'; ``extras`` the numeric keys of a dict return other than ``score``. With an
    ``interrupt`` (``step_interrupt.StepInterrupts``), a preemption signal cuts the call:
    ``StepInterrupted``."""
    try:
        with deadline(timeout_s), (interrupt.raising() if interrupt is not None else contextlib.nullcontext()):
            value = fn(response, answer, metadata)
    except RewardTimeout:
        return 0.0, "timeout", {}
    except Exception as e:
        return 0.0, f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", {}
    try:
        score, extras = normalize_return(value)
    except ValueError as e:
        return 0.0, f"error: {e}", {}
    return score, "ok", extras


def _warmup(fn) -> None:
    # Optional hook: heavy imports (math-verify, sympy) happen before the first timed call.
    if callable(getattr(fn, "warmup", None)):
        fn.warmup()


def _worker_main(fn_spec: str, timeout_s: float, conn) -> None:
    """Worker process: load the reward fn, say ready, score ``(key, r, a, m)`` until ``None``/EOF."""
    # A preemption signal for the trainer reaches its workers too (torchrun signals the trainer's
    # whole process group); the trainer finishes its step first, so the workers must live on.
    ignore_preemption_signals()  # (again, for callers other than _Worker)
    try:
        fn = load_worker_spec(fn_spec)
        _warmup(fn)
    except BaseException as e:
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent is gone
            return
        if msg is None:
            return
        key, response, answer, metadata = msg
        conn.send(("result", (key, *score_one(fn, response, answer, metadata, timeout_s))))


def _worker_cli() -> None:
    """Entry of ``python -c`` worker processes: ``argv = [fd, fn_spec, timeout_s]``."""
    fd, fn_spec, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    _worker_main(fn_spec, timeout_s, Connection(int(fd)))


class RewardFuture:
    """The pending scores of one ``submit``; ``result()`` blocks until all are in."""

    def __init__(self, n: int, fn_spec: str):
        self._scores: List[float] = [0.0] * n
        self._extras: List[Dict[str, float]] = [{} for _ in range(n)]
        self._remaining = n
        self._fn_spec = fn_spec
        self._error: Optional[str] = None
        self._done = threading.Event()
        self.num_timeouts = 0
        """Responses scored 0 because their call ran out of time (soft or hard limit)."""
        self.num_crashes = 0
        """Responses scored 0 because their worker process died."""
        if n == 0:
            self._done.set()

    def _set(self, index: int, score: float, status: str, extras: Optional[Dict[str, float]] = None) -> None:
        self._scores[index] = score
        self._extras[index] = extras or {}
        if status == "timeout":
            self.num_timeouts += 1
        elif status == "crashed":
            self.num_crashes += 1
        elif status != "ok" and self._error is None:
            self._error = f"reward: {self._fn_spec} failed on response {index}: {status[len('error: '):]}"
        self._remaining -= 1
        if self._remaining == 0:
            self._done.set()

    def _fail(self, msg: str) -> None:
        self._error = self._error or msg
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> List[float]:
        """``[N]`` scores in submission order; raises ``RewardError`` if a call raised."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"rewards not ready after {timeout} s ({self._remaining} pending)")
        if self._error is not None:
            raise RewardError(self._error)
        return list(self._scores)

    def extras(self) -> List[Dict[str, float]]:
        """``[N]`` the extra numbers of each response's dict return (``{}`` if none); after ``result()``."""
        return list(self._extras)


class _Worker:
    """One scoring process and its end of a socket pair.

    Started with ``subprocess`` rather than ``multiprocessing``: spawn and forkserver would
    re-import the trainer's ``__main__`` (torch, Megatron) in every worker, and fork would copy
    the trainer (threads, CUDA state). The child gets the parent's ``sys.path``.
    """

    def __init__(self, fn_spec: str, timeout_s: float):
        mine, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # The preemption signals are ignored first thing, before the (slow) imports.
        code = ("from megatron_stare.runtime.preemption import ignore_preemption_signals as i; i(); "
                "from megatron_stare.rewards.pool import _worker_cli; _worker_cli()")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno()), fn_spec, repr(timeout_s)],
                                     pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.conn = Connection(mine.detach())
        self.ready = False
        self.job: Optional[Tuple[RewardFuture, int]] = None
        self.sent_at = 0.0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()


class RewardPool:
    """Scores responses with ``cfg.fn`` in ``cfg.num_workers`` processes (0: inline).

    Close it (``close()`` or ``with``) to stop the workers. See the module docstring for the
    time limits.
    """

    def __init__(self, cfg: RewardConfig):
        if cfg.timeout_s <= 0 or cfg.num_workers < 0:
            raise RewardError(f"reward: timeout_s must be > 0 and num_workers >= 0, got "
                              f"{cfg.timeout_s} and {cfg.num_workers}")
        self.cfg = cfg
        self.fn = build_reward(cfg.fn, cfg.by_source)  # fail here, in the parent, on a bad reward.fn
        self._spec = worker_spec(cfg)
        self._lock = threading.Lock()
        self._pending: Deque[Tuple[RewardFuture, int, str, str, dict]] = collections.deque()
        self._closed = False
        self._fatal: Optional[str] = None
        self.interrupt = None
        self._cut = False
        """Set by the trainer (``step_interrupt.StepInterrupts``): its ``requested()`` stops the
        scoring (``wait``; inline, between responses and inside a call)."""
        if cfg.num_workers == 0:
            _warmup(self.fn)
            return
        self._workers = [_Worker(self._spec, cfg.timeout_s) for _ in range(cfg.num_workers)]
        r, w = socket.socketpair()
        self._wake_r, self._wake_w = Connection(r.detach()), Connection(w.detach())
        self._thread = threading.Thread(target=self._dispatch, name="reward-dispatch", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------------- public
    def submit(self, responses: Sequence[str], answers: Sequence[str],
               metadatas: Optional[Sequence[dict]] = None) -> RewardFuture:
        """Queue ``N`` responses; ``answers`` and ``metadatas`` (default ``{}``) are per response."""
        metadatas = [{} for _ in responses] if metadatas is None else metadatas
        if not len(responses) == len(answers) == len(metadatas):
            raise RewardError(f"reward: {len(responses)} responses, {len(answers)} answers and "
                              f"{len(metadatas)} metadatas; need one of each per response")
        if self._closed:
            raise RewardError("reward: the RewardPool is closed")
        fut = RewardFuture(len(responses), self.cfg.fn)
        if self.cfg.num_workers == 0:
            if not deadline_supported():
                raise RewardError("reward: reward.num_workers=0 scores in the calling thread, whose "
                                  "timeout needs the main thread; call from it or set reward.num_workers>=1")
            for i, (r, a, m) in enumerate(zip(responses, answers, metadatas)):
                if self.interrupt is not None and self.interrupt.requested():
                    raise StepInterrupted("score")
                fut._set(i, *score_one(self.fn, r, a, m, self.cfg.timeout_s, self.interrupt))
            return fut
        with self._lock:
            if self._fatal is not None:
                raise RewardError(self._fatal)
            self._pending.extend((fut, i, r, a, m) for i, (r, a, m) in
                                 enumerate(zip(responses, answers, metadatas)))
            self._wake_w.send(None)
        return fut

    def wait(self, fut: RewardFuture) -> List[float]:
        """``fut.result()``, unless a preemption signal stops the scoring first (``interrupt``):
        then its responses not yet sent are dropped and ``StepInterrupted`` is raised (the calls
        in flight finish in their workers, which ``close`` ends)."""
        while not fut._done.wait(INTERRUPT_POLL_S):
            if self.interrupt is not None and self.interrupt.requested():
                with self._lock:
                    self._pending = collections.deque(p for p in self._pending if p[0] is not fut)
                self._cut = True  # the calls in flight are abandoned: close() need not wait for them
                raise StepInterrupted("score")
        return fut.result()

    def score(self, responses: Sequence[str], answers: Sequence[str],
              metadatas: Optional[Sequence[dict]] = None) -> List[float]:
        """``submit(...).result()``."""
        return self.submit(responses, answers, metadatas).result()

    def close(self) -> None:
        """Stop the workers; pending futures fail with ``RewardError``."""
        if self._closed:
            return
        self._closed = True
        if self.cfg.num_workers == 0:
            return
        with self._lock:
            self._wake_w.send(None)
        self._thread.join(10)
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            try:
                w.proc.wait(0 if self._cut else 2)
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -------------------------------------------------------------------------------- dispatch
    def _hard_limit(self) -> float:
        return self.cfg.timeout_s + HARD_KILL_GRACE_S

    def _dispatch(self) -> None:
        """Dispatcher thread: hand responses to idle workers, collect, enforce the hard limit."""
        try:
            while not self._closed:
                self._assign()
                busy = [w.sent_at + self._hard_limit() for w in self._workers if w.job is not None]
                timeout = max(0.0, min(busy) - time.monotonic()) if busy else None
                for conn in wait([w.conn for w in self._workers] + [self._wake_r], timeout):
                    if conn is self._wake_r:
                        while self._wake_r.poll():
                            self._wake_r.recv()
                    else:
                        self._receive(next(w for w in self._workers if w.conn is conn))
                now = time.monotonic()
                for k, w in enumerate(self._workers):
                    if w.job is not None and now - w.sent_at > self._hard_limit():
                        log.warning("reward: worker %d exceeded %.1f s on one response; restarting it",
                                    w.proc.pid, self._hard_limit())
                        self._replace(k, "timeout")
        except Exception as e:  # a dispatcher bug must not leave result() waiting forever
            self._abort(f"reward: dispatcher failed: {type(e).__name__}: {e}")
        if self._closed:
            self._abort("reward: the RewardPool was closed before these rewards were computed")

    def _assign(self) -> None:
        with self._lock:
            for w in self._workers:
                if not self._pending:
                    return
                if w.ready and w.job is None:
                    fut, i, r, a, m = self._pending.popleft()
                    w.job, w.sent_at = (fut, i), time.monotonic()
                    w.conn.send((i, r, a, m))

    def _receive(self, w: _Worker) -> None:
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):
            code = w.proc.wait(10)  # its end of the socket is closed: it is exiting
            # A preemption signal in the instant before a new worker ignores it: start another.
            if not w.ready and -code not in PREEMPTION_SIGNALS:
                raise RuntimeError(f"reward worker exited during startup (exit code {code})")
            log.warning("reward: worker %d died (exit code %s); restarting it", w.proc.pid, code)
            self._replace(self._workers.index(w), "crashed")
            return
        if kind == "ready":
            w.ready = True
        elif kind == "fatal":
            raise RuntimeError(f"reward worker could not load reward.fn={self.cfg.fn!r}: {payload}")
        else:
            (fut, i), (_, score, status, extras) = w.job, payload
            w.job = None
            fut._set(i, score, status, extras)

    def _replace(self, k: int, status: str) -> None:
        w = self._workers[k]
        w.kill()
        if w.job is not None:
            fut, i = w.job
            fut._set(i, 0.0, status)
        self._workers[k] = _Worker(self._spec, self.cfg.timeout_s)

    def _abort(self, msg: str) -> None:
        with self._lock:
            self._fatal = self._fatal or msg
            futs = {id(p[0]): p[0] for p in self._pending}
            futs.update({id(w.job[0]): w.job[0] for w in self._workers if w.job is not None})
            self._pending.clear()
        for fut in futs.values():
            fut._fail(msg)


def shape_overlong(rewards, lengths, max_len: int, cfg: RewardConfig):
    """DAPO soft overlong shaping: ``rewards + overlong_penalty(lengths)``, ``[N]`` float32.

    ``rewards`` ``[N]`` scores, ``lengths`` ``[N]`` response lengths in tokens, ``max_len`` the
    generation limit L_max (``rollout.max_new_tokens``); the penalty ramps from 0 at
    ``L_max - L_buf`` to ``-factor`` at ``L_max`` (``cfg.overlong_buffer_len`` = L_buf, 0 = off).
    """
    import torch  # lazily: reward workers import this module and need no torch

    from megatron_stare.algorithms.advantages import overlong_penalty

    r = torch.as_tensor(rewards, dtype=torch.float32)
    if cfg.overlong_buffer_len == 0:
        return r
    pen = overlong_penalty(torch.as_tensor(lengths), max_len=max_len, buffer_len=cfg.overlong_buffer_len,
                           factor=cfg.overlong_penalty_factor)
    return r + pen
