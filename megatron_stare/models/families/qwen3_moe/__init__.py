"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm, no biases) with
top-k routed experts and no shared expert.

Routing: softmax over all experts, top-k, and with ``norm_topk_prob`` (true in published
Qwen3-MoE configs) the k probabilities renormalised to sum to one, which is megatron's softmax
over the top-k logits (``moe_router_pre_softmax=False``). The mapping is ``moe.MoEMapping``.
"""

from __future__ import annotations

from megatron_stare.models.moe import MoEFamily
from megatron_stare.models.registry import register_architecture


@register_architecture("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe")
class Qwen3MoeFamily(MoEFamily):
    hf_architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    qk_norm = True
