"""Llama 2 / Llama 3 / 3.1 / 3.2: no biases, GQA, optional Llama-3 or linear rope scaling.

Rope scaling: megatron-core 0.16's ``RotaryEmbedding(rope_scaling=True, rope_scaling_factor=f)``
is HF's ``rope_type="llama3"`` with low_freq_factor 1, high_freq_factor 4 and
original_max_position_embeddings 8192 hard-coded (the values of every published Llama 3.x);
other values are rejected by ``rope_from_hf`` rather than silently computing different
frequencies. ``rope_type="linear"`` maps to Megatron's position interpolation
(``seq_len_interpolation_factor``). ``attention_bias=True`` / ``mlp_bias=True`` variants need
output-projection / MLP biases Megatron's spec here does not have, and are rejected.
"""

from __future__ import annotations

from megatron_stare.models.llama_like import LlamaLikeFamily
from megatron_stare.models.registry import register_architecture


@register_architecture("llama", "LlamaForCausalLM", "llama")
class LlamaFamily(LlamaLikeFamily):
    hf_architecture = "LlamaForCausalLM"
    model_type = "llama"

    @classmethod
    def problems(cls, cfg: dict):
        out = super().problems(cfg)
        if int(cfg.get("pretraining_tp", 1)) != 1:
            # HF splits the matmuls into slices: same maths, different rounding.
            out.append(f"pretraining_tp={cfg['pretraining_tp']} (set it to 1; it only changes "
                       f"HF's matmul slicing)")
        return out
