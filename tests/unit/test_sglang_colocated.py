"""The colocated ``sglang`` engine: SGLang in a server process of its own, spawned by the TP group's
first rank (``rollout/engines/sglang/engine.py`` says why). SGLang cannot run on CPU, so the engine spawns
``tests/fixtures/fake_sglang/sglang/launch_server.py``: SGLang's recorded flags and routes, its
replies (plain-text ``/flush_cache``, ``{"success": false}`` with status 400), its memory-tag
rules, and a scheduler child that joins torch's real ``tcp://`` rendezvous as SGLang's does.

What each test shows (docs/cluster-paths.md, items 1-9):
- start-up under a torchrun worker's environment (``TORCHELASTIC_USE_AGENT_STORE=True``)
  succeeds: the server does not inherit it (item 1); with it, torch's real rendezvous fails;
- a preemption SIGTERM to the rank's process group (what torchrun sends) leaves the server
  serving, the rank's SIGTERM handler and signal wakeup fd its own; its environment, asyncio
  policy and multiprocessing start method are untouched (items 3, 9); the engine's shutdown
  leaves the rank's other children (an asynchronous save's writer) alive and no server process
  behind (item 6);
- the weight and memory protocol over HTTP, a refused weight update raising (item 5), the
  plain-text ``/flush_cache`` (item 2) and the seed notice (item 8).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml

from megatron_stare.config.load import load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.rollout import EngineWorld, SamplingParams, engine_for_rank
from megatron_stare.rollout.http import EngineFailure
from megatron_stare.runtime.phases import EngineMemory
from megatron_stare.rollout.engines.sglang.engine import colocated_command, engine_kwargs
from megatron_stare.rollout.engines.sglang_server.engine import SEED_NOTICE

from ..fixtures.fake_sglang.sglang.launch_server import parse_flags

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "fixtures" / "fake_sglang"
#: A torchrun worker's variables (torch/distributed/elastic/agent/server/local_elastic_agent.py).
TORCHRUN_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_RUN_ID": "none", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
WORLD = EngineWorld(rank=0, world_size=2, local_rank=0, local_world_size=2, cuda=True)


def _config(tmp_path: Path, **rollout):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": "/models/policy", "dtype": "bfloat16"}, "data": {"max_prompt_length": 100},
        "rollout": {"engine": "sglang", "tp": 2, "max_new_tokens": 28, "gpu_memory_utilization": 0.4,
                    **rollout}, "trainer": {"seed": 7}}))
    return validate_config(load_config(str(path)), world_size=2, cuda=True, check_paths=False)


def _named(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(64, 32, generator=g)) for i in range(4)] + [
        ("model.norm.weight", torch.randn(32, generator=g).to(torch.bfloat16))]


@contextmanager
def _fake_sglang_env():
    """This process as a torchrun worker whose ``python`` finds the fake ``sglang``."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", f"{FAKE}{os.pathsep}{ROOT}")
    for k, v in TORCHRUN_ENV.items():
        mp.setenv(k, v)
    try:
        yield
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One colocated engine (its server spawned through the trainer's path), shared by the module."""
    with _fake_sglang_env():
        _, eng = engine_for_rank(_config(tmp_path_factory.mktemp("sgl")), WORLD)
    # CPU tensors cross to an unrelated process only by shared-memory file name (on a GPU the
    # tensors are CUDA tensors and travel as IPC handles).
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield eng
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
        eng.shutdown()


def test_colocated_command_is_the_spec_in_sglang_flags(tmp_path):
    spec, _ = engine_for_rank(_config(tmp_path), EngineWorld(rank=1, world_size=2, local_rank=1,
                                                             local_world_size=2, cuda=True))  # no engine on rank 1
    cmd = colocated_command(spec, "127.0.0.1", 31000)
    assert cmd.argv[1:3] == ("-m", "sglang.launch_server")
    flags = parse_flags(list(cmd.argv[3:]))  # every flag one of SGLang's (recorded)
    want = {k: v for k, v in engine_kwargs(spec).items() if v is not False}
    assert flags == {**{k: True if v is True else str(v) for k, v in want.items()}, "host": "127.0.0.1",
                     "port": "31000"}
    assert flags["enable_memory_saver"] is True and flags["base_gpu_id"] == "0"
    assert cmd.env == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}


def test_a_torchrun_workers_environment_breaks_sglangs_rendezvous():
    """The mechanism of item 1, in real torch: SGLang's scheduler rendezvous (the fake's) fails
    with the worker's environment and succeeds with the one a spawned server gets."""
    code = textwrap.dedent("""
        import multiprocessing as mp, os, socket
        from megatron_stare.rollout.spawned import server_environ
        from tests.fixtures.fake_sglang.sglang import launch_server as fake
        fake.RENDEZVOUS_TIMEOUT_S = 1
        for env in (dict(os.environ), server_environ()):  # the worker's, then a spawned server's
            os.environ.clear(); os.environ.update(env)
            s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
            q = mp.Queue(); fake._scheduler(port, q, serve=False); print(q.get(), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **TORCHRUN_ENV, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    worker, spawned = out.stdout.splitlines()
    assert spawned == "ok" and worker != "ok" and "Error" in worker, out.stdout + out.stderr


def test_weights_and_memory_phases_over_sglangs_routes(engine, caplog):
    insp = engine._post("/_inspect")
    assert insp["env"] == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}  # no TORCHELASTIC_* / RANK (item 1)
    assert insp["sid"] == insp["pgid"] != os.getsid(0)  # a session of its own (item 3)
    assert engine.memory_release.frees is True and engine.world == 2
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=5, seed=4)
    engine.update_weights(iter(_named(0)))
    calls = engine._post("/_inspect")["calls"]
    assert calls[0] == "/begin_weight_update" and calls[-2:] == ["/end_weight_update", "/flush_cache"]
    assert "/update_weights_from_tensor" in calls  # and the plain-text /flush_cache was accepted (item 2)
    held = engine._post("/_inspect")["weights"]
    assert held == {n: [t.double().sum().item(), str(t.dtype), list(t.shape)] for n, t in _named(0)}
    before = engine.generate([[1, 2, 3], [4, 5]], params)
    assert [(r.prompt_index, r.sample_index) for r in before] == [(p, s) for p in range(2) for s in range(2)]
    n0 = len(engine._post("/_inspect")["calls"])
    assert engine.release_memory() is True
    assert engine._post("/_inspect")["released"] == ["cuda_graph", "kv_cache", "weights"]
    engine.resume_weights()
    engine.update_weights(iter(_named(1)))  # no flush: the KV cache is released (releasing flushed it)
    engine.resume_kv_cache()
    after = engine.generate([[1, 2, 3], [4, 5]], params)
    calls = [c for c in engine._post("/_inspect")["calls"][n0:] if c not in ("/update_weights_from_tensor",
                                                                              "/_inspect")]
    assert calls == ["/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update",
                     "/end_weight_update", "/resume_memory_occupation", "/generate", "/generate", "/generate",
                     "/generate"]
    assert engine._post("/_inspect")["released"] == [] and engine.memory is EngineMemory.AWAKE
    assert after[0].token_ids != before[0].token_ids  # the new weights
    with caplog.at_level(logging.WARNING):
        engine.say_once(SEED_NOTICE)
    assert not caplog.records  # said once already, when the engine was built (item 8)


def test_a_refused_weight_update_raises_and_closes_the_session(engine):
    """SGLang answers a failed weight update ``{"success": false, "message"}`` with status 400
    and keeps its old weights: the update must not pass for done (item 5)."""
    engine._post("/_fail_next", {"message": "Failed to update weights: shape mismatch"})
    with pytest.raises(EngineFailure, match=r"^sglang \(pid \d+\) at http://127\.0\.0\.1:\d+ replied HTTP 400: "
                                            r".*shape mismatch.* during /begin_weight_update"):
        engine.update_weights(iter(_named(2)))
    engine.update_weights(iter(_named(3)))
    calls = engine._post("/_inspect")["calls"]
    assert calls[-2:] == ["/end_weight_update", "/flush_cache"]


RANK = textwrap.dedent("""
    import asyncio, json, multiprocessing as mp, os, signal, subprocess, sys
    heard = []
    def handler(signum, frame):
        heard.append(signum)
    signal.signal(signal.SIGTERM, handler)  # the rank's own (preemption.py records the signal)
    r, w = os.pipe(); os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)  # the preemption relay's (step_interrupt.py)
    # Stands for an asynchronous save's writer: a child of the rank, in its process group.
    writer = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                               "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
    def state():
        return {"env": {k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_CUMEM_ENABLE")},
                "start_method": mp.get_start_method(allow_none=True),
                "policy": type(asyncio.get_event_loop_policy()).__name__,
                "sigquit": str(signal.getsignal(signal.SIGQUIT))}
    before = state()
    from megatron_stare.rollout import EngineWorld, SamplingParams, engine_for_rank
    from tests.unit.test_sglang_colocated import _config
    from pathlib import Path
    _, eng = engine_for_rank(_config(Path(sys.argv[1])), EngineWorld(rank=0, world_size=2, local_rank=0,
                                                                       local_world_size=2, cuda=True))
    info = eng._post("/_inspect")
    print(json.dumps({"server": [info["pid"], info["scheduler_pid"], eng.pid]}), flush=True)
    sys.stdin.readline()  # the test has signalled this rank's process group
    out = eng.generate([[1, 2]], SamplingParams(max_new_tokens=3))[0].token_ids
    fd = signal.set_wakeup_fd(-1)
    res = {"heard": heard, "handler": signal.getsignal(signal.SIGTERM) is handler, "wakeup": fd == w,
           "generated": len(out), "same_state": state() == before, "state": state()}
    eng.shutdown()
    res["writer_alive"] = writer.poll() is None
    writer.kill(); writer.wait()
    print(json.dumps(res), flush=True)
""")


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_the_rank_keeps_its_signals_state_and_children(tmp_path):
    """A rank (its own process group, as torchrun starts workers) builds the engine, gets
    torchrun's SIGTERM on its group, generates again and shuts the engine down (items 3, 6, 9)."""
    with _fake_sglang_env():
        rank = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path)], cwd=ROOT, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = json.loads(rank.stdout.readline())
        os.killpg(rank.pid, signal.SIGTERM)  # torchrun forwarding a preemption to its worker
        time.sleep(0.5)
        rank.stdin.write("go\n")
        rank.stdin.flush()
        res = json.loads(rank.stdout.readline())
        assert rank.wait(timeout=60) == 0
    finally:
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
            rank.wait()
    assert res["heard"] == [signal.SIGTERM] and res["handler"] and res["wakeup"]
    assert res["generated"] == 3  # the server outlived the signal
    assert res["same_state"], res["state"]
    assert res["writer_alive"]  # the engine's shutdown ended its own processes only
    assert all(_gone(pid) for pid in first["server"])  # and every one of them


def test_the_trainer_closes_its_saves_before_the_engine():
    """Item 6: the background save is finalized before any engine ends its processes, and the
    engine is shut down even when finalizing the save fails."""
    from types import SimpleNamespace

    from megatron_stare.train import Trainer

    order = []

    class Saves:
        def close(self):
            order.append("saves")
            raise OSError("disk full")

    nothing = SimpleNamespace(close=lambda: None)
    tr = SimpleNamespace(interrupts=nothing, _owns_preemption=False, logger=nothing, pool=None, saves=Saves(),
                         engine=SimpleNamespace(shutdown=lambda: order.append("engine")))
    with pytest.raises(OSError):
        Trainer.close(tr)
    assert order == ["saves", "engine"]
