"""The embedded ``hf`` engine against transformers: greedy tokens, log-probs, weight swaps, seeds.

``reference_outputs`` (also used by the vLLM tests) is the oracle: greedy decoding with a FULL
forward per step (no KV cache) in fp32, and the log-probs of the decoded sequence from one full
forward - independent of every engine's own loop. ``trainer_logprobs`` scores sampled tokens the
way the trainer's log-prob pass does (its vocab-parallel kernel at the rollout temperature):
engines must match it at any temperature (the log-prob convention of ``rollout/base.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence, Tuple

import pytest
import torch
import yaml
from safetensors.torch import load_file

from megatron_stare.config.load import load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.ops.vocab_parallel import vocab_parallel_logprobs_entropy
from megatron_stare.rollout import EngineWorld, SamplingParams, build_engine, engine_for_rank
from megatron_stare.rollout.engines.hf.engine import filter_logits, score_tokens
from megatron_stare.runtime.phases import EngineMemory
from megatron_stare.testing.hf_models import build_tiny_hf_model
from megatron_stare.weight_sync import InProcessTransport, iter_buckets, tensor_checksum

PROMPTS = [[5, 6, 7, 8], [10, 11, 12], [20, 21, 22, 23, 24], [30, 31, 32]]
MAX_NEW = 8
LOGPROB_ATOL = 1e-4


@torch.no_grad()
def reference_outputs(model_dir, prompts: Sequence[Sequence[int]], max_new: int
                      ) -> List[Tuple[List[int], torch.Tensor]]:
    """Greedy ``(tokens, fp32 log-probs)`` per prompt from transformers, no EOS stop."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(max_new):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        resp = ids[len(p):]
        out.append((resp, score_tokens(model, p, resp)))
    return out


@torch.no_grad()
def trainer_logprobs(model, prompt: Sequence[int], response: Sequence[int], temperature: float) -> torch.Tensor:
    """``[T]`` log-probs of ``response`` as the trainer's log-prob pass computes them: its
    vocab-parallel kernel on the model's logits at ``temperature`` (whole vocabulary)."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(input_ids=ids).logits[0].float()
    P, T = len(prompt), len(response)
    out = vocab_parallel_logprobs_entropy(logits[P - 1:P - 1 + T], ids[0, P:], temperature=temperature,
                                          with_entropy=False)
    return out.logprobs


def mean_abs_logprob_gap(results, model, prompts, temperature: float) -> float:
    """Mean over all sampled tokens of |engine log-prob - trainer log-prob|."""
    gaps = torch.cat([(r.logprobs - trainer_logprobs(model, prompts[r.prompt_index], r.token_ids, temperature)).abs()
                      for r in results])
    return float(gaps.mean())


def write_engine_config(path: Path, model_dir, **rollout) -> Path:
    """A run's YAML as a user writes it: the engine comes from it alone."""
    cfg = {"model": {"path": str(model_dir)}, "data": {"max_prompt_length": 64},
           "rollout": {"max_new_tokens": 64, "verify_sync": True, **rollout}, "trainer": {"seed": 0}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def engine_from_config_file(path: Path, world: EngineWorld = EngineWorld()):
    """The trainer's path: load and validate the config, then ``engine_for_rank``."""
    cfg = validate_config(load_config(str(path)), world_size=world.world_size, check_paths=False)
    return engine_for_rank(cfg, world)


def stream_state_dict(model_dir, bucket_bytes: int = 64 * 1024):
    """Model ``model_dir``'s HF tensors as a lazy stream, passed through the bucketer."""
    sd = load_file(str(Path(model_dir) / "model.safetensors"))
    for bucket in iter_buckets(sd.items(), bucket_bytes):
        yield from bucket


def assert_matches_reference(results, reference, n: int = 1):
    for i, (ref_toks, ref_lps) in enumerate(reference):
        for s in range(n):
            r = results[i * n + s]
            assert (r.prompt_index, r.sample_index) == (i, s)
            assert r.token_ids == ref_toks, f"prompt {i}: {r.token_ids} != {ref_toks}"
            assert r.logprobs.dtype == torch.float32
            diff = (r.logprobs - ref_lps).abs().max().item()
            assert diff <= LOGPROB_ATOL, f"prompt {i}: log-prob max abs diff {diff}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_engine_models")
    a = build_tiny_hf_model("qwen2", root / "A", seed=0)
    b = build_tiny_hf_model("qwen2", root / "B", seed=1)
    return a, b, reference_outputs(a, PROMPTS, MAX_NEW), reference_outputs(b, PROMPTS, MAX_NEW)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)


def test_greedy_and_logprobs_match_transformers_across_weight_swaps(models):
    a, b, ref_a, ref_b = models
    eng = build_engine("hf", str(a))
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
    InProcessTransport(eng).sync(stream_state_dict(b))
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
    eng.update_weights(stream_state_dict(a))
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
    eng.shutdown()


def test_hf_builds_from_a_config_file_through_the_trainers_path(models, tmp_path):
    """engine_for_rank (what the Trainer calls): the policy's dtype, on the driver only."""
    a, _, ref_a, _ = models
    spec, eng = engine_from_config_file(write_engine_config(tmp_path / "run.yaml", a, engine="hf"))
    assert (spec.context_length, spec.dtype, eng.device.type) == (128, "float32", "cpu")
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_a)
    cfg = tmp_path / "bf16.yaml"
    cfg.write_text(yaml.safe_dump({**yaml.safe_load((tmp_path / "run.yaml").read_text()),
                                   "model": {"path": str(a), "dtype": "bfloat16"}}))
    assert next(engine_from_config_file(cfg)[1].model.parameters()).dtype == torch.bfloat16
    assert engine_from_config_file(cfg, EngineWorld(rank=1, world_size=2))[1] is None  # driver only


def test_greedy_equals_transformers_generate(models):
    import transformers

    a, _, ref_a, _ = models
    model = transformers.AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
    for p, (toks, _) in zip(PROMPTS, ref_a):
        out = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0, min_new_tokens=MAX_NEW)
        assert out[0, len(p):].tolist() == toks


def test_sampling_is_seeded_and_logprobs_are_the_models(models):
    a, _, _, _ = models
    eng = build_engine("hf", str(a))
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
    params = SamplingParams(n=3, temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=6, seed=7)
    r1 = eng.generate(PROMPTS, params)
    assert len(r1) == len(PROMPTS) * 3
    assert [r.token_ids for r in eng.generate(PROMPTS, params)] == [r.token_ids for r in r1]
    # The same prompt index gets the same streams whatever else is in the batch.
    alone = eng.generate(PROMPTS[:1], params)
    assert [r.token_ids for r in alone] == [r.token_ids for r in r1[:3]]
    assert len({tuple(r.token_ids) for r in r1[:3]}) > 1  # samples of one prompt differ
    other = eng.generate(PROMPTS[:1], SamplingParams(**{**params.__dict__, "seed": 8}))
    assert [r.token_ids for r in other] != [r.token_ids for r in alone]
    for r in r1:  # the distribution sampled from: temperature, top-k, top-p, renormalised
        ref = score_tokens(model, PROMPTS[r.prompt_index], r.token_ids, 0.8, 50, 0.9)
        assert (r.logprobs - ref).abs().max().item() <= LOGPROB_ATOL
        assert r.finish_reason in ("stop", "length")
    eng.shutdown()


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_match_the_trainers_convention(models, temperature):
    """The training setting (no top-k/top-p): engine log-probs are the trainer's, at any
    temperature; the raw-logit log-probs of the old convention are not (at T != 1)."""
    import transformers

    a = models[0]
    eng = build_engine("hf", str(a))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
    res = eng.generate(PROMPTS, SamplingParams(n=4, temperature=temperature, max_new_tokens=8, seed=3))
    gap = mean_abs_logprob_gap(res, model, PROMPTS, temperature)
    print(f"hf engine vs trainer, T={temperature}: mean |dlogp| = {gap:.2e}")
    assert gap < 1e-4
    raw = torch.cat([score_tokens(model, PROMPTS[r.prompt_index], r.token_ids) for r in res])
    trainer = torch.cat([trainer_logprobs(model, PROMPTS[r.prompt_index], r.token_ids, temperature) for r in res])
    assert (temperature == 1.0) == bool(float((raw - trainer).abs().mean()) < 1e-4)


def test_stop_tokens_and_finish_reasons(models):
    a, _, ref_a, _ = models
    eng = build_engine("hf", str(a))
    stop_tok = ref_a[0][0][2]  # the 3rd greedy token of prompt 0
    res = eng.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=MAX_NEW,
                                                   stop_token_ids=(stop_tok,), ignore_eos=True))
    first = ref_a[0][0].index(stop_tok)
    assert res[0].token_ids == ref_a[0][0][:first + 1] and res[0].finish_reason == "stop"
    res = eng.generate(PROMPTS[:1], GREEDY)
    assert res[0].finish_reason == "length" and len(res[0].token_ids) == MAX_NEW


def test_checksum_reports_what_the_engine_holds(models):
    a, b, _, _ = models
    eng = build_engine("hf", str(a))
    sd_b = load_file(str(Path(b) / "model.safetensors"))
    eng.update_weights(stream_state_dict(b))
    got = eng.checksum(list(sd_b) + ["no.such.tensor"])
    assert got["no.such.tensor"] is None
    for name, t in sd_b.items():
        assert got[name] == tensor_checksum(t)


def test_update_rejects_unknown_names_and_shapes(models):
    a, _, _, _ = models
    eng = build_engine("hf", str(a))
    with pytest.raises(ValueError, match="no tensor named"):
        eng.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="shape"):
        eng.update_weights([("model.norm.weight", torch.zeros(3))])


def test_memory_phases_in_order_and_reported_not_faked_on_cpu(models, caplog):
    a, b, _, ref_b = models
    eng = build_engine("hf", str(a), device="cpu")
    assert eng.memory_release.frees is False and "host memory" in eng.memory_release.how
    with caplog.at_level("WARNING"):
        assert eng.release_memory() is False
    assert eng.memory is EngineMemory.RELEASED
    with pytest.raises(RuntimeError, match="generate\\(\\) needs its memory AWAKE, but it is RELEASED"):
        eng.generate(PROMPTS, GREEDY)
    with pytest.raises(RuntimeError, match="weight update while its memory is RELEASED"):
        eng.update_weights(stream_state_dict(b))
    with pytest.raises(RuntimeError, match="resume_kv_cache\\(\\) needs its memory WEIGHTS"):
        eng.resume_kv_cache()
    eng.resume_weights()
    eng.update_weights(stream_state_dict(b))  # phase 7 between the two resumes
    eng.resume_kv_cache()
    assert_matches_reference(eng.generate(PROMPTS, GREEDY), ref_b)
    eng.release_memory(), eng.resume_weights(), eng.resume_kv_cache()
    said = [r.getMessage() for r in caplog.records if "cannot release memory" in r.getMessage()]
    assert said == ["hf engine: cannot release memory (its weights already live in host memory (cpu)); "
                    "it stays allocated while the trainer trains"]  # once, for two releases


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 1.0, 2, 1.0)[0, 2:]).all()
    kept = ~torch.isinf(filter_logits(logits, 1.0, 0, 0.8))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.8 <= 0.5 + 0.3
    kept = ~torch.isinf(filter_logits(logits, 1.0, 0, 0.3))
    assert kept.tolist() == [[True, False, False, False]]
    assert torch.allclose(filter_logits(logits, 2.0, 0, 1.0), logits / 2)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="n must"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="unknown rollout engine"):
        build_engine("nope", "/tmp")
