"""Tiny offline HF checkpoints, and the checkpoint-directory errors (no process groups)."""

import json

import pytest
import torch

from megatron_stare.checkpoint.dist_ckpt import META_FILE, MEGATRON_META, read_meta
from megatron_stare.testing.hf_models import DEFAULT_VOCAB, build_tiny_hf_model, hf_logits


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def test_builds_are_deterministic_and_seeded(root):
    a = build_tiny_hf_model("qwen2", root / "a", seed=5)
    b = build_tiny_hf_model("qwen2", root / "b", seed=5)
    c = build_tiny_hf_model("qwen2", root / "c", seed=6)
    data = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert data[0] == data[1] != data[2]


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_tiny_model_loads_in_transformers_with_its_tokenizer(root, family):
    import transformers

    path = build_tiny_hf_model(family, root / family, tie_word_embeddings=family == "qwen3")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vocab_size"] == DEFAULT_VOCAB and DEFAULT_VOCAB % 2 == 1
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32  # vLLM-CPU head sizes
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert 300 <= len(tok) <= DEFAULT_VOCAB
    text = "Solve: 12 + 30 = \\boxed{42}."
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and max(ids) < len(tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    logits = hf_logits(path, torch.tensor([ids]))
    assert logits.shape == (1, len(ids), DEFAULT_VOCAB) and logits.std() > 0.1


def test_qwen3_head_dim_and_tied_embeddings(root):
    from safetensors import safe_open

    path = build_tiny_hf_model("qwen3", root / "q3", head_dim=48, tie_word_embeddings=True)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [4 * 48, 128]
    assert "lm_head.weight" not in names and "model.layers.0.self_attn.q_norm.weight" in names


def test_rope_scaling_changes_the_logits(root):
    tokens = torch.arange(64).unsqueeze(0) % DEFAULT_VOCAB
    plain = build_tiny_hf_model("llama", root / "plain", rope_theta=10000.0)
    scaled = {
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "linear": {"rope_type": "linear", "factor": 4.0},
    }
    base = hf_logits(plain, tokens)
    for kind, rope in scaled.items():
        other = hf_logits(build_tiny_hf_model("llama", root / kind, rope_theta=10000.0,
                                              rope_scaling=rope, max_position_embeddings=16384),
                          tokens)
        assert (other - base).abs().max() > 1e-4, kind  # so the Megatron tests test something


def test_unknown_family_is_refused(root):
    with pytest.raises(ValueError, match="unknown tiny model family 'gpt2'"):
        build_tiny_hf_model("gpt2", root / "x")


def test_missing_and_torn_checkpoints_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint at"):
        read_meta(tmp_path / "nope")
    (tmp_path / ".cut.partial").mkdir()
    with pytest.raises(ValueError, match="interrupted"):
        read_meta(tmp_path / "cut")
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / MEGATRON_META).write_text("{}")
    with pytest.raises(ValueError, match=f"incomplete \\(missing {META_FILE}\\)"):
        read_meta(torn)
