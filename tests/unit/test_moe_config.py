"""Mixture-of-experts pieces that need no process group: megatron-core's expert grid rule and
what its MoE layer refuses as one-line ``LayoutError``s; HF config parsing (dense layers,
routing, shared expert); the fused <-> per-expert on-disk layouts; the router's padding mask
of a packed row."""

import pytest
import torch

from megatron_stare.models.moe import fuse_experts, layer_pattern, per_expert_view
from megatron_stare.models.provider import spec_from_hf_config
from megatron_stare.runtime.parallel import LayoutError, ModelShape, ParallelLayout

MOE_SHAPE = ModelShape(num_layers=4, num_attention_heads=4, num_query_groups=2, vocab_size=320,
                       num_experts=8, moe_ffn_hidden_size=32)
DENSE_SHAPE = ModelShape(num_layers=4, num_attention_heads=4, num_query_groups=2, vocab_size=320)


@pytest.mark.parametrize("world,kw,shape,needle", [
    (4, dict(ep=3), MOE_SHAPE, "etp*ep*pp = 1*3*1 = 3 does not divide the world size 4"),
    (4, dict(ep=2, pp=2, etp=2), MOE_SHAPE, "etp*ep*pp = 2*2*2 = 8"),
    (6, dict(ep=3), MOE_SHAPE, "does not divide the 8 experts"),
    (4, dict(ep=2, etp=2, tp=2, sequence_parallel=True), ModelShape(**{**MOE_SHAPE.__dict__, "moe_ffn_hidden_size": 33}),
     "does not divide the expert width 33"),
    (4, dict(ep=2, tp=2), MOE_SHAPE, "needs parallel.sequence_parallel"),
    (4, dict(ep=4), ModelShape(**{**MOE_SHAPE.__dict__, "num_experts": 6}), "parallel.ep=4 does not divide the 6 experts"),
    (6, dict(ep=4), MOE_SHAPE, "etp*ep*pp = 1*4*1 = 4 does not divide the world size 6"),
    (2, dict(ep=2), DENSE_SHAPE, "need a mixture-of-experts model"),
])
def test_refused_layouts_are_one_line(world, kw, shape, needle):
    with pytest.raises(LayoutError, match=needle.replace("*", r"\*")) as e:
        ParallelLayout.from_world(world, **kw).validate(world_size=world, shape=shape)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("world,kw", [(2, dict(ep=2)), (4, dict(ep=2, tp=2, sequence_parallel=True)),
                                      (4, dict(ep=2, pp=2)), (4, dict(ep=2, etp=2)), (2, dict(ep=2, tp=2, sequence_parallel=True))])
def test_megatron_layouts_are_accepted(world, kw):
    lay = ParallelLayout.from_world(world, **kw).validate(world_size=world, shape=MOE_SHAPE)
    assert lay.edp * lay.etp * lay.ep * lay.pp == world


def _cfg(**kw):
    base = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 320,
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "norm_topk_prob": True}
    return {**base, **kw}


def test_dense_layers_follow_mlp_only_layers_and_sparse_step():
    assert layer_pattern(_cfg(mlp_only_layers=[1])) == (1, 0, 1, 1)
    assert layer_pattern(_cfg(decoder_sparse_step=2)) == (0, 1, 0, 1)
    spec = spec_from_hf_config(_cfg(num_experts=None, num_local_experts=8, mlp_only_layers=[0]))
    assert spec.moe.num_experts == 8 and spec.moe.layer_pattern == (0, 1, 1, 1) and spec.moe.norm_topk_prob


def test_qwen2_moe_has_its_gated_shared_expert_and_rejects_bad_configs():
    spec = spec_from_hf_config(_cfg(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                                    shared_expert_intermediate_size=48, norm_topk_prob=False))
    assert spec.moe.shared_expert_size == 48 and spec.moe.shared_expert_gate and spec.add_qkv_bias
    assert not spec.moe.norm_topk_prob
    with pytest.raises(ValueError, match="shared_expert_intermediate_size missing"):
        spec_from_hf_config(_cfg(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe"))
    with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds num_experts=8"):
        spec_from_hf_config(_cfg(num_experts_per_tok=9))


def test_fused_layout_reads_as_per_expert_and_back():
    g = torch.Generator().manual_seed(0)
    per = {f"model.layers.0.mlp.experts.{e}.{k}.weight": torch.randn(s, generator=g)
           for e in range(3) for k, s in (("gate_proj", (4, 6)), ("up_proj", (4, 6)), ("down_proj", (6, 4)))}
    per["model.layers.0.mlp.gate.weight"] = torch.randn(3, 6, generator=g)
    fused = fuse_experts(per)
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 8, 6)
    get, shapes = per_expert_view(fused.__getitem__, {n: tuple(t.shape) for n, t in fused.items()})
    assert shapes == {n: tuple(t.shape) for n, t in per.items()}
    assert all(torch.equal(get(n), t) for n, t in per.items())


@pytest.mark.parametrize("cp", [1, 2])
def test_router_padding_mask_marks_exactly_the_padding(cp):
    """Slot padding (to 2*cp) and the row's padding to the SP multiple are padding; every real
    token is not (the router's aux and z-losses count only those)."""
    from megatron_stare.actor.schedule import _row_padding
    from megatron_stare.actor.batching import collate_packed
    from megatron_stare.types import Sample

    samples = [Sample(sample_id=i, group_id=0, prompt_ids=[5] * p, response_ids=[7] * r)
               for i, (p, r) in enumerate([(3, 3), (4, 5), (3, 2)])]
    lens = [5, 8, 4]  # the inputs: every token but the last
    real = 0
    for rank in range(cp):
        row = collate_packed(samples, pad_multiple=6 * cp, cp=cp, cp_rank=rank).packed
        pad = _row_padding(row)
        assert row.seq_lens == tuple(lens) and pad.shape == row.input_ids.shape
        starts = [0]
        for slot in row.slot_lens:
            starts.append(starts[-1] + slot // cp)
        for i, n in enumerate(lens):
            seg = slice(starts[i], starts[i + 1])
            assert torch.equal(pad[0, seg], row.position_ids[0, seg] >= n)
        real += int((~pad).sum())
    assert real == sum(lens) and row.input_ids.shape[1] * cp > sum(lens)
