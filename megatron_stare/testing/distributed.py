"""Run a function on N gloo ranks on CPU and collect each rank's return value.

Used by the multi-rank tests: ``run_on_ranks(fn, world_size, *args)`` starts ``world_size``
fresh processes (so Megatron's module-level parallel state never leaks between tests), gives
them a free loopback port, ``OMP_NUM_THREADS=1``, a gloo default process group, and calls
``fn(rank, world_size, *args)``. ``fn`` must be a module-level (picklable) function and its
return value picklable. If any rank fails, the error raised here lists every failing rank's
traceback, not only the first.

On gloo the ranks are forked from a forkserver that has imported torch, megatron-core and
transformers once (``_PRELOAD``) and nothing else: a rank starts in milliseconds instead of
re-importing them (5-12 s per 2-rank start on 2 cores, ~100 starts in the suite), and it is
still a process that never ran a test (no parallel state, no project module, no CPU patch
applied). The rank takes the caller's current environment and working directory, as a spawned
one would. NCCL ranks are spawned: a forked process cannot initialise CUDA.
"""

from __future__ import annotations

import io
import os
import queue
import traceback
from typing import Any, Callable, List
import time
import multiprocessing

import torch.multiprocessing as mp
import torch
import torch.distributed as dist

from megatron_stare.runtime.rendezvous import free_port

__all__ = ["free_port", "run_on_ranks"]

_PRELOAD = ("torch", "torch.distributed", "safetensors.torch", "megatron.core",
            "megatron.core.parallel_state", "megatron.core.models.gpt", "megatron.core.optimizer",
            "megatron.core.dist_checkpointing", "megatron.core.transformer.moe.moe_layer",
            "transformers", "transformers.models.qwen2.modeling_qwen2")
"""Imported once by the forkserver (third-party only: importing them has no effect a test could
see, and a missing one is skipped). Not vLLM: it starts threads and sets multiprocessing modes."""


def _context(backend: str):
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))  # read when the forkserver first starts
    return ctx


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict,
            results, env: dict, cwd: str) -> None:
    # A forked rank has the forkserver's environment and directory (those of the test that
    # started it): take the caller's, as a spawned process would.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )

    torch.set_num_threads(1)
    try:
        backend = os.environ.get("MEGATRON_STARE_TEST_BACKEND", "gloo")
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # The parent holds the store's server socket: no window in which another process can
        # take the port between choosing it and binding it.
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args, **kwargs)
        # Tensors sent through a torch queue live in shared memory that dies with this
        # process: send plain bytes instead.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        # Megatron's checkpoint writer starts a multiprocessing manager that nothing shuts
        # down; left alone it outlives this rank (an orphan holding the test's pipes).

        for child in multiprocessing.active_children():
            child.terminate()


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds every failing rank's traceback."""


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0,
                 **kwargs: Any) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    Raises ``RankFailure`` naming every failing rank (with its traceback), or when a rank dies
    without reporting, or when the whole run exceeds ``timeout`` seconds.
    """
    ctx = _context(os.environ.get("MEGATRON_STARE_TEST_BACKEND", "gloo"))
    results = ctx.Queue()
    # Port 0: the kernel picks a free port while binding, so no other process can race for it.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, results, dict(os.environ),
                                          os.getcwd()), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict = {}

    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailure(
                    f"timed out after {timeout:.0f}s; ranks that reported: {sorted(got)}"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
                got[rank] = (ok, payload)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in got]
                if dead:
                    # Give a dying rank a moment to flush its message to the queue.
                    try:
                        rank, ok, payload = results.get(timeout=2.0)
                        got[rank] = (ok, payload)
                        continue
                    except queue.Empty:
                        codes = {i: procs[i].exitcode for i in dead}
                        raise RankFailure(f"rank(s) died without reporting, exit codes {codes}")
                # A failed rank may leave its peers blocked in a collective: stop early.
                if any(not ok for ok, _ in got.values()):
                    time.sleep(2.0)
                    while True:
                        try:
                            rank, ok, payload = results.get_nowait()
                            got[rank] = (ok, payload)
                        except queue.Empty:
                            break
                    break
    finally:
        for p in procs:
            p.join(timeout=5)
        del store
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: msg for r, (ok, msg) in sorted(got.items()) if not ok}
    if failures:
        text = "\n".join(f"----- rank {r} -----\n{msg}" for r, msg in failures.items())
        raise RankFailure(f"{len(failures)} of {world_size} rank(s) failed:\n{text}")
    if len(got) < world_size:
        raise RankFailure(f"only ranks {sorted(got)} of {world_size} reported")

    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world_size)]
