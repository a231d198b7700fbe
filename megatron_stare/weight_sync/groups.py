"""Weight groups between the trainer and out-of-process engines (servers), and the push over them.

A server's workers and the trainer form one process group (trainer = rank 0, workers 1..W): the
trainer hosts the rendezvous store on a socket it bound to a free port of the address the servers
route to (``route_address``), each server is told over HTTP to join (a call that returns once its
workers joined), and the trainer joins here.

The trainer's store is its own, created on that pre-bound socket - never through torch's
``tcp://`` rendezvous: under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) that rendezvous
makes every rank, rank 0 included, a *client* of a store it assumes torchrun's agent hosts on
the given port, so nobody hosts it and the group hangs until its timeout (seen: a vllm-server run
under torchrun, 600 s). The socket is bound before a peer hears the port, so no other process
can take it in between. Two ways to form it: vLLM's stateless
helper (the vLLM servers, whose worker extension joins the same way) and
``init_named_weight_group`` (how SGLang's workers form theirs). ``form_group`` runs the servers'
join calls in helper threads while this process joins; ``push_to_group`` runs their receive
calls likewise while this process broadcasts the buckets (``ProcessGroupSender``, the one wire
protocol) - so every server engine and the fleet share one implementation.
"""

from __future__ import annotations

import socket
import threading
import urllib.parse
from datetime import timedelta
from typing import Callable, List, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

from megatron_stare.weight_sync.transport import ProcessGroupSender, SyncStats

__all__ = ["PeerCalls", "form_group", "free_port", "init_named_weight_group", "push_to_group", "route_address"]

G = TypeVar("G")


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (for a rendezvous store or a spawned server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def route_address(url: str) -> str:
    """This machine's address on the route to ``url``'s host: where a server reaches the
    weight group's store, which the trainer (group rank 0) hosts. Sends nothing (a UDP
    socket's connect only picks the route)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, parts.port or 80))
        return s.getsockname()[0]


class PeerCalls:
    """Blocking calls to the other end of a collective (HTTP requests that return when the
    server's side is done), each started in its own thread. ``join()`` waits for all and
    returns their errors (idempotent)."""

    def __init__(self, calls: Sequence[Callable[[], object]]):
        self.results: List[object] = [None] * len(calls)
        self.errors: List[Optional[BaseException]] = [None] * len(calls)
        self._threads = [threading.Thread(target=self._run, args=(i, c)) for i, c in enumerate(calls)]
        for t in self._threads:
            t.start()

    def _run(self, i: int, call: Callable[[], object]) -> None:
        try:
            self.results[i] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread by join()
            self.errors[i] = e

    def join(self) -> List[BaseException]:
        for t in self._threads:
            t.join()
        return [e for e in self.errors if e is not None]


def form_group(joins: Sequence[Callable[[int], object]], init_local: Callable[[int, socket.socket], G],
               host: str) -> G:
    """Rank 0 of a new group with its rendezvous store on a socket bound to a free port of
    ``host``: each ``join(port)`` runs in a thread while ``init_local(port, listen_socket)`` runs
    here and hosts the store on that socket (taking it over); the first peer error is re-raised."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    port = sock.getsockname()[1]
    calls = PeerCalls([lambda j=j: j(port) for j in joins])
    try:
        group = init_local(port, sock)
    finally:
        sock.close()  # a no-op once the store took the socket over
        errors = calls.join()
    if errors:
        raise errors[0]
    return group


def push_to_group(group, device: torch.device, receives: Sequence[Callable[[], object]],
                  send: Callable[[ProcessGroupSender], SyncStats],
                  on_broken: Callable[[RuntimeError, List[BaseException]], BaseException]) -> SyncStats:
    """Broadcast from group rank 0 (``send(sender)``) while every ``receive()`` runs in a thread.

    A collective that breaks (``RuntimeError``: most likely a peer is gone) is re-raised as
    ``on_broken(error, peer errors)``; otherwise the first peer error, if any.
    """
    calls = PeerCalls(receives)
    try:
        stats = send(ProcessGroupSender(group, 0, device))
    except RuntimeError as e:
        raise on_broken(e, calls.join()) from e
    finally:
        errors = calls.join()
    if errors:
        raise errors[0]
    return stats


def init_named_weight_group(host: str, port: int, rank: int, world_size: int, group_name: str,
                            backend: str, timeout_s: float = 600.0,
                            register_as: Optional[str] = None,
                            listen_socket: Optional[socket.socket] = None) -> dist.ProcessGroup:
    """One member of a named weight-update group formed like SGLang's workers form theirs in
    ``init_weights_update_group``: a TCP store at ``host:port`` that rank 0 hosts (on
    ``listen_socket`` when given, which it takes over; the module docstring says why not torch's
    rendezvous), a prefix store named after the group. The trainer is rank 0. The default group,
    if any, is left untouched. ``register_as``: the local registry name (default ``group_name``;
    two ends in one process, as in tests, need distinct ones)."""

    timeout = timedelta(seconds=timeout_s)
    if listen_socket is not None and rank != 0:
        raise ValueError(f"only rank 0 hosts the store (listen_socket given to rank {rank})")
    fd = {"master_listen_fd": listen_socket.detach()} if listen_socket is not None else {}
    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False, **fd)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                      PrefixStore(group_name, store),
                                      group_name=register_as or group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
