"""Qwen2 / Qwen2.5 (and DeepSeek-R1-Distill-Qwen, which is a Qwen2): q/k/v biases, no o_proj bias.

Differences from the shared Llama-like mapping: the q/k/v projections always carry biases
(fused into ``linear_qkv.bias`` by query group like the weights) and the config has no
``attention_bias`` field. Sliding-window attention (``use_sliding_window``) is rejected:
published Qwen2.5 checkpoints set it to false.
"""

from __future__ import annotations

from megatron_stare.models.llama_like import LlamaLikeFamily
from megatron_stare.models.registry import register_architecture


@register_architecture("qwen2", "Qwen2ForCausalLM", "qwen2")
class Qwen2Family(LlamaLikeFamily):
    hf_architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    qkv_bias = True
