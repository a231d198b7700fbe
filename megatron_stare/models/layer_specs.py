"""Megatron layer specs of our own where megatron-core's local spec falls short.

``TorchNorm`` is torch's ``RMSNorm``/``LayerNorm`` (what megatron-core's ``WrappedTorchNorm``
builds), in the model's params dtype, with its parameters marked ``sequence_parallel`` exactly as
Megatron's TE and Apex norms mark theirs. Under sequence parallelism each tensor-parallel rank normalises a different slice of
the sequence, so the replicated norm weights get partial gradients; ``finalize_model_grads``
sums the gradients of parameters so marked over the TP group. ``WrappedTorchNorm`` marks nothing
and therefore refuses sequence parallelism; with this norm the local (non-TE) spec runs it.

``local_block_spec`` is megatron-core's local GPT layer spec with every norm (input, pre-MLP,
q/k and the block's final norm) replaced by ``TorchNorm``, and its core attention chosen from
``CORE_ATTENTION``: ``"torch"`` (default; ``torch_attention.TorchDotProductAttention``, which
runs context parallel and packed sequences) or ``"megatron"`` (megatron-core's local
``DotProductAttention``, which refuses both; kept to compare against).
"""

from __future__ import annotations

import dataclasses

import torch


class TorchNorm:
    """Factory with ``WrappedTorchNorm``'s signature: a torch norm whose params carry
    ``sequence_parallel = config.sequence_parallel``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("TorchNorm supports neither zero-centered gamma, persist_layer_norm nor "
                             "memory_efficient_layer_norm; use the transformer-engine spec for those")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"TorchNorm supports {sorted(kinds)}, not {config.normalization!r}")
        # In the model's params dtype, as TE's norms: a bf16 model with fp32 norms would mix
        # dtypes in one optimizer group, which megatron-core's distributed-optimizer
        # checkpointing maps wrongly (it assumes one order of fp32 and 16-bit params).
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)
        return norm


def _core_attention(name: str):
    if name == "torch":
        from megatron_stare.models.torch_attention import TorchDotProductAttention

        return TorchDotProductAttention
    if name == "megatron":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention
    raise ValueError(f"core attention {name!r} is not one of {CORE_ATTENTION}")


#: Core attentions of the local spec (``local_block_spec(..., attention=)``).
CORE_ATTENTION = ("torch", "megatron")


def _local_layer(config, qk_layernorm: bool, attention: str, num_experts=None):
    """megatron-core's local layer spec (a MoE layer with SequentialMLP experts when
    ``num_experts``) with ``TorchNorm`` everywhere and ``attention`` as the core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                     qk_layernorm=qk_layernorm, normalization=config.normalization)
    sub = layer.submodules
    attn = dataclasses.replace(sub.self_attention.submodules, core_attention=_core_attention(attention))
    if qk_layernorm:
        attn = dataclasses.replace(attn, q_layernorm=TorchNorm, k_layernorm=TorchNorm)
    return dataclasses.replace(layer, submodules=dataclasses.replace(
        sub, input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm,
        self_attention=dataclasses.replace(sub.self_attention, submodules=attn)))


def local_block_spec(config, qk_layernorm: bool, *, attention: str = "torch", vp_stage=None, pp_rank=None):
    """``TransformerBlockSubmodules`` of this pipeline stage: the local layer spec with
    ``TorchNorm`` everywhere, ``TorchNorm`` as the final norm, and ``attention`` (one of
    ``CORE_ATTENTION``) as the core attention. With ``config.num_moe_experts``, the layers
    that ``config.moe_layer_freq`` (a 0/1 list over all layers) marks 1 are MoE layers."""
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    dense = _local_layer(config, qk_layernorm, attention)
    if not config.num_moe_experts:
        return TransformerBlockSubmodules(layer_specs=[dense] * n, layer_norm=TorchNorm)
    moe = _local_layer(config, qk_layernorm, attention, num_experts=config.num_moe_experts)
    pattern = config.moe_layer_freq
    if isinstance(pattern, int):
        pattern = [int(i % pattern == 0) for i in range(config.num_layers)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    layers = [moe if pattern[offset + i] else dense for i in range(n)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TorchNorm)
