"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE): HF config parsing and the one HF mapping
of router, experts and shared expert, used by conversion and the live weight sync alike.

On top of the Llama-like mapping (``llama_like.py``), each MoE layer ``i`` maps:

====================================================  ==============================================
Megatron (canonical; e = global expert index)         HF (per-expert layout, what we write)
====================================================  ==============================================
decoder.layers.i.mlp.router.weight [E, H]             model.layers.i.mlp.gate.weight
...mlp.experts.local_experts.e.linear_fc1.weight      [mlp.experts.e.gate_proj.weight;
  [2I, H]                                              mlp.experts.e.up_proj.weight]
...mlp.experts.local_experts.e.linear_fc2.weight      mlp.experts.e.down_proj.weight [H, I]
...mlp.shared_experts.linear_fc1.weight [2S, H]       [mlp.shared_expert.gate_proj; .up_proj] (Qwen2)
...mlp.shared_experts.linear_fc2.weight               mlp.shared_expert.down_proj.weight (Qwen2)
...mlp.shared_experts.gate_weight [1, H]              mlp.shared_expert_gate.weight (Qwen2)
====================================================  ==============================================

Dense layers of a MoE model (``mlp_only_layers``, ``decoder_sparse_step``) keep the dense
names with ``intermediate_size``. Two on-disk layouts are read: the published per-expert one
above, and the fused one transformers 5 keeps in memory (``mlp.experts.gate_up_proj
[E, 2I, H]`` = [gate; up] per expert, ``mlp.experts.down_proj [E, H, I]``), which
``per_expert_view`` presents as per-expert tensors. The per-expert layout is the one written:
transformers 5 loads it through its conversion mapping (``conversion_mapping.py``:
``qwen2_moe``, which ``qwen3_moe`` aliases, merges ``mlp.experts.*.gate_proj/up_proj``) and
vLLM's ``qwen3_moe``/``qwen2_moe`` loaders map exactly these per-expert names onto their fused
MoE (``expert_params_mapping``); neither loader reads the fused names.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Tuple
import dataclasses

import torch

from megatron_stare.models.gpt import GPTSpec, MoESpec
from megatron_stare.models.llama_like import HFRows, LlamaLikeFamily, LlamaLikeMapping

_MOE_RE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.(router\.weight|experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight|"
                     r"shared_experts\.(linear_fc[12]\.weight|gate_weight))$")
_FUSED_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_PER_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def num_experts(cfg: dict) -> int:
    """Routed experts of an HF MoE config: ``num_experts`` in published configs,
    ``num_local_experts`` in what transformers 5 writes (its ``attribute_map`` reads both)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def layer_pattern(cfg: dict) -> Tuple[int, ...]:
    """1 for each layer HF builds as a sparse MoE block, 0 for a dense MLP (transformers'
    rule: not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``)."""
    only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    n = num_experts(cfg)
    return tuple(int(i not in only and n > 0 and (i + 1) % step == 0) for i in range(int(cfg["num_hidden_layers"])))


class MoEMapping(LlamaLikeMapping):
    """The Llama-like mapping plus router, routed experts and the shared expert."""

    def _moe_sources(self, canonical: str) -> Optional[List[str]]:
        m = _MOE_RE.match(canonical)
        if not m:
            return None
        p = f"model.layers.{m.group(1)}.mlp."
        if m.group(2) == "router.weight":
            return [p + "gate.weight"]
        if m.group(3) is not None:
            e = p + f"experts.{m.group(3)}."
            return [e + "gate_proj.weight", e + "up_proj.weight"] if m.group(4) == "linear_fc1" else [e + "down_proj.weight"]
        part = m.group(5)
        if part == "gate_weight":
            return [p + "shared_expert_gate.weight"]
        s = p + "shared_expert."
        return [s + "gate_proj.weight", s + "up_proj.weight"] if part.startswith("linear_fc1") else [s + "down_proj.weight"]

    def hf_sources(self, canonical: str) -> List[str]:
        return self._moe_sources(canonical) or super().hf_sources(canonical)

    def to_canonical(self, canonical: str, get_hf, shape: Tuple[int, ...]) -> torch.Tensor:
        names = self._moe_sources(canonical)
        if names is None:
            return super().to_canonical(canonical, get_hf, shape)
        srcs = [get_hf(n) for n in names]
        return torch.cat(srcs, dim=0) if len(srcs) == 2 else srcs[0]

    def to_hf(self, canonical: str, tensor: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        names = self._moe_sources(canonical)
        if names is None:
            return super().to_hf(canonical, tensor)
        if len(names) == 2:
            gate, up = tensor.chunk(2, dim=0)
            return [(names[0], gate.contiguous()), (names[1], up.contiguous())]
        return [(names[0], tensor)]

    def hf_rows(self, canonical: str, shape: Tuple[int, ...]) -> List[HFRows]:
        names = self._moe_sources(canonical)
        if names is None:
            return super().hf_rows(canonical, shape)
        rest = tuple(shape[1:])
        if len(names) == 2:
            f = shape[0] // 2
            return [HFRows(names[0], (f,) + rest, ((0, 0, f),)), HFRows(names[1], (f,) + rest, ((0, f, f),))]
        return [HFRows(names[0], tuple(shape), ((0, 0, shape[0]),))]

    def expected_hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        s, moe = self.spec, self.spec.moe
        out = super().expected_hf_shapes()
        h, i_, sh = s.hidden_size, moe.ffn_hidden_size, moe.shared_expert_size
        for layer, sparse in enumerate(moe.layer_pattern):
            if not sparse:
                continue
            p = f"model.layers.{layer}.mlp."
            for k in ("gate_proj", "up_proj", "down_proj"):
                del out[f"{p}{k}.weight"]
            out[p + "gate.weight"] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                out.update({f"{p}experts.{e}.gate_proj.weight": (i_, h), f"{p}experts.{e}.up_proj.weight": (i_, h),
                            f"{p}experts.{e}.down_proj.weight": (h, i_)})
            if sh:
                out.update({p + "shared_expert.gate_proj.weight": (sh, h), p + "shared_expert.up_proj.weight": (sh, h),
                            p + "shared_expert.down_proj.weight": (h, sh)})
            if moe.shared_expert_gate:
                out[p + "shared_expert_gate.weight"] = (1, h)
        return out


def per_expert_view(get: Callable[[str], torch.Tensor], shapes: Dict[str, Tuple[int, ...]]
                    ) -> Tuple[Callable[[str], torch.Tensor], Dict[str, Tuple[int, ...]]]:
    """(get, shapes) of an HF checkpoint with fused expert tensors shown per expert; a
    checkpoint without fused tensors is returned as it is. The last fused tensor read is kept,
    so a layer's experts cost one read of each fused tensor."""
    fused = {n: s for n, s in shapes.items() if _FUSED_RE.match(n)}
    if not fused:
        return get, shapes
    out = {n: s for n, s in shapes.items() if n not in fused}
    for name, shape in fused.items():
        prefix, kind = _FUSED_RE.match(name).groups()
        e_count = shape[0]
        for e in range(e_count):
            if kind == "gate_up_proj":
                half = (shape[1] // 2, shape[2])
                out[f"{prefix}{e}.gate_proj.weight"] = half
                out[f"{prefix}{e}.up_proj.weight"] = half
            else:
                out[f"{prefix}{e}.down_proj.weight"] = (shape[1], shape[2])
    cache: Dict[str, torch.Tensor] = {}

    def fused_get(name: str) -> torch.Tensor:
        m = _PER_EXPERT_RE.match(name)
        if not m or name in shapes:
            return get(name)
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        src = prefix + ("down_proj" if kind == "down_proj" else "gate_up_proj")
        if src not in cache:
            cache.clear()
            cache[src] = get(src)
        t = cache[src][e]
        if kind == "down_proj":
            return t.contiguous()
        gate, up = t.chunk(2, dim=0)
        return (gate if kind == "gate_proj" else up).contiguous()

    return fused_get, out


def fuse_experts(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """An HF state dict in the per-expert layout -> the fused layout (``gate_up_proj``,
    ``down_proj`` per layer); the inverse of ``per_expert_view``. Used to test both layouts."""
    out, groups = {}, {}
    for name, t in tensors.items():
        m = _PER_EXPERT_RE.match(name)
        if not m:
            out[name] = t
            continue
        groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, experts in groups.items():
        order = sorted(experts)
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order])
        out[prefix + "down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return out


class MoEFamily(LlamaLikeFamily):
    """Config parsing of a Llama-like MoE family; subclasses set ``shared_expert``."""

    shared_expert = False  # Qwen2-MoE: an always-on expert scaled by sigmoid(gate . x)

    @classmethod
    def problems(cls, cfg: dict) -> List[str]:
        dense = {k: v for k, v in cfg.items() if k not in ("num_experts", "num_local_experts")}
        out = super().problems(dense)
        if not num_experts(cfg):
            out.append("num_experts missing")
        for k in ("num_experts_per_tok", "moe_intermediate_size"):
            if not cfg.get(k):
                out.append(f"{k} missing")
        if cls.shared_expert and not cfg.get("shared_expert_intermediate_size"):
            out.append("shared_expert_intermediate_size missing (Qwen2-MoE always has a shared expert)")
        if num_experts(cfg) and cfg.get("num_experts_per_tok", 0) > num_experts(cfg):
            out.append(f"num_experts_per_tok={cfg['num_experts_per_tok']} exceeds num_experts={num_experts(cfg)}")
        return out

    @classmethod
    def spec_from_hf(cls, cfg: dict, *, make_vocab_size_divisible_by: int = 128) -> GPTSpec:

        spec = super().spec_from_hf(cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        moe = MoESpec(num_experts=num_experts(cfg), topk=int(cfg["num_experts_per_tok"]),
                      ffn_hidden_size=int(cfg["moe_intermediate_size"]), layer_pattern=layer_pattern(cfg),
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                      shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0) if cls.shared_expert else 0,
                      shared_expert_gate=cls.shared_expert)
        bias = bool(cfg.get("qkv_bias", True)) if cls.qkv_bias else spec.add_qkv_bias
        return dataclasses.replace(spec, moe=moe, add_qkv_bias=bias)

    @classmethod
    def hf_config(cls, spec: GPTSpec, dtype: str = "float32") -> dict:
        out = super().hf_config(spec, dtype)
        moe = spec.moe
        out.update(num_experts=moe.num_experts, num_experts_per_tok=moe.topk,
                   moe_intermediate_size=moe.ffn_hidden_size, norm_topk_prob=moe.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[i for i, s in enumerate(moe.layer_pattern) if not s],
                   output_router_logits=False)
        if cls.shared_expert:
            out.update(shared_expert_intermediate_size=moe.shared_expert_size, qkv_bias=spec.add_qkv_bias)
        return out

    @classmethod
    def mapping(cls, spec: GPTSpec) -> MoEMapping:
        return MoEMapping(spec)
