"""Build a megatron-core ``GPTModel`` stage from a typed, architecture-neutral ``GPTSpec``.

``GPTSpec`` holds what Megatron needs to know about a decoder-only transformer (Qwen2/2.5,
Llama 2/3, Qwen3 all fit). The HF ``config.json`` -> ``GPTSpec`` step lives with each
architecture's mapping; this module only turns a spec into the local pipeline stage of a
Megatron model on this rank: transformer-engine's layer spec where TE and CUDA exist, else
the local spec with our norms and our torch attention (``layer_specs``, ``torch_attention``),
which run sequence parallel, context parallel and packed sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron_stare.models.layer_specs import local_block_spec


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts part of a decoder (Qwen3-MoE, Qwen2-MoE), in Megatron's terms.

    ``layer_pattern[i]`` is 1 where layer i routes over experts and 0 where it keeps the dense
    MLP of ``GPTSpec.ffn_hidden_size`` (megatron's ``moe_layer_freq`` list).
    ``norm_topk_prob``: the top-k probabilities are renormalised to sum to one (megatron's
    softmax over the top-k logits, ``moe_router_pre_softmax=False``); otherwise they are the
    top-k entries of the softmax over all experts (``moe_router_pre_softmax=True``).
    ``shared_expert_size`` > 0 adds an always-on expert of that width, scaled by
    ``sigmoid(gate . x)`` when ``shared_expert_gate`` (Qwen2-MoE).
    """

    num_experts: int
    topk: int
    ffn_hidden_size: int
    layer_pattern: Tuple[int, ...]
    norm_topk_prob: bool = True
    shared_expert_size: int = 0
    shared_expert_gate: bool = False


@dataclass(frozen=True)
class GPTSpec:
    """Shape and options of a decoder-only transformer, in Megatron's terms.

    ``vocab_size`` is the tokenizer/HF vocabulary; Megatron's embedding holds
    ``padded_vocab_size(tp)`` rows, the extra rows being padding that is never a target.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    kv_channels: Optional[int] = None  # head dim; default hidden // heads
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0
    rope_scaling: Optional[dict] = None  # {"rope_type": "llama3" | "linear", "factor": 8.0}
    norm_epsilon: float = 1e-6
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False
    make_vocab_size_divisible_by: int = 128
    architecture: str = "qwen2"
    moe: Optional[MoESpec] = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)


def transformer_engine_error() -> Optional[str]:
    """Why transformer-engine's PyTorch layers do not import here (one line), or None."""
    try:
        import transformer_engine.pytorch  # noqa: F401 - optional GPU accelerator, imported to test it
    except Exception as e:  # noqa: BLE001 - any failure is reported, never swallowed
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


def have_transformer_engine() -> bool:
    """True when transformer-engine imports (an optional GPU accelerator, never required)."""
    return transformer_engine_error() is None


ATTENTION_BACKENDS = ("auto", "te", "torch")


def resolve_attention(backend: str = "auto", cuda: Optional[bool] = None) -> str:
    """``model.attention_backend`` -> the layer spec's attention, ``"te"`` or ``"torch"``.

    'auto': transformer-engine on CUDA, the torch attention on CPU. On CUDA a transformer-engine
    that fails to import is an error naming the import error, never a silent switch to the
    torch attention (which must be chosen explicitly: 'torch')."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"model.attention_backend={backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if backend == "torch" or (backend == "auto" and not cuda):
        return "torch"
    if not cuda:
        raise ValueError("model.attention_backend=te needs CUDA (transformer-engine's attention); "
                         "on CPU set model.attention_backend=auto or torch")
    err = transformer_engine_error()
    if err is not None:
        raise ValueError(f"model.attention_backend={backend} on CUDA means transformer-engine's attention, "
                         f"but importing transformer_engine.pytorch failed ({err}); fix the install or set "
                         f"model.attention_backend=torch")
    return "te"


def moe_config_kwargs(moe: MoESpec, *, ep: int = 1, etp: int = 1, aux_loss_coeff: float = 0.0,
                      z_loss_coeff: float = 0.0) -> dict:
    """``TransformerConfig`` fields of ``moe``: SequentialMLP experts (pure torch; grouped GEMM
    is a GPU option, ``moe_grouped_gemm=True`` in the overrides), the alltoall dispatcher, no
    token dropping (no capacity factor), the router in fp32. The load-balancing loss and the
    z-loss are off unless their coefficients are > 0 (RL fine-tuning, as peers do)."""
    return dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=list(moe.layer_pattern), moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_shared_expert_intermediate_size=moe.shared_expert_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=float(aux_loss_coeff), moe_z_loss_coeff=float(z_loss_coeff) if z_loss_coeff > 0 else None,
    )


def transformer_config(spec: GPTSpec, tp: int, pp: int, *, cp: int = 1, dtype: torch.dtype = torch.float32,
                       sequence_parallel: bool = False, recompute: Optional[str] = None, ep: int = 1,
                       etp: int = 1, moe_aux_loss_coeff: float = 0.0, moe_z_loss_coeff: float = 0.0,
                       **overrides):
    """The megatron-core ``TransformerConfig`` for ``spec`` at tensor/pipeline/context degrees
    tp, pp, cp (and expert / expert-tensor degrees ep, etp with the router losses of a
    mixture-of-experts ``spec``: ``models/moe.py``). Megatron's RoPE reads
    ``context_parallel_size`` to give each CP rank the positions of its chunks; attention reads
    the CP group."""

    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # The fused kernels need CUDA extensions (apex, TE) this path does not assume: all off.
        **dict.fromkeys(("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
                         "apply_rope_fusion", "gradient_accumulation_fusion", "persist_layer_norm"), False),
        variable_seq_lengths=True,  # micro-batches of a token budget differ in length
        moe_token_dispatcher_type="alltoall",  # (only so Megatron accepts variable lengths)
    )
    if spec.moe is not None:
        kwargs.update(moe_config_kwargs(spec.moe, ep=ep, etp=etp, aux_loss_coeff=moe_aux_loss_coeff,
                                        z_loss_coeff=moe_z_loss_coeff))
    assert recompute != "auto", "parallel.recompute=auto is resolved before the model is built (plan.py)"
    if recompute in ("full", "selective"):
        kwargs.update(recompute_granularity=recompute,
                      **({"recompute_method": "uniform", "recompute_num_layers": 1}
                         if recompute == "full" else {}))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_stage(spec: GPTSpec, config, *, pre_process: bool, post_process: bool,
                    tp: int, use_te: Optional[bool] = None, attention: Optional[str] = None):
    """This rank's pipeline stage of the model (weights randomly initialised by Megatron).

    ``attention``: ``"te"`` (transformer-engine's spec), ``"torch"`` or ``"megatron"`` (the local
    spec with that core attention, ``layer_specs.CORE_ATTENTION``) or ``"auto"``
    (``resolve_attention``); None: ``use_te`` when given, else ``"auto"``.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_stare.models import moe_router

    if spec.moe is not None:
        moe_router.install()  # the z-loss as the micro-batch's token mean under SP/CP
    if attention is None:
        attention = ("te" if use_te else "torch") if use_te is not None else "auto"
    if attention == "auto":
        attention = resolve_attention("auto")
    # The local spec's norms are ours (layer_specs.TorchNorm): they support sequence parallel.
    if attention == "te" and spec.moe is not None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    else:
        layer_spec = (get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_layernorm)
                      if attention == "te" else local_block_spec(config, spec.qk_layernorm, attention=attention))
    rope = dict(rotary_base=int(spec.rotary_base))
    if spec.rope_scaling and spec.rope_scaling.get("rope_type") == "linear":
        # HF divides the frequencies by the factor; Megatron divides the positions (same angle).
        rope.update(seq_len_interpolation_factor=float(spec.rope_scaling["factor"]))
    elif spec.rope_scaling:
        rope.update(rope_scaling=True, rope_scaling_factor=float(spec.rope_scaling.get("factor", 8.0)))
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab_size(tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        **rope,
    )
