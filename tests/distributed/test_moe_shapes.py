"""Mixture-of-experts shapes beyond the two of ``test_moe_dist.py``, converted at EP2 (one spawn,
all shapes in it): other expert counts and top-k, normalised and unnormalised top-k
probabilities, dense layers by ``decoder_sparse_step`` and by ``mlp_only_layers``, and
Qwen2-MoE's gated shared expert of a width other than the routed experts'. For each:

- Megatron's logits equal transformers' (fp32, max abs diff <= 1e-5);
- the export gives back every HF tensor bit-exactly, from the per-expert on-disk layout and
  (``FUSED``) from transformers 5's fused one, which the per-expert export fuses back into
  bit-exactly;
- transformers loads the written (per-expert) checkpoint with the same logits.
"""

import shutil
from pathlib import Path

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.hf_models import build_tiny_hf_model, hf_logits

pytestmark = pytest.mark.distributed

#: name -> (family, layers, moe fields)
SHAPES = {
    "q3_e4_top1_sparse_step2": ("qwen3_moe", 4, dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16,
                                                     norm_topk_prob=False, decoder_sparse_step=2)),
    "q3_e6_top3_dense_first": ("qwen3_moe", 3, dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                                    norm_topk_prob=True, mlp_only_layers=[0])),
    "q2_e4_top2_shared24_norm": ("qwen2_moe", 2, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                      norm_topk_prob=True, shared_expert_intermediate_size=24)),
}
FUSED = ("q3_e6_top3_dense_first", "q2_e4_top2_shared24_norm")


def _worker(rank, world, models, tokens, out_root):
    from megatron_stare.weight_sync.export import iter_hf_buckets
    from megatron_stare.weight_sync.hf_export import write_hf_checkpoint
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.models.registry import family_by_name
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.testing.hf_models import megatron_logits

    groups = init_distributed(ParallelLayout.from_world(world, ep=2))
    out = {}
    for name, path in models.items():
        model, spec, _ = build_from_hf(path, groups, make_vocab_size_divisible_by=8)
        model.eval()
        exported = {n: t.clone() for b in iter_hf_buckets(model, groups, spec, 16 << 10, dst="all") for n, t in b}
        write_hf_checkpoint(model, groups, spec, Path(out_root) / name,
                            hf_config=family_by_name(spec.architecture).hf_config(spec), side_files_dir=path)
        out[name] = {"logits": megatron_logits(model, groups, spec, tokens), "exported": exported,
                     "pattern": spec.moe.layer_pattern}
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from megatron_stare.models.moe import fuse_experts

    root = tmp_path_factory.mktemp("moe_shapes")
    tokens = torch.randint(3, 310, (2, 10), generator=torch.Generator().manual_seed(1))
    sources, originals, inputs = {}, {}, {}
    for name, (fam, layers, moe) in SHAPES.items():
        src = build_tiny_hf_model(fam, root / name, hidden_size=64, num_layers=layers, vocab_size=320,
                                  ffn_hidden_size=48, moe=moe)
        originals[name] = load_file(str(src / "model.safetensors"))
        if name in FUSED:
            fused = shutil.copytree(src, root / f"{name}_fused")
            save_file({n: t.contiguous() for n, t in fuse_experts(originals[name]).items()},
                      str(fused / "model.safetensors"), metadata={"format": "pt"})
            inputs[name] = str(fused)
        else:
            inputs[name] = str(src)
        sources[name] = src
    out_root = root / "written"
    results = run_on_ranks(_worker, 2, inputs, tokens, str(out_root))
    return {"results": results, "originals": originals, "inputs": inputs, "tokens": tokens, "written": out_root,
            "references": {n: hf_logits(sources[n], tokens) for n in SHAPES}}


@pytest.mark.parametrize("name", list(SHAPES))
def test_moe_shape_converts_exactly_at_ep2(converted, name):
    from safetensors.torch import load_file

    from megatron_stare.models.moe import fuse_experts

    ref, original = converted["references"][name], converted["originals"][name]
    for rank, res in enumerate(converted["results"]):
        r = res[name]
        err = (r["logits"] - ref).abs().max().item()
        assert err <= 1e-5, f"{name} rank {rank}: logits differ from transformers by {err}"
        assert sorted(r["exported"]) == sorted(original)
        bad = [n for n in original if not torch.equal(r["exported"][n], original[n])]
        assert not bad, f"{name} rank {rank}: {len(bad)} tensors not bit-exact, e.g. {bad[:3]}"
    layers, moe = SHAPES[name][1], SHAPES[name][2]
    step, dense = moe.get("decoder_sparse_step", 1), set(moe.get("mlp_only_layers", []))
    assert converted["results"][0][name]["pattern"] == tuple(int(i not in dense and (i + 1) % step == 0)
                                                             for i in range(layers))
    if name in FUSED:
        fused_in = load_file(str(Path(converted["inputs"][name]) / "model.safetensors"))
        fused_out = fuse_experts(converted["results"][0][name]["exported"])
        assert sorted(fused_in) == sorted(fused_out) and all(torch.equal(fused_in[n], fused_out[n]) for n in fused_in)
    assert torch.equal(hf_logits(converted["written"] / name, converted["tokens"]), ref), f"{name}: written checkpoint"
