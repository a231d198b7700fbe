"""Sizes of a Llama-like decoder: parameter counts from an HF config and the activation bytes a
transformer layer saves for backward (used by the dry-run planner, ``megatron_stare.plan.planner``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from megatron_stare.models.registry import family_for_config


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a Llama-like decoder (unpadded HF vocabulary unless stated)."""

    embedding: int
    """Input embedding, ``V*h``."""
    attention: int
    """Per layer: q (``h*h``), k and v (``h*kv*hd`` each), o (``h*h``), plus q/k/v biases."""
    mlp: int
    """Per layer: gate, up and down projections, ``3*h*ffn``; a mixture-of-experts model: the
    mean per layer of its dense MLPs, routers (``E*h``) and shared experts (not the routed ones)."""
    norms: int
    """Per layer: input and pre-MLP RMSNorm (``2*h``), plus Qwen3's q/k norms (``2*hd``)."""
    num_layers: int
    final_norm: int
    output_layer: int
    """``V*h``; 0 when tied to the embedding."""
    experts: int = 0
    """Mixture of experts: the routed experts' parameters (``E*3*h*I`` per MoE layer), mean
    per layer; they shard over expert parallel (``ep*etp``), the rest over tp."""

    @property
    def per_layer(self) -> int:
        return self.attention + self.mlp + self.norms + self.experts

    @property
    def total(self) -> int:
        return self.embedding + self.num_layers * self.per_layer + self.final_norm + self.output_layer


def _spec(hf_config: dict):
    """The ``GPTSpec`` of an HF config dict; ValueError names an unsupported architecture/field."""

    return family_for_config(hf_config).spec_from_hf(hf_config)


def _counts(spec, vocab: int, kv_heads: Optional[float] = None) -> ParamCounts:
    h, hd = spec.hidden_size, spec.head_dim
    q_dim = spec.num_attention_heads * hd
    kv_dim = (spec.num_query_groups if kv_heads is None else kv_heads) * hd
    bias = spec.add_qkv_bias
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h + ((q_dim + 2 * kv_dim) if bias else 0)
    mlp, experts, moe, n = 3 * h * spec.ffn_hidden_size, 0, spec.moe, spec.num_layers
    if moe is not None:
        sparse = sum(moe.layer_pattern)
        shared = 3 * h * moe.shared_expert_size + (h if moe.shared_expert_gate else 0)
        mlp = ((n - sparse) * mlp + sparse * (moe.num_experts * h + shared)) // n
        experts = sparse * moe.num_experts * 3 * h * moe.ffn_hidden_size // n
    return ParamCounts(
        embedding=vocab * h, attention=int(attention), mlp=mlp,
        norms=2 * h + (2 * hd if spec.qk_layernorm else 0), num_layers=n,
        final_norm=h, output_layer=0 if spec.tie_word_embeddings else vocab * h, experts=experts)


def param_counts(hf_config: dict) -> ParamCounts:
    """Parameter counts of an HF ``config.json`` dict (qwen2, llama, qwen3; tied or untied)."""
    spec = _spec(hf_config)
    return _counts(spec, spec.vocab_size)


def layer_activation_bytes(s: int, h: int, heads: int, kv_dim: int, ffn: int, *, tp: int = 1,
                           sequence_parallel: bool = False, gated: bool = True,
                           flash_attention: bool = True, b: int = 1) -> float:
    """Activation bytes one transformer layer saves for backward (bf16, no recompute).

    Korthikanti et al. 2022, table 2, term by term (in units of ``s*b*h`` bytes): replicated
    across TP unless sequence parallel: the attention and MLP inputs (2 + 2), their dropout
    masks (1 + 1) and the two norms' inputs (4) = 10; split by TP: Q, K, V (2 + 4*kv_dim/h),
    the attention output (2), the MLP's fc1 output and activation output (SwiGLU 6*ffn/h, GELU
    4*ffn/h) and, without flash attention, softmax + dropout (5*a*s/h). GPT (kv_dim = h,
    ffn = 4h, GELU, no flash, tp 1) gives Korthikanti's ``s*b*h*(34 + 5*a*s/h)``.
    """
    replicated = 10.0
    split = 2.0 + 4.0 * kv_dim / h + 2.0 + (6.0 if gated else 4.0) * ffn / h
    if not flash_attention:
        split += 5.0 * heads * s / h
    per_sbh = (replicated + split) / tp if sequence_parallel else replicated + split / tp
    return float(s) * b * h * per_sbh
