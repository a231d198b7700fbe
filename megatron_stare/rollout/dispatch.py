"""Send requests to several rollout servers, each to the one with the least outstanding work.

``Dispatcher.run(costs, call)`` runs one request per entry of ``costs`` through at most
``window`` requests in flight. A request is placed when a slot frees up (not all at once), on
the backend whose outstanding work - the summed ``costs`` of its requests in flight, in tokens
(prompt tokens + ``n * max_new_tokens``) - is smallest; ties go to fewer requests in flight,
then to the lower index. A slow server therefore keeps its requests longer, holds more
outstanding work, and is given fewer new ones: the servers finish together. ``round_robin``
(request ``j`` to backend ``j % B``) is kept as the baseline the tests show failing that.

Placement is the only thing that varies between runs: a request's result depends on its
prompt and its per-prompt seed alone (``rollout/data_parallel.py``), and ``run`` returns the
results in request order, whatever answered them.

Routing around a lost server: a call that raises ``BackendLost`` gave up on its backend (the
fleet marked it down); the request is placed again, on the live backends only, and with the
same seed it gets the same answer. With no live backend left it comes back as ``UNFINISHED``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, List, Literal, Optional, Sequence, Set, TypeVar

from megatron_stare.rollout.interruptible import run_requests

__all__ = ["POLICIES", "UNFINISHED", "BackendLost", "DispatchStats", "Dispatcher"]

T = TypeVar("T")
POLICIES = ("least_work", "round_robin")
#: A request no live backend could answer (``Dispatcher.run``'s result in its place).
UNFINISHED = object()


class BackendLost(Exception):
    """Raised by a call whose backend is gone (and now in ``down``): place the request again."""


@dataclass
class DispatchStats:
    """What one ``run`` sent where: ``backend[j]`` answered request ``j``; per backend, how many
    requests and how much work (cost units) it was given."""

    backend: List[int] = field(default_factory=list)
    requests: List[int] = field(default_factory=list)
    work: List[int] = field(default_factory=list)

    def share(self, b: int) -> float:
        """Fraction of the requests backend ``b`` answered."""
        return self.requests[b] / max(sum(self.requests), 1)


class Dispatcher:
    """Runs requests over ``num_backends`` backends (see the module docstring).

    Args:
        num_backends: servers behind the dispatcher.
        window: requests in flight at once, over all backends (the placement decision is made
            as each slot frees up; a window as large as the batch places everything at once).
        policy: ``least_work`` or ``round_robin``.
    """

    def __init__(self, num_backends: int, window: int,
                 policy: Literal["least_work", "round_robin"] = "least_work"):
        if num_backends < 1 or window < 1:
            raise ValueError(f"dispatcher needs >= 1 backend and window >= 1, got {num_backends}, {window}")
        if policy not in POLICIES:
            raise ValueError(f"dispatch policy must be one of {POLICIES}, got {policy!r}")
        self.num_backends, self.window, self.policy = num_backends, window, policy
        self.last = DispatchStats()

    def run(self, costs: Sequence[int], call: Callable[[int, int], T], interrupted: Callable[[], bool] = lambda: False,
            abort: Callable[[], None] = lambda: None, down: Optional[Set[int]] = None) -> List[T]:
        """``[call(backend, j) for j in range(len(costs))]``, run concurrently and placed by the
        policy; results in request order. The first failing call's error is raised. Once
        ``interrupted()``, ``abort()`` and ``StepInterrupted`` (``rollout/interruptible.py``).
        ``down``: backends not to use (the caller adds to it before raising ``BackendLost``);
        a request that no live backend answered is ``UNFINISHED``."""
        down = down if down is not None else set()
        B = self.num_backends
        lock = threading.Lock()
        outstanding, in_flight = [0] * B, [0] * B
        stats = DispatchStats(backend=[-1] * len(costs), requests=[0] * B, work=[0] * B)

        def place(j: int, live: List[int]) -> int:
            if self.policy == "round_robin" and j % B in live:
                return j % B
            return min(live, key=lambda b: (outstanding[b], in_flight[b], b))

        def one(j: int) -> T:
            while True:
                with lock:
                    live = [b for b in range(B) if b not in down]
                    if not live:
                        return UNFINISHED
                    b = place(j, live)
                    outstanding[b] += costs[j]
                    in_flight[b] += 1
                    stats.backend[j], stats.requests[b], stats.work[b] = b, stats.requests[b] + 1, stats.work[b] + costs[j]
                try:
                    return call(b, j)
                except BackendLost:
                    down.add(b)
                    with lock:
                        stats.backend[j], stats.requests[b], stats.work[b] = -1, stats.requests[b] - 1, stats.work[b] - costs[j]
                finally:
                    with lock:
                        outstanding[b] -= costs[j]
                        in_flight[b] -= 1

        # The pool's threads take requests in order, one per free slot: placement happens then.
        out = run_requests(len(costs), one, max_workers=self.window, interrupted=interrupted, abort=abort)
        self.last = stats
        return out
