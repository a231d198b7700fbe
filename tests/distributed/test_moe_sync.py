"""The weight-sync piece export of a mixture-of-experts model: every expert travels point-to-point
from the rank of the collector's expert grid that holds it (no all-gather of the experts), and
the destination assembles exactly the HF tensors of the whole-tensor export (which all-gathers
them over EP), at EP2 x TP2 (the grid spans data-parallel replicas), EP2 x ETP2 and EP2 x PP2
(EP2 alone: ``test_moe_vllm.py``, which also loads the result into vLLM)."""

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.hf_models import build_tiny_hf_model

pytestmark = [pytest.mark.distributed]

BUCKET = 24 << 10  # smaller than one expert's gate_up rows and the embedding: pieces are cut


def _perturb(model, seed):
    """Different noise on every rank (so each expert shard is distinct), same structure."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _sync_worker(rank, world, models, cases):
    """Every case (families, layout, dst) in this one spawn: Megatron's parallel state is set
    up again for each layout (the default group stays)."""
    from megatron.core import parallel_state as ps

    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed

    out = []
    for families, layout, dst in cases:
        ps.destroy_model_parallel()
        groups = init_distributed(ParallelLayout.from_world(world, **layout))
        out.append({fam: _sync_one(rank, groups, models[fam], dst) for fam in families})
    return out


def _sync_one(rank, groups, src, dst):
    import torch.distributed as dist

    from megatron_stare.weight_sync.export import ExportStats, iter_hf_buckets
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.weight_sync import assemble

    model, spec, _ = build_from_hf(src, groups, make_vocab_size_divisible_by=8)
    _perturb(model, 1000 + rank)
    whole = {n: t.clone() for b in iter_hf_buckets(model, groups, spec, BUCKET, dst="all") for n, t in b}
    gathers = []
    real = dist.all_gather

    def counted(*a, **k):  # the piece export must not all-gather any tensor
        gathers.append(1)
        return real(*a, **k)

    dist.all_gather = counted
    try:
        stats = ExportStats()
        pieces = {n: t.clone() for n, t in assemble(iter_hf_buckets(model, groups, spec, BUCKET, dst=dst,
                                                                     pieces=True, stats=stats))}
    finally:
        dist.all_gather = real
    return {"whole": whole if rank == dst else None, "pieces": pieces, "gathers": len(gathers),
            "max_bucket": stats.max_bucket_bytes}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_sync")
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    q3 = build_tiny_hf_model("qwen3_moe", d / "q3", hidden_size=64, num_layers=2, vocab_size=320,
                             ffn_hidden_size=96, moe={**moe, "mlp_only_layers": [1]})
    q2 = build_tiny_hf_model("qwen2_moe", d / "q2", hidden_size=64, num_layers=2, vocab_size=320,
                             ffn_hidden_size=96, moe={**moe, "shared_expert_intermediate_size": 48})
    return {"qwen3_moe": str(q3), "qwen2_moe": str(q2)}


def _check(results, dst):
    whole = results[dst]["whole"]
    got = results[dst]["pieces"]
    assert sorted(got) == sorted(whole)
    assert sum(".experts." in n for n in got) >= 4 * 3  # every expert of a MoE layer arrived
    for n in whole:
        assert torch.equal(got[n], whole[n]), n
    for r, res in enumerate(results):
        assert res["gathers"] == 0, (r, res["gathers"])
        if r != dst:
            assert res["pieces"] == {}
    assert results[dst]["max_bucket"] <= BUCKET


# One 4-rank spawn, one family per layout (CI time). EP2 on 2 ranks, dst 0, is test_moe_vllm.py's.
CASES = {
    4: [(("qwen3_moe",), dict(tp=2, ep=2, sequence_parallel=True), 0),  # the grid spans DP replicas
        (("qwen2_moe",), dict(ep=2, etp=2), 0),
        (("qwen3_moe",), dict(pp=2, ep=2), 3)],  # dst on the last stage: stage 0 hands its buckets over
}


@pytest.mark.parametrize("world", [4], ids=["ep2_tp2_etp2_pp2"])
def test_piece_export_of_experts_equals_whole_tensor_export(models, world):
    results = run_on_ranks(_sync_worker, world, models, CASES[world])
    for k, (families, _, dst) in enumerate(CASES[world]):
        for fam in families:
            _check([r[k][fam] for r in results], dst)
