"""SGLang on a GPU: the colocated ``sglang`` engine and the ``sglang-server`` adapter against the
real SGLang, both built from a config file through the trainer's path, checked against
transformers across weight swaps A -> B -> A; the memory phases really free and restore GPU
memory (``torch.cuda.mem_get_info``: SGLang's memory saver maps its memory outside PyTorch's
caching allocator, in its scheduler processes); the log-prob convention at temperature 0.7. The
colocated engine is an SGLang server the test's process spawns (``rollout/engines/sglang/engine.py``),
started here under a torchrun worker's environment.

Skipped cleanly without CUDA or without sglang installed (SGLang has no CPU path; the CPU tests
check the same adapters against SGLang's recorded API: tests/unit/test_rollout_sglang.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request

import pytest
import torch
import yaml

from megatron_stare.config.load import load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.rollout import EngineWorld, SamplingParams, engine_for_rank
from megatron_stare.rollout.engines.sglang_server.engine import server_command
from megatron_stare.testing.hf_models import build_tiny_hf_model

from ..unit.test_rollout_hf import (MAX_NEW, PROMPTS, assert_matches_reference, mean_abs_logprob_gap,
                                    reference_outputs, stream_state_dict)

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)


def _need_sglang():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    _need_sglang()
    root = tmp_path_factory.mktemp("sglang_gpu_models")
    a = build_tiny_hf_model("qwen2", root / "A", seed=0)
    b = build_tiny_hf_model("qwen2", root / "B", seed=1)
    return root, a, b, reference_outputs(a, PROMPTS, MAX_NEW), reference_outputs(b, PROMPTS, MAX_NEW)


def _config(root, model, **rollout):
    path = root / f"{rollout['engine']}.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": str(model)}, "data": {"max_prompt_length": 64},
                                    "rollout": {"max_new_tokens": 64, "gpu_memory_utilization": 0.2, **rollout}}))
    return validate_config(load_config(str(path)), world_size=1, cuda=True, check_paths=False)


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_sglang_colocated_phases_swaps_and_logprobs(models, monkeypatch):
    import transformers

    root, a, b, ref_a, ref_b = models
    cfg = _config(root, a, engine="sglang")
    # Built as in a torchrun worker: its TORCHELASTIC_* must not reach SGLang's rendezvous.
    for k, v in {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    spec, eng = engine_for_rank(cfg, EngineWorld(cuda=True, local_world_size=torch.cuda.device_count()))
    try:
        assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
        awake = _free()
        budget = spec.gpu_memory_utilization * torch.cuda.mem_get_info()[1]
        assert eng.release_memory() is True
        assert _free() - awake > 0.5 * budget  # weights, KV cache and CUDA graphs released
        eng.resume_weights()
        eng.update_weights((n, t.cuda()) for n, t in stream_state_dict(b))
        eng.resume_kv_cache()
        assert abs(_free() - awake) < 0.05 * budget
        assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
        eng.update_weights((n, t.cuda()) for n, t in stream_state_dict(a))
        assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
        res = eng.generate(PROMPTS, SamplingParams(n=4, temperature=0.7, max_new_tokens=8, seed=5))
        assert mean_abs_logprob_gap(res, model, PROMPTS, 0.7) < 1e-4
    finally:
        eng.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sglang_server_started_with_the_spec_command(models):
    if torch.cuda.device_count() < 2:
        pytest.skip("the NCCL push needs the server on a second GPU")
    root, a, b, _, ref_b = models
    port = _free_port()
    cfg = _config(root, a, engine="sglang-server", server_urls=[f"http://127.0.0.1:{port}"])
    spec, _ = engine_for_rank(cfg, EngineWorld(rank=1, world_size=2, cuda=True))  # the spec only
    cmd = server_command(spec, "127.0.0.1", port)
    proc = subprocess.Popen(list(cmd.argv), env={**os.environ, **cmd.env, "CUDA_VISIBLE_DEVICES": "1"},
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("SGLang server did not start")
                time.sleep(2)
        _, eng = engine_for_rank(cfg, EngineWorld(cuda=True))  # attaches, checks /server_info
        eng.update_weights((n, t.cuda()) for n, t in stream_state_dict(b))
        assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
        _check_partial_rollout_across_a_swap(eng, a, b, ref_b)
        eng.shutdown()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def _check_partial_rollout_across_a_swap(eng, a, b, ref_b):
    """Asynchronous training's partial rollouts on the real server: 3 greedy tokens under B
    (version 0), the weights swapped to A, the rest under A (version 1) from prompt + prefix:
    B's tokens then A's greedy continuation, each token's log-prob its version's."""
    from megatron_stare.rollout.partial import SegmentedBatch

    batch = SegmentedBatch(PROMPTS, list(range(len(PROMPTS))), GREEDY, 3)
    batch.advance(eng, 0)
    eng.update_weights((n, t.cuda()) for n, t in stream_state_dict(a))
    while not batch.finished:
        batch.advance(eng, 1)
    for r, (toks_b, lps_b) in zip(batch.results(), ref_b):
        assert r.token_ids[:3] == toks_b[:3] and r.versions == [0] * 3 + [1] * (MAX_NEW - 3)
        [(toks_a, lps_a)] = reference_outputs(a, [PROMPTS[r.prompt_index] + toks_b[:3]], MAX_NEW - 3)
        assert r.token_ids[3:] == toks_a
        assert torch.allclose(r.logprobs, torch.cat([lps_b[:3], lps_a]), atol=1e-4)
