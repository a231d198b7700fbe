"""Canonical (TP=1, PP=1) Megatron tensors <-> this rank's local shards, for any TP/PP layout.

Every architecture mapping converts HF tensors to *canonical Megatron* tensors (Megatron names
and layouts as a single-rank model would hold them). This module does the rest, generically,
from the attributes Megatron puts on its parameters:

- pipeline: a local ``decoder.layers.{i}`` is global layer ``layer.layer_number - 1``;
- tensor parallel: a parameter with ``tensor_model_parallel`` set is split along its
  ``partition_dim``; the SwiGLU ``linear_fc1`` holds ``[gate; up]`` per rank, so its canonical
  ``[gate; up]`` is split half by half, not contiguously.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

_LAYER_RE = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")


def _layer_offsets(model: torch.nn.Module) -> Dict[int, int]:
    """local layer index -> global layer index, read from Megatron's ``layer_number``."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return {}
    return {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)}


def global_name(local_name: str, offsets: Dict[int, int]) -> str:
    """The canonical (single-rank) name of a local parameter name."""
    m = _LAYER_RE.match(local_name)
    if not m:
        return local_name
    return f"{m.group(1)}{offsets[int(m.group(2))]}{m.group(3)}"


def is_glu_fc1(name: str) -> bool:
    return name.endswith("mlp.linear_fc1.weight") or name.endswith("mlp.linear_fc1.bias")


def full_shape(param: torch.Tensor, tp: int) -> Tuple[int, ...]:
    """Shape of the canonical tensor a local shard comes from."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        shape[param.partition_dim] *= tp
    return tuple(shape)


def shard(full: torch.Tensor, param: torch.Tensor, name: str, tp_rank: int, tp: int,
          glu: bool) -> torch.Tensor:
    """This rank's slice of canonical tensor ``full`` for local parameter ``param``."""
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
    offsets = _layer_offsets(inner)
    for name, p in inner.named_parameters():
        yield name, global_name(name, offsets), p


@torch.no_grad()
def load_canonical(model: torch.nn.Module, get_full: Callable[[str, Tuple[int, ...]], torch.Tensor],
                   tp_rank: int, tp: int, glu: bool = True) -> int:
    """Fill every local parameter from canonical tensors; returns the number loaded.

    ``get_full(canonical_name, full_shape)`` returns the canonical tensor. Shapes are checked,
    so a mapping bug surfaces here with the tensor's name instead of as wrong numbers later.
    """
    n = 0
    for local, canon, p in local_params(model):
        full = get_full(canon, full_shape(p, tp))
        if tuple(full.shape) != full_shape(p, tp):
            raise ValueError(f"{canon}: expected shape {full_shape(p, tp)}, got {tuple(full.shape)}")
        p.copy_(shard(full, p, local, tp_rank, tp, glu))
        n += 1
    return n


@torch.no_grad()
def gather_canonical(model: torch.nn.Module, tp_group, tp: int, glu: bool = True, reuse: bool = False
                     ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (canonical name, canonical tensor) for this stage, gathering TP shards.

    Collective over ``tp_group``: every TP rank of the stage must iterate in step. One tensor is
    gathered at a time, so the extra memory is one canonical tensor (twice: the gathered shards
    and their concatenation). ``reuse``: gather into and concatenate into two buffers kept for
    the whole iteration (no fresh pages per tensor; shards split along dim 0 need no
    concatenation: the gathered buffer is the tensor), and yield parameters that need no gather
    without a copy - a yielded tensor is then valid only until the next one is requested (for a
    consumer that copies it at once, like the streaming export).
    """
    gathered, joined = _Scratch(), _Scratch()
    for local, canon, p in local_params(model):
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
