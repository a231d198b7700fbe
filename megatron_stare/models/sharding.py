"""Canonical (TP=1, PP=1) Megatron tensors <-> this rank's local shards, for any TP/PP layout.

Every architecture mapping converts HF tensors to *canonical Megatron* tensors (Megatron names
and layouts as a single-rank model would hold them). This module does the rest, generically,
from the attributes Megatron puts on its parameters:

- pipeline: a local ``decoder.layers.{i}`` is global layer ``layer.layer_number - 1``;
- tensor parallel: a parameter with ``tensor_model_parallel`` set is split along its
  ``partition_dim``; the SwiGLU ``linear_fc1`` holds ``[gate; up]`` per rank, so its canonical
  ``[gate; up]`` is split half by half, not contiguously;
- experts (mixture of experts): a local ``mlp.experts.local_experts.{j}`` is global expert
  ``mlp.local_expert_indices[j]`` (expert parallel); expert weights (Megatron marks them
  ``allreduce=False``) are split over the expert-tensor-parallel group (etp ranks), not TP.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

_LAYER_RE = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _layer_offsets(model: torch.nn.Module) -> Dict[int, int]:
    """local layer index -> global layer index, read from Megatron's ``layer_number``."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return {}
    return {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)}


def _expert_offsets(model: torch.nn.Module) -> Dict[int, int]:
    """local layer index -> global index of its first local expert (MoE layers only)."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return {}
    return {i: layer.mlp.local_expert_indices[0] for i, layer in enumerate(decoder.layers)
            if hasattr(layer.mlp, "local_expert_indices")}


def global_name(local_name: str, offsets: Dict[int, int], expert_offsets: Optional[Dict[int, int]] = None) -> str:
    """The canonical (single-rank) name of a local parameter name."""
    m = _LAYER_RE.match(local_name)
    if not m:
        return local_name
    out = f"{m.group(1)}{offsets[int(m.group(2))]}{m.group(3)}"
    e = _EXPERT_RE.match(out)
    if e and expert_offsets:
        out = f"{e.group(1)}{expert_offsets[int(m.group(2))] + int(e.group(2))}{e.group(3)}"
    return out


def renumber_expert(canonical: str, expert: int) -> str:
    """``canonical`` (an expert's tensor) with its expert index replaced by ``expert``."""
    e = _EXPERT_RE.match(canonical)
    return f"{e.group(1)}{expert}{e.group(3)}"


def expert_index(canonical: str) -> Optional[int]:
    """The global expert index of an expert's canonical tensor name; None for other tensors."""
    e = _EXPERT_RE.match(canonical)
    return int(e.group(2)) if e else None


def is_expert_param(param: torch.Tensor) -> bool:
    """Megatron marks expert weights ``allreduce=False`` (reduced over expert-data-parallel)."""
    return getattr(param, "allreduce", True) is False


def is_glu_fc1(name: str) -> bool:
    # Dense MLP, routed experts (``experts.local_experts.j.linear_fc1``) and the shared expert.
    return name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias")


def full_shape(param: torch.Tensor, tp: int, etp: int = 1) -> Tuple[int, ...]:
    """Shape of the canonical tensor a local shard comes from (``etp`` for expert weights)."""
    tp = etp if is_expert_param(param) else tp
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        shape[param.partition_dim] *= tp
    return tuple(shape)


def shard(full: torch.Tensor, param: torch.Tensor, name: str, tp_rank: int, tp: int,
          glu: bool) -> torch.Tensor:
    """This rank's slice of canonical tensor ``full`` for local parameter ``param`` (for an
    expert weight, ``tp_rank``/``tp`` are its expert-tensor-parallel rank and degree)."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if glu and is_glu_fc1(name):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[tp_rank], up.chunk(tp, dim=dim)[tp_rank]], dim=dim)
    return full.chunk(tp, dim=dim)[tp_rank]


def unshard(parts: list, param: torch.Tensor, name: str, glu: bool,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of ``shard``: the canonical tensor from the TP ranks' shards (in rank order),
    written into ``out`` (the full shape) when given."""
    if len(parts) == 1 or not getattr(param, "tensor_model_parallel", False):
        return parts[0]
    dim = param.partition_dim
    if glu and is_glu_fc1(name):
        gates, ups = zip(*(p.chunk(2, dim=dim) for p in parts))
        parts = [*gates, *ups]  # cat(cat(gates), cat(ups)) in one pass
    return torch.cat(parts, dim=dim) if out is None else torch.cat(parts, dim=dim, out=out)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside any stack of ``.module`` wrappers (DDP, Float16Module)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def local_params(model: torch.nn.Module) -> Iterator[Tuple[str, str, torch.nn.Parameter]]:
    """(local name, canonical name, parameter) for every parameter of this stage.

    Names are those of the unwrapped GPTModel (the ``module.`` prefixes of wrappers such as
    DDP and Float16Module removed).
    """
    inner = unwrap(model)
    offsets, experts = _layer_offsets(inner), _expert_offsets(inner)
    for name, p in inner.named_parameters():
        yield name, global_name(name, offsets, experts), p


@torch.no_grad()
def load_canonical(model: torch.nn.Module, get_full: Callable[[str, Tuple[int, ...]], torch.Tensor],
                   tp_rank: int, tp: int, glu: bool = True, etp_rank: int = 0, etp: int = 1) -> int:
    """Fill every local parameter from canonical tensors; returns the number loaded.

    ``get_full(canonical_name, full_shape)`` returns the canonical tensor. Shapes are checked,
    so a mapping bug surfaces here with the tensor's name instead of as wrong numbers later.
    Expert weights are sliced by ``etp_rank`` of ``etp`` (expert-tensor parallel), the rest by TP.
    """
    n = 0
    for local, canon, p in local_params(model):
        shape = full_shape(p, tp, etp)
        full = get_full(canon, shape)
        if tuple(full.shape) != shape:
            raise ValueError(f"{canon}: expected shape {shape}, got {tuple(full.shape)}")
        rank, size = (etp_rank, etp) if is_expert_param(p) else (tp_rank, tp)
        p.copy_(shard(full, p, local, rank, size, glu))
        n += 1
    return n


@torch.no_grad()
def gather_canonical(model: torch.nn.Module, tp_group, tp: int, glu: bool = True, reuse: bool = False,
                     experts: Optional["ExpertGroups"] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (canonical name, canonical tensor) for this stage, gathering TP shards.

    Collective over ``tp_group``: every TP rank of the stage must iterate in step. One tensor is
    gathered at a time, so the extra memory is one canonical tensor (twice: the gathered shards
    and their concatenation). ``reuse``: gather into and concatenate into two buffers kept for
    the whole iteration (no fresh pages per tensor; shards split along dim 0 need no
    concatenation: the gathered buffer is the tensor), and yield parameters that need no gather
    without a copy - a yielded tensor is then valid only until the next one is requested (for a
    consumer that copies it at once, like the streaming export).

    ``experts`` (a mixture-of-experts model): each expert weight is gathered over the
    expert-tensor-parallel group, then over the expert-parallel group, and yielded once per
    expert of that group (every rank of the EP group yields every expert, in step).
    """
    gathered, joined = _Scratch(), _Scratch()
    for local, canon, p in local_params(model):
        if experts is not None and is_expert_param(p):
            yield from experts.gather(local, canon, p, glu)
            continue
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            if reuse:
                flat = gathered.get(p.numel() * tp, p.dtype, p.device)
                dist.all_gather_into_tensor(flat, p.detach().contiguous().reshape(-1), group=tp_group)
                if p.partition_dim == 0 and not (glu and is_glu_fc1(local)):
                    # Rank-major shards split along dim 0 ARE the concatenation: no copy.
                    yield canon, flat.view(full_shape(p, tp))
                    continue
                parts = list(flat.view(tp, *p.shape).unbind(0))
                full = joined.get(p.numel() * tp, p.dtype, p.device).view(full_shape(p, tp))
                yield canon, unshard(parts, p, local, glu, out=full)
                continue
            parts = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=tp_group)
            yield canon, unshard(parts, p, local, glu)
        else:
            yield canon, p.detach() if reuse else p.detach().clone()


class _Scratch:
    """One byte buffer grown to the largest request and handed out as typed flat views."""

    def __init__(self):
        self.buf: Optional[torch.Tensor] = None

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = numel * torch.empty((), dtype=dtype).element_size()
        if self.buf is None or self.buf.numel() < n:
            self.buf = None
            self.buf = torch.empty(n, dtype=torch.uint8, device=device)
        return self.buf[:n].view(dtype)


class ExpertGroups:
    """The expert-parallel (``ep``) and expert-tensor-parallel (``etp``) groups of this rank,
    for gathering expert weights (``gather_canonical(experts=...)``)."""

    def __init__(self, ep_group, ep: int, etp_group, etp: int, num_local_experts: int) -> None:
        self.ep_group, self.ep, self.etp_group, self.etp = ep_group, ep, etp_group, etp
        self.num_local = num_local_experts
        self.ep_rank = dist.get_rank(ep_group) if ep > 1 else 0

    def gather(self, local: str, canon: str, p: torch.Tensor, glu: bool) -> Iterator[Tuple[str, torch.Tensor]]:
        t = p.detach().contiguous()
        if self.etp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(self.etp)]
            dist.all_gather(parts, t, group=self.etp_group)
            t = unshard(parts, p, local, glu)
        if self.ep == 1:
            yield canon, t.clone()
            return
        parts = [torch.empty_like(t) for _ in range(self.ep)]
        dist.all_gather(parts, t.contiguous(), group=self.ep_group)
        j = expert_index(canon) - self.ep_rank * self.num_local
        for r, part in enumerate(parts):
            yield renumber_expert(canon, r * self.num_local + j), part


def num_local_experts(model: torch.nn.Module) -> int:
    """Experts per MoE layer on this rank (0 for a dense model or a stage without MoE layers)."""
    decoder = getattr(unwrap(model), "decoder", None)
    for layer in getattr(decoder, "layers", []):
        if hasattr(layer.mlp, "local_expert_indices"):
            return len(layer.mlp.local_expert_indices)
    return 0
