"""Rendezvous preflight: a multi-node launch that cannot meet fails fast, in one line.

How the launch meets (torch 2.13): ``launch/common.sh`` runs torchrun with ``--master-addr
--master-port``, i.e. the static rendezvous (``torch/distributed/elastic/rendezvous/
static_tcp_rendezvous.py``). Node rank 0's agent hosts a ``TCPStore`` on MASTER_PORT; every
other node's agent connects to MASTER_ADDR:MASTER_PORT as a client and keeps retrying until
the rendezvous timeout (600 s by default), while node 0 waits as long for nodes that never
come. The workers then reach the same store through MASTER_ADDR/MASTER_PORT (torchrun sets
them; ``init_distributed`` reads them on the plain env:// path too). So a missing MASTER_ADDR
(torchrun defaults it to 127.0.0.1), a name that does not resolve, or an address other nodes
cannot reach is a silent ten-minute hang. ``check_master`` turns each into one line, before
torchrun starts:

- NNODES > 1 without MASTER_ADDR, or with a loopback address;
- MASTER_ADDR that does not resolve;
- node rank 0: MASTER_ADDR is not an address of this host (the store is hosted here);
- node rank > 0: nothing accepts connections on MASTER_ADDR:MASTER_PORT within ``wait_s``
  seconds (node 0 may start a little later, so connection refusals are retried until then).

``python -m megatron_stare.runtime.rendezvous --nnodes N --node-rank R --master-addr A --master-port P``
exits 0, or prints ``error: rendezvous: ...`` and exits 2. Standard library only (no torch):
it runs before anything heavy.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import time
from typing import Optional, Sequence

from megatron_stare.errors import UserError, print_or_error

WAIT_ENV = "MASTER_WAIT_S"
"""Seconds a node of rank > 0 waits for node 0's store (default ``DEFAULT_WAIT_S``)."""
DEFAULT_WAIT_S = 120.0


class RendezvousError(UserError):
    """The ranks cannot meet; ``str()`` is one line naming the variable and the fix."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"rendezvous: {msg}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_seconds() -> float:
    """``$MASTER_WAIT_S`` or ``DEFAULT_WAIT_S``."""
    raw = os.environ.get(WAIT_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_WAIT_S
    except ValueError:
        raise RendezvousError(f"{WAIT_ENV}={raw!r} must be a number of seconds") from None


def resolve(addr: str) -> str:
    """The IP address ``addr`` names (``RendezvousError`` if it does not resolve)."""
    try:
        return socket.getaddrinfo(addr.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as e:
        raise RendezvousError(f"MASTER_ADDR={addr} does not resolve ({e}); set it to the hostname or IP "
                              f"of node rank 0") from None


def _is_local(ip: str) -> bool:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def wait_for_port(addr: str, ip: str, port: int, wait_s: float) -> None:
    """Return once ``ip:port`` accepts a TCP connection; ``RendezvousError`` after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((ip, port), timeout=max(min(left, 5.0), 0.1)):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(
                f"MASTER_ADDR={addr} ({ip}) port {port} is not reachable from this node after {wait_s:g}s "
                f"({last}); check that node rank 0 is up and that MASTER_ADDR/MASTER_PORT are its address "
                f"and port ({WAIT_ENV} sets the wait)")
        time.sleep(min(0.5, left))


def check_master(nnodes: int, node_rank: int, addr: Optional[str], port: Optional[int],
                 wait_s: Optional[float] = None) -> None:
    """Raise ``RendezvousError`` (one line) if node ``node_rank`` of ``nnodes`` cannot meet the
    others at ``addr:port``; see the module docstring for the rules."""
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise RendezvousError(f"NODE_RANK={node_rank} must be in [0, NNODES={nnodes})")
    if nnodes > 1 and not addr:
        raise RendezvousError(f"NNODES={nnodes} needs MASTER_ADDR, the hostname or IP of node rank 0 "
                              f"(launch/slurm_32b.sbatch sets it to the job's first host)")
    if port is None or not 0 < port < 65536:
        raise RendezvousError(f"MASTER_PORT={port} must be a TCP port in [1, 65535]")
    if nnodes == 1 and not addr:
        return
    ip = resolve(addr)
    if nnodes == 1:
        return
    if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
        raise RendezvousError(f"MASTER_ADDR={addr} is a loopback address ({ip}), which the other "
                              f"{nnodes - 1} node(s) cannot reach; set it to node rank 0's hostname or IP")
    if node_rank == 0:
        if not _is_local(ip):
            raise RendezvousError(f"MASTER_ADDR={addr} ({ip}) is not an address of this host, but node rank 0 "
                                  f"hosts the rendezvous; set MASTER_ADDR to this node's hostname or IP")
        return
    wait_for_port(addr, ip, port, wait_seconds() if wait_s is None else wait_s)


def check_env(world_size: int, rank: int, wait_s: Optional[float] = None) -> None:
    """For ``init_process_group``'s env:// path: MASTER_ADDR/MASTER_PORT are set, resolve, and
    (rank > 0) accept connections within the wait; one ``RendezvousError`` line otherwise."""
    if world_size <= 1:
        return
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise RendezvousError(f"WORLD_SIZE={world_size} needs MASTER_ADDR and MASTER_PORT (the store of rank 0); "
                              f"launch with torchrun or set both")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RendezvousError(f"MASTER_PORT={port} must be a TCP port in [1, 65535]")
    ip = resolve(addr)
    if rank > 0:
        wait_for_port(addr, ip, int(port), wait_seconds() if wait_s is None else wait_s)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.runtime.rendezvous",
                                 description="Check that this node can meet the others (exit 2, one line, if not).")
    ap.add_argument("--nnodes", type=int, required=True)
    ap.add_argument("--node-rank", type=int, required=True)
    ap.add_argument("--master-addr", default="")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--wait-s", type=float, default=None, help=f"default ${WAIT_ENV} or {DEFAULT_WAIT_S:g}")
    args = ap.parse_args(argv)
    return print_or_error(lambda: check_master(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                                              args.wait_s), (RendezvousError,))


if __name__ == "__main__":
    sys.exit(main())
