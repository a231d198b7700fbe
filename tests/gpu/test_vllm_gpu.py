"""vLLM on a GPU: colocated engine and spawned server, both built from a config file through the
trainer's path; the memory phases really free and restore GPU memory; weight swaps A -> B -> A;
the log-prob convention at temperature 0.7.

Skipped cleanly without CUDA or without vllm. The engine runs fp32 (as on CPU) so greedy tokens
and log-probs are compared with transformers at tight tolerance.

GPU memory is measured with ``torch.cuda.mem_get_info`` (the driver's free memory), not
``torch.cuda.memory_allocated``: with sleep mode vLLM allocates its weights and KV cache through
its own CuMemAllocator (``cuMemCreate``/``cuMemMap`` in a pluggable allocator pool), which the
caching allocator's counters do not see, and a server's memory is in another process entirely.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_stare.rollout import EngineWorld, SamplingParams
from megatron_stare.testing.hf_models import build_tiny_hf_model
from megatron_stare.weight_sync import compare_checksums, tensor_checksum

from ..unit.test_rollout_hf import (MAX_NEW, PROMPTS, assert_matches_reference, engine_from_config_file,
                                    mean_abs_logprob_gap, reference_outputs, stream_state_dict, write_engine_config)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
GiB = 2 ** 30


def _models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_gpu_models")
    a = build_tiny_hf_model("qwen2", root / "A", seed=0)
    b = build_tiny_hf_model("qwen2", root / "B", seed=1)
    return root, a, b, reference_outputs(a, PROMPTS, MAX_NEW), reference_outputs(b, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    root, a, b, ref_a, ref_b = _models(tmp_path_factory)
    cfg = write_engine_config(root / "run.yaml", a, engine="vllm", gpu_memory_utilization=0.2)
    spec, eng = engine_from_config_file(cfg, EngineWorld(cuda=True))
    yield eng, a, b, ref_a, ref_b, spec
    eng.shutdown()


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_gpu_colocated_memory_phases_free_and_restore(colocated):
    eng, a, b, ref_a, ref_b, spec = colocated
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
    total = torch.cuda.mem_get_info()[1]
    budget = spec.gpu_memory_utilization * total
    awake = _free()
    assert eng.memory_release.frees and eng.release_memory() is True
    released = _free()
    assert released - awake > 0.5 * budget, (awake / GiB, released / GiB)  # the KV pool is most of it
    eng.resume_weights()
    eng.update_weights(stream_state_dict(b))  # the sync lands in the restored weight memory
    eng.resume_kv_cache()
    assert abs(_free() - awake) < 0.05 * budget  # everything back
    sd = load_file(str(Path(b) / "model.safetensors"))
    assert compare_checksums({n: tensor_checksum(t) for n, t in sd.items()}, eng.checksum(list(sd))) == []
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
    eng.update_weights(stream_state_dict(a))
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)


def test_gpu_logprobs_match_the_trainers_convention(colocated):
    import transformers

    eng, a, *_ = colocated
    eng.update_weights(stream_state_dict(a))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
    res = eng.generate(PROMPTS, SamplingParams(n=4, temperature=0.7, max_new_tokens=8, seed=3))
    assert mean_abs_logprob_gap(res, model, PROMPTS, 0.7) < 1e-4


def test_gpu_spawned_server_sleeps_and_takes_weights(tmp_path_factory):
    """The server the driver spawns on its own GPU: the spec's flags (dtype, TP, memory budget,
    sleep mode), the memory phases over HTTP, the weight push (gloo: NCCL refuses a second rank
    on the trainer's GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    root, a, b, _, ref_b = _models(tmp_path_factory)
    cfg = write_engine_config(root / "server.yaml", a, engine="vllm-server", gpu_memory_utilization=0.2)
    spec, eng = engine_from_config_file(cfg, EngineWorld(cuda=True))
    try:
        assert eng.weight_backend == "gloo" and spec.devices.gpu_ids == (0,)
        awake = _free()
        assert eng.release_memory() is True and eng.is_sleeping()
        assert _free() - awake > 0.5 * spec.gpu_memory_utilization * torch.cuda.mem_get_info()[1]
        eng.resume_weights()
        eng.update_weights((n, t.cuda()) for n, t in stream_state_dict(b))
        eng.resume_kv_cache()
        assert not eng.is_sleeping()
        assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
    finally:
        eng.shutdown()


def test_gpu_tied_head_follows_a_sync(tmp_path):
    """The tied-head defect of vLLM-CPU (a head kernel packed from the old weights) should not
    exist on GPU, where the unquantized head reads ``layer.weight`` itself: after syncs to B and
    back to A, a tied model's greedy tokens and log-probs are transformers' at each."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    a = build_tiny_hf_model("llama", tmp_path / "A", seed=0, tie_word_embeddings=True)
    b = build_tiny_hf_model("llama", tmp_path / "B", seed=1, tie_word_embeddings=True)
    cfg = write_engine_config(tmp_path / "run.yaml", a, engine="vllm", gpu_memory_utilization=0.2)
    _, eng = engine_from_config_file(cfg, EngineWorld(cuda=True))
    try:
        for model in (b, a):
            eng.update_weights(stream_state_dict(model))
            assert_matches_reference(eng.generate(PROMPTS, GREEDY), reference_outputs(model, PROMPTS, MAX_NEW))
    finally:
        eng.shutdown()


def test_gpu_spawned_server_killed_is_restarted_on_its_gpu_and_takes_weights(tmp_path_factory):
    """Recovery on a GPU (``engines/vllm_server/fleet.py``): the spawned server, sharing the trainer's GPU,
    is SIGKILLed; it comes back on the same GPU (same command, CUDA_VISIBLE_DEVICES, sleep mode),
    serves nothing until a push, and after one generates B's greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    import os
    import signal

    root, a, b, _, ref_b = _models(tmp_path_factory)
    cfg = write_engine_config(root / "server_restart.yaml", a, engine="vllm-server", gpu_memory_utilization=0.2)
    _, eng = engine_from_config_file(cfg, EngineWorld(cuda=True))
    try:
        srv = eng.servers[0]
        pid = srv.pid
        os.killpg(pid, signal.SIGKILL)
        part = eng.generate_partial(PROMPTS, GREEDY)
        assert part.unfinished == list(range(len(PROMPTS))) and eng.stale == {0} and srv.pid != pid
        eng.update_weights((n, t.cuda()) for n, t in stream_state_dict(b))
        assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
    finally:
        eng.shutdown()
