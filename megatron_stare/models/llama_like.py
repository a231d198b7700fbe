"""The mapping shared by Llama-like decoders (Llama 2/3, Qwen2/2.5, Qwen3): HF <-> canonical.

"Canonical" means Megatron's names and layouts as a single-rank (TP=1, PP=1) model holds them;
``sharding.py`` turns canonical tensors into any TP/PP layout's shards and back. This module is
the ONE place where HF names meet Megatron names, used by the converters and the live weight
sync alike:

====================================================  ==============================================
Megatron (canonical)                                  HF
====================================================  ==============================================
embedding.word_embeddings.weight  [Vp, H]             model.embed_tokens.weight [V, H] (zero pad rows)
output_layer.weight               [Vp, H]             lm_head.weight (tied: model.embed_tokens.weight)
decoder.final_layernorm.weight                        model.norm.weight
decoder.layers.i.input_layernorm.weight               model.layers.i.input_layernorm.weight
decoder.layers.i.self_attention.linear_qkv.{w,b}      self_attn.{q,k,v}_proj.{weight,bias}, fused by
                                                      query group: [q heads of g; k_g; v_g] for each g
decoder.layers.i.self_attention.q_layernorm.weight    self_attn.q_norm.weight (Qwen3)
decoder.layers.i.self_attention.k_layernorm.weight    self_attn.k_norm.weight (Qwen3)
decoder.layers.i.self_attention.linear_proj.weight    self_attn.o_proj.weight
decoder.layers.i.pre_mlp_layernorm.weight             post_attention_layernorm.weight
decoder.layers.i.mlp.linear_fc1.weight [2F, H]        [mlp.gate_proj.weight; mlp.up_proj.weight]
decoder.layers.i.mlp.linear_fc2.weight                mlp.down_proj.weight
====================================================  ==============================================

With the transformer-engine layer spec the two pre-norms are fused into the next linear
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); ``_local_suffix`` maps
those to the local-spec names, so one table serves both specs.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from megatron_stare.models.gpt import GPTSpec

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

#: One-to-one layer tensors: canonical suffix -> HF suffix.
_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_GLOBAL_SIMPLE = {"decoder.final_layernorm.weight": "model.norm.weight"}
_EMBED, _OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
_HF_EMBED, _HF_HEAD = "model.embed_tokens.weight", "lm_head.weight"

GetHF = Callable[[str], torch.Tensor]


class HFRows(NamedTuple):
    """One HF tensor as dim-0 row runs of a canonical tensor: HF rows ``[hf_row, hf_row + n)``
    are canonical rows ``[canonical_row, canonical_row + n)`` for each ``(hf_row,
    canonical_row, n)`` in ``runs`` (in HF row order; together they cover the HF tensor)."""

    name: str
    shape: Tuple[int, ...]
    runs: Tuple[Tuple[int, int, int], ...]


def _local_suffix(suffix: str) -> str:
    return _TE_FUSED_NORMS.get(suffix, suffix)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad the vocabulary dim of ``t`` [V, H] to ``rows``; padding rows are never targets."""
    if t.shape[0] > rows:
        raise ValueError(f"HF vocabulary has {t.shape[0]} rows, more than Megatron's {rows}")
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])


class LlamaLikeMapping:
    """HF <-> canonical tensors for one ``GPTSpec`` (shapes come from the spec).

    ``to_canonical`` (import) builds one canonical tensor from the HF tensors it needs, asking
    ``get_hf(name)`` for each, so a lazy reader only touches the tensors this rank loads.
    ``to_hf`` (export) turns one canonical tensor into its HF ``(name, tensor)`` pairs, each
    contiguous (split pieces are copies; unsplit tensors may be the canonical tensor itself).
    """

    def __init__(self, spec: GPTSpec) -> None:
        self.spec = spec

    # --- fused QKV -------------------------------------------------------------------------
    def _qkv_sizes(self) -> Tuple[int, int, int]:
        s = self.spec
        return s.num_query_groups, s.num_attention_heads // s.num_query_groups, s.head_dim

    def fuse_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[nq*d, ...], [ng*d, ...], [ng*d, ...] -> [(nq + 2ng)*d, ...] ordered by query group."""
        ng, per, d = self._qkv_sizes()
        rest = tuple(q.shape[1:])
        fused = torch.cat([q.reshape((ng, per * d) + rest), k.reshape((ng, d) + rest),
                           v.reshape((ng, d) + rest)], dim=1)
        return fused.reshape((-1,) + rest)

    def split_qkv(self, fused: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inverse of ``fuse_qkv``."""
        ng, per, d = self._qkv_sizes()
        rest = tuple(fused.shape[1:])
        q, k, v = fused.reshape((ng, (per + 2) * d) + rest).split([per * d, d, d], dim=1)
        return (q.reshape((-1,) + rest).contiguous(), k.reshape((-1,) + rest).contiguous(),
                v.reshape((-1,) + rest).contiguous())

    # --- import ----------------------------------------------------------------------------
    def hf_sources(self, canonical: str) -> List[str]:
        """The HF tensor names that ``canonical`` is built from."""
        if canonical == _EMBED or (canonical == _OUTPUT and self.spec.tie_word_embeddings):
            return [_HF_EMBED]
        if canonical == _OUTPUT:
            return [_HF_HEAD]
        if canonical in _GLOBAL_SIMPLE:
            return [_GLOBAL_SIMPLE[canonical]]
        m = _LAYER_RE.match(canonical)
        if not m:
            raise ValueError(f"no HF mapping for Megatron tensor {canonical!r}")
        i, suffix = m.group(1), _local_suffix(m.group(2))
        p = f"model.layers.{i}."
        if suffix in _LAYER_SIMPLE:
            return [p + _LAYER_SIMPLE[suffix]]
        if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            return [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]
        if suffix == "mlp.linear_fc1.weight":
            return [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        raise ValueError(f"no HF mapping for Megatron tensor {canonical!r}")

    def to_canonical(self, canonical: str, get_hf: GetHF, shape: Tuple[int, ...]) -> torch.Tensor:
        """The canonical tensor ``canonical`` of ``shape`` from HF tensors (``get_hf(name)``)."""
        srcs = [get_hf(n) for n in self.hf_sources(canonical)]
        if canonical in (_EMBED, _OUTPUT):
            return _pad_rows(srcs[0], shape[0])
        if ".linear_qkv." in canonical and not canonical.endswith("layer_norm_weight"):
            return self.fuse_qkv(*srcs)
        if canonical.endswith("mlp.linear_fc1.weight"):
            return torch.cat(srcs, dim=0)
        return srcs[0]

    # --- export ----------------------------------------------------------------------------
    def to_hf(self, canonical: str, tensor: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """HF ``(name, tensor)`` pairs of one canonical tensor; [] for the tied output layer."""
        if canonical == _OUTPUT and self.spec.tie_word_embeddings:
            return []  # the same tensor as the embedding, which HF stores once
        names = self.hf_sources(canonical)
        if canonical in (_EMBED, _OUTPUT):
            return [(names[0], tensor[: self.spec.vocab_size].contiguous())]
        if ".linear_qkv." in canonical and not canonical.endswith("layer_norm_weight"):
            return list(zip(names, self.split_qkv(tensor)))
        if canonical.endswith("mlp.linear_fc1.weight"):
            gate, up = tensor.chunk(2, dim=0)
            return [(names[0], gate.contiguous()), (names[1], up.contiguous())]
        return [(names[0], tensor)]

    def hf_rows(self, canonical: str, shape: Tuple[int, ...]) -> List[HFRows]:
        """``to_hf`` as row maps, for an export that never materialises the canonical tensor:
        each HF tensor of ``canonical`` (of ``shape``) with the runs of dim-0 rows it takes from
        it, ``(hf_row, canonical_row, count)``. Equal to ``to_hf`` row for row (tested)."""
        if canonical == _OUTPUT and self.spec.tie_word_embeddings:
            return []
        names, rest = self.hf_sources(canonical), tuple(shape[1:])
        if canonical in (_EMBED, _OUTPUT):
            v = self.spec.vocab_size
            return [HFRows(names[0], (v,) + rest, ((0, 0, v),))]
        if ".linear_qkv." in canonical and not canonical.endswith("layer_norm_weight"):
            ng, per, d = self._qkv_sizes()
            group = (per + 2) * d
            return [HFRows(names[0], (ng * per * d,) + rest, tuple((g * per * d, g * group, per * d) for g in range(ng))),
                    HFRows(names[1], (ng * d,) + rest, tuple((g * d, g * group + per * d, d) for g in range(ng))),
                    HFRows(names[2], (ng * d,) + rest, tuple((g * d, g * group + (per + 1) * d, d) for g in range(ng)))]
        if canonical.endswith("mlp.linear_fc1.weight"):
            f = shape[0] // 2
            return [HFRows(names[0], (f,) + rest, ((0, 0, f),)), HFRows(names[1], (f,) + rest, ((0, f, f),))]
        return [HFRows(names[0], tuple(shape), ((0, 0, shape[0]),))]

    def expected_hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every HF tensor a checkpoint of this spec holds, with its shape (checked on import)."""
        s = self.spec
        h, d, f = s.hidden_size, s.head_dim, s.ffn_hidden_size
        q, kv = s.num_attention_heads * d, s.num_query_groups * d
        out = {_HF_EMBED: (s.vocab_size, h), "model.norm.weight": (h,)}
        if not s.tie_word_embeddings:
            out[_HF_HEAD] = (s.vocab_size, h)
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                        p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                        p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                        p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                        p + "mlp.down_proj.weight": (h, f)})
            if s.add_qkv_bias:
                out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                            p + "self_attn.v_proj.bias": (kv,)})
            if s.qk_layernorm:
                out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        return out


def hf_layer_index(hf_name: str) -> Optional[int]:
    """The layer index of an HF tensor name (None for embedding, final norm, head)."""
    m = _HF_LAYER_RE.match(hf_name)
    return int(m.group(1)) if m else None


_ROPE_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


def rope_from_hf(cfg: dict, default_theta: float = 10000.0) -> Tuple[float, Optional[dict], List[str]]:
    """(rope base, Megatron rope scaling dict or None, problems) from an HF config.

    Reads both the transformers-5 ``rope_parameters`` and the older ``rope_theta`` +
    ``rope_scaling`` fields. megatron-core 0.16 implements Llama-3 scaling only with the
    published constants (low 1, high 4, original context 8192; any factor), and linear
    scaling as position interpolation; anything else is reported as a problem.
    """
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    rtype = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rtype == "default":
        return theta, None, []
    if rtype == "linear":
        return theta, {"rope_type": "linear", "factor": float(scaling["factor"])}, []
    if rtype == "llama3":
        bad = [f"rope_scaling.{k}={scaling.get(k)}" for k, v in _ROPE_LLAMA3_FIXED.items()
               if float(scaling.get(k, v)) != v]
        if bad:
            return theta, None, [f"{', '.join(bad)} (megatron-core 0.16 fixes llama3 rope "
                                 f"scaling to {_ROPE_LLAMA3_FIXED})"]
        return theta, {"rope_type": "llama3", "factor": float(scaling["factor"])}, []
    return theta, None, [f"rope_type={rtype!r} (supported: default, linear, llama3)"]


class LlamaLikeFamily:
    """Config parsing and validation for a Llama-like HF family; subclasses set the flags.

    ``spec_from_hf`` raises ONE ValueError naming every unsupported field of the config.
    """

    family = ""  # set by ``register_architecture``
    hf_architecture = ""
    model_type = ""
    qkv_bias = False  # Qwen2: q/k/v projections always carry biases, o_proj never
    qk_norm = False  # Qwen3: RMSNorm over each head's q and k before rope
    default_tie = False

    @classmethod
    def problems(cls, cfg: dict) -> List[str]:
        """Unsupported fields of ``cfg``, each as 'field=value (why)'; empty when supported."""
        out = [f"{k} missing" for k in _REQUIRED if k not in cfg]
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act != "silu":
            out.append(f"hidden_act={act!r} (only silu/SwiGLU)")
        if cfg.get("mlp_bias"):
            out.append("mlp_bias=True (Megatron's SwiGLU MLP here has no biases)")
        if cfg.get("attention_bias") and not cls.qkv_bias:
            out.append("attention_bias=True (would need an o_proj bias)")
        if cfg.get("use_sliding_window"):
            out.append("use_sliding_window=True (sliding-window attention)")
        kinds = set(cfg.get("layer_types") or []) - {"full_attention"}
        if kinds:
            out.append(f"layer_types={sorted(kinds)} (only full_attention)")
        if cfg.get("quantization_config"):
            out.append("quantization_config (quantized checkpoints)")
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            out.append("num_experts (mixture of experts)")
        return out + rope_from_hf(cfg)[2]

    @classmethod
    def spec_from_hf(cls, cfg: dict, *, make_vocab_size_divisible_by: int = 128) -> GPTSpec:
        """The ``GPTSpec`` of an HF config dict (``config.json`` contents)."""
        problems = cls.problems(cfg)
        if problems:
            name = (cfg.get("architectures") or [cls.hf_architecture])[0]
            raise ValueError(f"unsupported {name} config: {'; '.join(problems)}")
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        theta, scaling, _ = rope_from_hf(cfg)
        return GPTSpec(
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=int(cfg.get("num_key_value_heads") or heads),
            vocab_size=int(cfg["vocab_size"]),
            kv_channels=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rotary_base=theta,
            rope_scaling=scaling,
            norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
            add_qkv_bias=cls.qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_layernorm=cls.qk_norm,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cls.default_tie)),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            architecture=cls.family,
        )

    @classmethod
    def hf_config(cls, spec: GPTSpec, dtype: str = "float32") -> dict:
        """A minimal HF ``config.json`` dict for ``spec`` (used when no original config exists)."""
        rope = {"rope_type": "default", "rope_theta": spec.rotary_base}
        if spec.rope_scaling:
            rope = {**spec.rope_scaling, "rope_theta": spec.rotary_base}
            if spec.rope_scaling["rope_type"] == "llama3":
                rope.update(_ROPE_LLAMA3_FIXED)
        return {
            "architectures": [cls.hf_architecture], "model_type": cls.model_type,
            "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
            "intermediate_size": spec.ffn_hidden_size, "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_query_groups, "head_dim": spec.head_dim,
            "max_position_embeddings": spec.max_position_embeddings,
            "rms_norm_eps": spec.norm_epsilon, "hidden_act": "silu",
            "tie_word_embeddings": spec.tie_word_embeddings, "rope_parameters": rope,
            "attention_bias": spec.add_qkv_bias and not cls.qkv_bias, "dtype": dtype,
        }

    @classmethod
    def mapping(cls, spec: GPTSpec) -> LlamaLikeMapping:
        return LlamaLikeMapping(spec)
