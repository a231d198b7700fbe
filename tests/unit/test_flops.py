"""The model-FLOP count (``models/flops.py``) against a hand computation on a tiny config."""

from megatron_stare.models.flops import FlopShape, step_flops


def test_tiny_config_by_hand():
    # h=8, 2 layers, 2 heads of 4, 1 KV head, ffn 16, vocab 10, tied.
    # Per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192, MLP 3*8*16 = 384 -> N = 2*576 = 1152.
    shape = FlopShape(hidden=8, num_layers=2, heads=2, head_dim=4, vocab=10, layer_matmul_params=576)
    assert shape.matmul_params == 1152
    # Sequences of 3 and 1 tokens: weights 2*1152*4 = 9216; projection 2*8*10*4 = 640;
    # attention pairs 3*4/2 + 1 = 7, 4 * 2 layers * 2 heads * 4 * 7 = 448.
    assert shape.forward([3, 1]) == 9216 + 640 + 448
    f = step_flops(shape, [3, 1])
    assert (f.logprob, f.update, f.train) == (10304, 3 * 10304, 4 * 10304)
    assert step_flops(shape, [3, 1], ppo_epochs=2, logprob_pass=False).train == 6 * 10304


def test_from_hf_config_counts_the_layers_matrices_not_the_tied_embedding():
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
           "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10, "tie_word_embeddings": True,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 32}
    assert FlopShape.from_hf_config(cfg) == FlopShape(8, 2, 2, 4, 10, 576)
