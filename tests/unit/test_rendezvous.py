"""The rendezvous preflight: each way a multi-node launch cannot meet is one line, in seconds.

Without it, torchrun's static rendezvous retries for 600 s (a wrong MASTER_ADDR on a node of
rank > 0) or waits as long for nodes that never come (node 0, or every node when MASTER_ADDR
defaulted to 127.0.0.1). Real sockets throughout: a port nobody listens on refuses, a listening
socket accepts.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_stare.runtime.rendezvous import RendezvousError, check_env, check_master, free_port

ROOT = Path(__file__).resolve().parents[2]


def host_ip():
    """A non-loopback IPv4 address of this host (None in a sandbox without one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # UDP: no packet is sent, the route picks the address
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def _error(fn, *args, **kw) -> str:
    with pytest.raises(RendezvousError) as info:
        fn(*args, **kw)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("rendezvous: "), msg
    return msg


def test_single_node_needs_nothing():
    check_master(1, 0, "", 29500)
    check_master(1, 0, "127.0.0.1", 29500)


def test_multi_node_without_master_addr():
    assert "NNODES=4 needs MASTER_ADDR" in _error(check_master, 4, 1, "", 29500)
    assert "NODE_RANK=4 must be in [0, NNODES=4)" in _error(check_master, 4, 4, "node0", 29500)
    assert "MASTER_PORT=0 must be a TCP port" in _error(check_master, 2, 1, "node0", 0)


def test_loopback_is_unreachable_from_other_nodes():
    assert "is a loopback address (127.0.0.1)" in _error(check_master, 2, 0, "127.0.0.1", 29500)
    assert "loopback" in _error(check_master, 2, 1, "localhost", 29500)


def test_unresolvable_address_fails_at_once():
    t0 = time.monotonic()
    msg = _error(check_master, 2, 1, "no-such-host.invalid", 29500, wait_s=60)
    assert "MASTER_ADDR=no-such-host.invalid does not resolve" in msg
    assert time.monotonic() - t0 < 30  # a resolver failure, never the 60 s wait


def test_node_zero_must_own_the_address():
    msg = _error(check_master, 2, 0, "198.51.100.7", 29500)  # TEST-NET-2: never this host
    assert "MASTER_ADDR=198.51.100.7 (198.51.100.7) is not an address of this host" in msg
    ip = host_ip()
    if ip:
        check_master(2, 0, ip, 29500)


def test_other_nodes_wait_a_bounded_time_for_node_zero():
    ip = host_ip()
    if ip is None:
        pytest.skip("no non-loopback address on this host")
    port = free_port(ip)  # nobody listens: connections are refused
    t0 = time.monotonic()
    msg = _error(check_master, 2, 1, ip, port, wait_s=1.5)
    elapsed = time.monotonic() - t0
    assert f"MASTER_ADDR={ip} ({ip}) port {port} is not reachable from this node after 1.5s" in msg
    assert 1.0 <= elapsed < 10, elapsed
    with socket.create_server((ip, 0)) as server:  # node 0 is up: accepted at once
        t0 = time.monotonic()
        check_master(2, 1, ip, server.getsockname()[1], wait_s=30)
        assert time.monotonic() - t0 < 5


def test_env_path(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    check_env(1, 0)
    assert "WORLD_SIZE=2 needs MASTER_ADDR and MASTER_PORT" in _error(check_env, 2, 1)
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert "does not resolve" in _error(check_env, 2, 0)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    check_env(2, 0)  # rank 0 hosts the store: nothing to reach yet
    monkeypatch.setenv("MASTER_WAIT_S", "0.5")
    assert "is not reachable from this node after 0.5s" in _error(check_env, 2, 1)


def test_init_distributed_fails_fast_on_the_env_path():
    """``init_distributed`` checks before ``init_process_group``, whose store would retry for its
    whole timeout (30 min here) on a name that does not resolve."""
    code = ("from megatron_stare.runtime.parallel import ParallelLayout, init_distributed\n"
            "try:\n    init_distributed(ParallelLayout(dp=2))\n"
            "except ValueError as e:\n    print(e)\n")
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "no-such-host.invalid",
           "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("rendezvous: MASTER_ADDR=no-such-host.invalid does not resolve")
    assert time.monotonic() - t0 < 90
