"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with top-k
routed experts plus a shared expert whose output is scaled by ``sigmoid(shared_expert_gate . x)``
(megatron's ``moe_shared_expert_gate``).

``norm_topk_prob`` is false in published Qwen2-MoE configs: the top-k probabilities are the
softmax over all experts, unnormalised (megatron's ``moe_router_pre_softmax=True``).
"""

from __future__ import annotations

from megatron_stare.models.moe import MoEFamily
from megatron_stare.models.registry import register_architecture


@register_architecture("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe")
class Qwen2MoeFamily(MoEFamily):
    hf_architecture = "Qwen2MoeForCausalLM"
    model_type = "qwen2_moe"
    qkv_bias = True
    shared_expert = True
