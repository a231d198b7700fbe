"""Interleaved timing of benchmark variants, each variant in its own process(es).

Every variant runs in its own world of ``world_size`` gloo ranks (``run_on_ranks``; one rank for
single-process benchmarks) that builds its inputs once, warms up, and then waits for commands
from this process over a local socket. The driver interleaves the variants: repeat 1 of A, repeat
1 of B, ..., repeat 2 of A, ... so that load from other work on the (shared) cores hits all
variants alike (the order within a round is shuffled); while one variant runs, the others
sleep in ``recv``. A goal is judged on the median over repeats of the paired ratio
``ours_i / reference_i``.

A variant is ``setup(rank, world_size, *args) -> runner``; ``runner(cmd)`` answers a command
(``"time"``: seconds of one timed call; anything else is up to the benchmark) with a picklable
value. ``setup`` must be a module-level function (it is pickled by reference).
"""

from __future__ import annotations

import platform
import random
import secrets
import statistics
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Listener
from typing import Any, Callable, Dict, List, Sequence

from megatron_stare.testing.distributed import run_on_ranks


def _serve(rank: int, world_size: int, address, authkey: bytes, name: str, setup: Callable,
           args: tuple) -> None:
    runner = setup(rank, world_size, *args)
    with Client(address, authkey=authkey) as conn:
        conn.send((name, rank))
        while True:
            cmd = conn.recv()
            if cmd is None:
                return
            conn.send(runner(cmd))


@dataclass
class Variant:
    name: str
    setup: Callable
    args: tuple = ()


@dataclass
class Worlds:
    """The started variants; ``ask(name, cmd)`` sends ``cmd`` to every rank of one variant and
    returns the answers by rank."""

    world_size: int
    conns: Dict[str, List[Any]] = field(default_factory=dict)
    threads: List[threading.Thread] = field(default_factory=list)
    errors: List[BaseException] = field(default_factory=list)

    def ask(self, name: str, cmd: Any) -> List[Any]:
        for c in self.conns[name]:
            c.send(cmd)
        return [c.recv() for c in self.conns[name]]

    def close(self) -> None:
        for conns in self.conns.values():
            for c in conns:
                try:
                    c.send(None)
                    c.close()
                except OSError:
                    pass
        for t in self.threads:
            t.join(timeout=60)
        if self.errors:
            raise self.errors[0]


def start(variants: Sequence[Variant], world_size: int = 1, timeout: float = 3600.0) -> Worlds:
    """Start one world per variant, one after the other (setup is not timed)."""
    authkey = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    worlds = Worlds(world_size)
    try:
        for v in variants:
            def target(v=v):
                try:
                    run_on_ranks(_serve, world_size, listener.address, authkey, v.name, v.setup,
                                 v.args, timeout=timeout)
                except BaseException as e:  # noqa: BLE001 - re-raised by start() or close()
                    worlds.errors.append(e)
                    try:  # wake up a driver still waiting for this world's ranks
                        with Client(listener.address, authkey=authkey) as c:
                            c.send((None, -1))
                    except OSError:
                        pass

            t = threading.Thread(target=target, daemon=True)
            t.start()
            worlds.threads.append(t)
            got = {}
            while len(got) < world_size:
                conn = listener.accept()
                name, rank = conn.recv()
                if name is None:  # a world failed before all its ranks connected
                    raise worlds.errors[0]
                got[rank] = conn
            worlds.conns[v.name] = [got[r] for r in range(world_size)]
    except BaseException:
        worlds.close()
        raise
    finally:
        listener.close()
    return worlds


def interleaved_times(worlds: Worlds, names: Sequence[str], repeats: int, cmd: Any = "time",
                      reduce: Callable[[List[float]], float] = max) -> Dict[str, List[float]]:
    """``repeats`` rounds; in each, every variant times one ``cmd``, in an order shuffled per
    round (seeded) so that no variant always follows the same one. A multi-rank variant's time
    is ``reduce`` over its ranks (default: the slowest rank)."""
    order = random.Random(0)
    out: Dict[str, List[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for n in order.sample(list(names), len(names)):
            out[n].append(reduce(worlds.ask(n, cmd)))
    return out


def paired_ratio(num: List[float], den: List[float]) -> float:
    """Median over repeats of ``num_i / den_i``."""
    return statistics.median(a / b for a, b in zip(num, den))


def machine() -> Dict[str, Any]:
    import torch

    return {"torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "threads_per_process": 1}
