"""HF config -> GPTSpec, the HF <-> canonical tensor mapping, and HF file I/O (no process groups)."""

import json

import pytest
import torch

from megatron_stare.models.gpt import GPTSpec
from megatron_stare.models.hf_io import HFCheckpointReader, HFShardWriter, check_hf_tensors
from megatron_stare.models.llama_like import LlamaLikeMapping
from megatron_stare.models.provider import mapping_for, spec_from_hf_config
from megatron_stare.models.registry import family_by_name

QWEN25_7B = {  # the fields of Qwen2.5-7B-Instruct's config.json that matter here
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 131072,
    "vocab_size": 152064, "torch_dtype": "bfloat16",
}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "vocab_size": 128256, "pretraining_tp": 1,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "head_dim": 128,
    "num_attention_heads": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "rope_scaling": None, "tie_word_embeddings": True,
    "attention_bias": False, "vocab_size": 151936, "max_position_embeddings": 40960,
}


def test_published_configs_map_to_specs():
    q = spec_from_hf_config(QWEN25_7B)
    assert (q.architecture, q.add_qkv_bias, q.qk_layernorm, q.num_query_groups, q.head_dim) == \
        ("qwen2", True, False, 4, 128)
    assert q.rotary_base == 1e6 and q.rope_scaling is None and not q.tie_word_embeddings
    assert q.padded_vocab_size(1) == 152064 and q.padded_vocab_size(8) == 152576
    ll = spec_from_hf_config(LLAMA31_8B)
    assert ll.rope_scaling == {"rope_type": "llama3", "factor": 8.0} and not ll.add_qkv_bias
    assert ll.norm_epsilon == 1e-5 and ll.rotary_base == 500000.0
    q3 = spec_from_hf_config(QWEN3_06B)
    assert q3.qk_layernorm and q3.head_dim == 128 != q3.hidden_size // q3.num_attention_heads
    assert q3.tie_word_embeddings


def test_transformers5_rope_parameters_are_read():
    cfg = {**LLAMA31_8B, "rope_parameters": {"rope_theta": 1234.0, **LLAMA31_8B["rope_scaling"]}}
    del cfg["rope_scaling"], cfg["rope_theta"]
    spec = spec_from_hf_config(cfg)
    assert spec.rotary_base == 1234.0 and spec.rope_scaling["rope_type"] == "llama3"
    lin = spec_from_hf_config({**cfg, "rope_parameters": {"rope_theta": 1e4, "rope_type": "linear",
                                                          "factor": 2.0}})
    assert lin.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("change,needle", [
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "unsupported HF architecture"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"rope_scaling": {**LLAMA31_8B["rope_scaling"], "low_freq_factor": 2.0}}, "low_freq_factor=2.0"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"pretraining_tp": 2}, "pretraining_tp=2"),
    ({"hidden_size": None}, None),
])
def test_unsupported_configs_name_the_field(change, needle):
    cfg = {**LLAMA31_8B, **change}
    if change.get("hidden_size", 1) is None:
        del cfg["hidden_size"]
        needle = "hidden_size missing"
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        spec_from_hf_config(cfg)


def test_sliding_window_and_multiple_problems_in_one_error():
    with pytest.raises(ValueError) as e:
        spec_from_hf_config({**QWEN25_7B, "use_sliding_window": True, "hidden_act": "relu"})
    assert "use_sliding_window=True" in str(e.value) and "hidden_act='relu'" in str(e.value)
    assert "\n" not in str(e.value)


def test_fused_qkv_is_ordered_by_query_group():
    # 4 query heads, 2 groups, head dim 1: q = [0,1,2,3], k = [10,11], v = [20,21]
    spec = GPTSpec(num_layers=1, hidden_size=4, ffn_hidden_size=4, num_attention_heads=4,
                   num_query_groups=2, vocab_size=8, kv_channels=1)
    m = LlamaLikeMapping(spec)
    q, k, v = torch.tensor([0., 1, 2, 3]), torch.tensor([10., 11]), torch.tensor([20., 21])
    fused = m.fuse_qkv(q, k, v)
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(m.split_qkv(fused), (q, k, v)))
    w = torch.arange(8 * 3.0).reshape(8, 3)  # 2-d: rows follow the same order
    fw = m.fuse_qkv(w[:4], w[4:6], w[6:])
    assert fw[:, 0].tolist() == [0, 3, 12, 18, 6, 9, 15, 21]


def _random_hf_state(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in mapping_for(spec).expected_hf_shapes().items()}


@pytest.mark.parametrize("cfg", [QWEN25_7B, LLAMA31_8B, QWEN3_06B], ids=["qwen2", "llama", "qwen3"])
def test_hf_to_canonical_to_hf_is_exact(cfg):
    shrink = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=101, head_dim=24)
    spec = spec_from_hf_config({**cfg, **shrink}, make_vocab_size_divisible_by=8)
    mapping = mapping_for(spec)
    hf = _random_hf_state(spec)
    canon_names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    canon_names += [] if spec.tie_word_embeddings else ["output_layer.weight"]
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        canon_names += [p + s for s in ("input_layernorm.weight", "self_attention.linear_qkv.weight",
                                        "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
                                        "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
        canon_names += [p + "self_attention.linear_qkv.bias"] if spec.add_qkv_bias else []
        canon_names += ([p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
                        if spec.qk_layernorm else [])
    vp = spec.padded_vocab_size(1)
    back = {}
    for name in canon_names:
        shape = (vp, 64) if "embedding" in name or "output_layer" in name else None
        t = mapping.to_canonical(name, hf.__getitem__, shape)
        if shape:  # vocabulary padded with zero rows
            assert t.shape == (vp, 64) and not t[spec.vocab_size:].any()
        back.update(mapping.to_hf(name, t))
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[n], hf[n]) and back[n].is_contiguous() for n in hf)
    if cfg is QWEN3_06B:  # tied: the output layer is the embedding, exported once
        assert mapping.to_hf("output_layer.weight", torch.zeros(vp, 64)) == []


@pytest.mark.parametrize("cfg", [QWEN25_7B, LLAMA31_8B, QWEN3_06B], ids=["qwen2", "llama", "qwen3"])
def test_hf_row_maps_equal_to_hf(cfg):
    """The piece export's row maps (``hf_rows``) give every HF tensor exactly as ``to_hf``
    does: same names, shapes and rows (QKV groups, gate/up halves, the vocabulary unpadded)."""
    shrink = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=6,
                  num_key_value_heads=2, vocab_size=101, head_dim=8)
    spec = spec_from_hf_config({**cfg, **shrink}, make_vocab_size_divisible_by=8)
    mapping, vp = mapping_for(spec), spec.padded_vocab_size(1)
    g = torch.Generator().manual_seed(0)
    names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"]
    names += [f"decoder.layers.0.{s}" for s in ("input_layernorm.weight", "self_attention.linear_qkv.weight",
                                                "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                                                "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
    shapes = {"embedding": (vp, 64), "output_layer": (vp, 64), "norm": (64,), "linear_qkv.weight": (8 * 10, 64),
              "linear_qkv.bias": (80,), "linear_proj": (64, 48), "fc1": (192, 64), "fc2": (64, 96)}
    for name in names:
        shape = next(v for k, v in shapes.items() if k in name)
        canon = torch.randn(shape, generator=g)
        want = mapping.to_hf(name, canon)
        got = []
        for hf in mapping.hf_rows(name, shape):
            out = torch.full(hf.shape, float("nan"))
            for hf_row, c_row, n in hf.runs:
                out[hf_row:hf_row + n] = canon[c_row:c_row + n]
            got.append((hf.name, out))
        assert [n for n, _ in got] == [n for n, _ in want], name
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want)), name


def test_te_fused_norm_names_map_like_local_ones():
    spec = spec_from_hf_config({**LLAMA31_8B, "num_hidden_layers": 1})
    m = mapping_for(spec)
    assert m.hf_sources("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == \
        ["model.layers.0.input_layernorm.weight"]
    assert m.hf_sources("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        ["model.layers.0.post_attention_layernorm.weight"]


def test_hf_config_from_spec_round_trips():
    for cfg in (QWEN25_7B, LLAMA31_8B, QWEN3_06B):
        spec = spec_from_hf_config(cfg)
        again = spec_from_hf_config(family_by_name(spec.architecture).hf_config(spec))
        assert again == spec


def test_shard_writer_and_lazy_reader(tmp_path):
    tensors = {f"t{i}": torch.full((10, i + 1), float(i)) for i in range(5)}
    w = HFShardWriter(tmp_path)
    w.write([(n, tensors[n]) for n in ("t0", "t1", "t2")])
    w.write([(n, tensors[n]) for n in ("t3", "t4")])
    paths = w.finish()
    assert [p.name for p in paths] == ["model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["t4"] == "model-00002-of-00002.safetensors"
    r = HFCheckpointReader(tmp_path)
    assert r.names() == sorted(tensors) and r.shape("t3") == (10, 4)
    assert all(torch.equal(r.get(n), t) for n, t in tensors.items())
    with pytest.raises(ValueError, match="'nope' not found"):
        r.get("nope")
    with pytest.raises(ValueError, match="no model.safetensors"):
        HFCheckpointReader(tmp_path / "empty")


def test_check_hf_tensors_names_missing_extra_and_misshaped():
    expected = {"a": (2, 3), "b": (4,), "c": (1,)}
    check_hf_tensors({"a": (2, 3), "b": (4,), "c": (1,), "x.rotary_emb.inv_freq": (8,)}, expected, "d")
    with pytest.raises(ValueError) as e:
        check_hf_tensors({"a": (3, 2), "b": (4,), "zz": (1,)}, expected, "dir")
    msg = str(e.value)
    assert "missing" in msg and "'c'" in msg and "'zz'" in msg and "a: expected (2, 3), got (3, 2)" in msg
