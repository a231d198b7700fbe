"""Qwen3 (dense): RMSNorm over each head's q and k (``q_norm``/``k_norm``) before rope.

Megatron's ``qk_layernorm=True`` applies ``q_layernorm``/``k_layernorm`` (RMSNorm over the head
dim, eps = rms_norm_eps) to the split heads before rotary embedding, which is exactly where
HF's Qwen3 applies them. ``head_dim`` is explicit in Qwen3 configs and may differ from
hidden/heads (Qwen3-0.6B: 1024 hidden, 16 heads of 128): it becomes ``kv_channels``.
No q/k/v biases (``attention_bias=True`` would also add an o_proj bias and is rejected).
"""

from __future__ import annotations

from megatron_stare.models.llama_like import LlamaLikeFamily
from megatron_stare.models.registry import register_architecture


@register_architecture("qwen3", "Qwen3ForCausalLM", "qwen3")
class Qwen3Family(LlamaLikeFamily):
    hf_architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    qk_norm = True
