"""vLLM on a GPU: colocated engine with sleep mode, weight swaps A -> B -> A, NCCL server push.

Skipped cleanly without CUDA or without vllm. On a GPU the engine runs fp32 (as on CPU) so
greedy tokens and log-probs are compared with transformers at tight tolerance.
"""

from __future__ import annotations

import pytest
import torch

from megatron_stare.rollout import SamplingParams, build_engine
from megatron_stare.testing.hf_models import build_tiny_hf_model

from ..unit.test_rollout_hf import (MAX_NEW, PROMPTS, assert_matches_reference, reference_outputs,
                                    stream_state_dict)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)


def _models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_gpu_models")
    a = build_tiny_hf_model("qwen2", root / "A", seed=0)
    b = build_tiny_hf_model("qwen2", root / "B", seed=1)
    return a, b, reference_outputs(a, PROMPTS, MAX_NEW), reference_outputs(b, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    a, b, ref_a, ref_b = _models(tmp_path_factory)
    eng = build_engine("vllm", str(a), max_model_len=128, gpu_memory_utilization=0.2,
                       enable_sleep_mode=True, record_checksums=True)
    yield eng, a, b, ref_a, ref_b
    eng.shutdown()


def test_gpu_colocated_swaps_and_sleep(colocated):
    eng, a, b, ref_a, ref_b = colocated
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
    assert eng.supports_sleep
    free_before = torch.cuda.mem_get_info()[0]
    assert eng.sleep() is True
    assert torch.cuda.mem_get_info()[0] > free_before  # memory really released
    assert eng.wake_up() is True
    eng.update_weights(stream_state_dict(b))
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
    eng.update_weights(stream_state_dict(a))
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)


def test_gpu_server_push(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    a, b, _, ref_b = _models(tmp_path_factory)
    # NCCL refuses two ranks on one device: with one GPU the push goes over gloo.
    two = torch.cuda.device_count() >= 2
    env = {"CUDA_VISIBLE_DEVICES": "1"} if two else {}
    eng = build_engine("vllm-server", str(a), max_model_len=128, env=env,
                       weight_backend="nccl" if two else "gloo",
                       extra_args=["--gpu-memory-utilization", "0.2"], bucket_bytes=256 << 10)
    try:
        eng.update_weights((n, t.cuda()) for n, t in stream_state_dict(b))
        assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
    finally:
        eng.shutdown()
