"""Mixture-of-experts HF checkpoints (Qwen3-MoE with a dense layer in between; Qwen2-MoE with
its gated shared expert) loaded into Megatron on gloo at EP2, EP2xTP2, EP2xPP2 and EP2xETP2:

- Megatron logits equal transformers' logits (fp32, max abs diff <= 1e-5), the reference;
- the streaming export (whole tensors, to every rank and to rank 0 only) gives back every HF
  tensor bit-exactly, read from either on-disk layout: the published per-expert one (Qwen3-MoE)
  and transformers 5's fused ``gate_up_proj``/``down_proj`` (Qwen2-MoE, written fused here);
  the export is per-expert, which transformers loads again (the logits of the written
  directory equal the original's).

One spawn per layout; both families in each.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.hf_models import build_tiny_hf_model, hf_logits

pytestmark = pytest.mark.distributed

VOCAB_MULTIPLE = 8
#: (id, world, layout knobs). TP > 1 with experts needs sequence parallel (megatron's MoE layer).
LAYOUTS = [
    ("ep2", 2, dict(ep=2)),
    ("ep2_tp2", 4, dict(ep=2, tp=2, sequence_parallel=True)),
    ("ep2_pp2", 4, dict(ep=2, pp=2)),
    ("ep2_etp2", 4, dict(ep=2, etp=2)),
]
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                 mlp_only_layers=[1])
QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                 shared_expert_intermediate_size=48)


def _worker(rank, world, lay, models, tokens, out_root):
    from megatron_stare.weight_sync.export import iter_hf_buckets
    from megatron_stare.weight_sync.hf_export import write_hf_checkpoint
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.models.registry import family_by_name
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.testing.hf_models import megatron_logits

    groups = init_distributed(ParallelLayout.from_world(world, **lay))
    out = {}
    for fam, path in models.items():
        model, spec, _ = build_from_hf(path, groups, make_vocab_size_divisible_by=VOCAB_MULTIPLE)
        model.eval()
        r = {"logits": megatron_logits(model, groups, spec, tokens)}
        got = {n: t.clone() for b in iter_hf_buckets(model, groups, spec, 16 << 10, dst="all") for n, t in b}
        r["all"] = got
        got0 = {n: t.clone() for b in iter_hf_buckets(model, groups, spec, 16 << 10, dst=0) for n, t in b}
        r["dst0_empty_elsewhere"] = rank == 0 or not got0
        if rank == 0:
            r["dst0"] = got0
        written = Path(out_root) / fam
        write_hf_checkpoint(model, groups, spec, written, hf_config=family_by_name(spec.architecture).hf_config(spec),
                            side_files_dir=path)
        out[fam] = r
    return out


def _write_fused(src: Path, dst: Path) -> Path:
    """``src`` (per-expert layout) rewritten in transformers 5's fused expert layout."""
    from safetensors.torch import load_file, save_file

    from megatron_stare.models.moe import fuse_experts

    shutil.copytree(src, dst)
    tensors = fuse_experts(load_file(str(src / "model.safetensors")))
    (dst / "model.safetensors").unlink()
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe")
    q3 = build_tiny_hf_model("qwen3_moe", root / "qwen3_moe", hidden_size=64, num_layers=4, vocab_size=320,
                             ffn_hidden_size=96, moe=QWEN3_MOE)
    q2 = build_tiny_hf_model("qwen2_moe", root / "qwen2_moe_src", hidden_size=64, num_layers=2, vocab_size=320,
                             ffn_hidden_size=96, moe=QWEN2_MOE)
    return {"qwen3_moe": q3, "qwen2_moe": _write_fused(q2, root / "qwen2_moe_fused"), "_qwen2_src": q2}


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 310, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def references(models, tokens):
    return {fam: hf_logits(models[fam], tokens) for fam in ("qwen3_moe", "qwen2_moe")}


def test_fused_layout_is_what_the_test_claims(models):
    from safetensors import safe_open

    with safe_open(str(models["qwen2_moe"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)


def test_transformers_reads_the_fused_layout_like_the_per_expert_one(models, tokens, references):
    assert torch.equal(hf_logits(models["_qwen2_src"], tokens), references["qwen2_moe"])


@pytest.mark.parametrize("name,world,lay", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_moe_layout(name, world, lay, models, tokens, references, tmp_path):
    from safetensors.torch import load_file

    from megatron_stare.models.moe import fuse_experts

    fams = {k: str(v) for k, v in models.items() if not k.startswith("_")}
    results = run_on_ranks(_worker, world, lay, fams, tokens, str(tmp_path))
    originals = {"qwen3_moe": load_file(str(models["qwen3_moe"] / "model.safetensors")),
                 "qwen2_moe": load_file(str(models["_qwen2_src"] / "model.safetensors"))}
    for fam, ref in references.items():
        for rank, res in enumerate(results):
            r = res[fam]
            err = (r["logits"] - ref).abs().max().item()
            assert err <= 1e-5, f"{name} {fam} rank {rank}: logits differ from transformers by {err}"
            got = r["all"]
            assert sorted(got) == sorted(originals[fam]), f"{name} {fam}: exported names differ"
            bad = [n for n in got if not torch.equal(got[n], originals[fam][n])]
            assert not bad, f"{name} {fam} rank {rank}: {len(bad)} tensors not bit-exact, e.g. {bad[:3]}"
            assert r["dst0_empty_elsewhere"]
        dst0 = results[0][fam]["dst0"]
        assert sorted(dst0) == sorted(originals[fam]) and all(torch.equal(dst0[n], originals[fam][n]) for n in dst0)
        # The fused input comes back fused bit-exactly from the per-expert export.
        if fam == "qwen2_moe":
            fused_in = load_file(str(models["qwen2_moe"] / "model.safetensors"))
            fused_out = fuse_experts(results[0][fam]["all"])
            assert sorted(fused_in) == sorted(fused_out)
            assert all(torch.equal(fused_in[n], fused_out[n]) for n in fused_in)
        # What we write (per-expert), transformers loads with the same logits.
        cfg = json.loads((tmp_path / fam / "config.json").read_text())
        assert cfg["architectures"][0] in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
        assert torch.equal(hf_logits(tmp_path / fam, tokens), ref), f"{name} {fam}: written checkpoint"
