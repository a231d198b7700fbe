"""The weight-sync piece export of a mixture-of-experts model: every expert travels point-to-point
from the rank of the collector's expert grid that holds it (no all-gather of the experts), and
the destination assembles exactly the HF tensors of the whole-tensor export (which all-gathers
them over EP), at EP2, EP2 x TP2 (the grid spans data-parallel replicas), EP2 x ETP2 and EP2 x PP2."""

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


def _sync_worker(rank, world, models, layout, dst):
    return {fam: _sync_one(rank, path, layout, dst) for fam, path in models.items()}


def _sync_one(rank, src, layout, dst):
    import torch.distributed as dist

    from megatron_stare.models.export import ExportStats, iter_hf_buckets
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.weight_sync import assemble

    groups = _groups(layout)
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


_GROUPS = {}


def _groups(layout):
    from megatron_stare.parallel import ParallelLayout, init_distributed
    import torch.distributed as dist

    if "g" not in _GROUPS:
        _GROUPS["g"] = init_distributed(ParallelLayout.from_world(dist.get_world_size(), **layout))
    return _GROUPS["g"]


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


# One spawn per layout; the 4-rank layouts take one family each (CI time).
@pytest.mark.parametrize("families,world,layout,dst", [
    (("qwen3_moe", "qwen2_moe"), 2, dict(ep=2), 1),
    (("qwen3_moe",), 4, dict(tp=2, ep=2, sequence_parallel=True), 0),  # the grid spans DP replicas
    (("qwen2_moe",), 4, dict(ep=2, etp=2), 0),
    (("qwen3_moe",), 4, dict(pp=2, ep=2), 3),  # dst on the last stage: stage 0 hands its buckets over
], ids=["ep2", "ep2_tp2", "ep2_etp2", "ep2_pp2"])
def test_piece_export_of_experts_equals_whole_tensor_export(models, families, world, layout, dst):
    results = run_on_ranks(_sync_worker, world, {f: models[f] for f in families}, layout, dst)
    for fam in families:
        _check([r[fam] for r in results], dst)
