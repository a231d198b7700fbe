"""SGLang on a GPU: the colocated ``sglang`` engine and the ``sglang-server`` adapter against the
real SGLang, checked against transformers across weight swaps A -> B -> A.

Skipped cleanly without CUDA or without sglang installed (SGLang has no CPU path; the CPU
tests use a recorded fake of its API: tests/unit/test_rollout_sglang.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from megatron_stare.rollout import SamplingParams, build_engine
from megatron_stare.rollout.hf_engine import score_tokens
from megatron_stare.testing.hf_models import build_tiny_hf_model

from ..unit.test_rollout_hf import (MAX_NEW, PROMPTS, assert_matches_reference, reference_outputs,
                                    stream_state_dict)

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
    return a, b, reference_outputs(a, PROMPTS, MAX_NEW), reference_outputs(b, PROMPTS, MAX_NEW)


def test_sglang_colocated_swaps_sleep_and_logprobs(models):
    a, b, ref_a, ref_b = models
    eng = build_engine("sglang", str(a), dtype="float32", mem_fraction_static=0.2,
                       bucket_bytes=256 << 10)
    try:
        assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
        free = torch.cuda.mem_get_info()[0]
        assert eng.sleep() and torch.cuda.mem_get_info()[0] > free
        assert eng.wake_up()
        eng.update_weights((n, t.cuda()) for n, t in stream_state_dict(b))
        assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
        eng.update_weights((n, t.cuda()) for n, t in stream_state_dict(a))
        assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
        for r in eng.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5)):
            ref = score_tokens(model, PROMPTS[r.prompt_index], r.token_ids)
            assert (r.logprobs - ref).abs().max().item() <= 1e-3
    finally:
        eng.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sglang_server_distributed_push(models):
    if torch.cuda.device_count() < 2:
        pytest.skip("the NCCL push needs the server on a second GPU")
    a, b, _, ref_b = models
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(a), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--skip-tokenizer-init",
         "--mem-fraction-static", "0.2"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"}, start_new_session=True)
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
        eng = build_engine("sglang-server", str(a), base_url=f"http://127.0.0.1:{port}",
                           weight_backend="nccl", bucket_bytes=256 << 10)
        eng.update_weights((n, t.cuda()) for n, t in stream_state_dict(b))
        assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
        eng.shutdown()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
