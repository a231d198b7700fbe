"""Megatron's optimizer state gathered into canonical (TP=1, PP=1, DP=1) tensors, for tests.

``gather_optimizer_state`` returns, on every rank, ``{canonical name: {"param": fp32 main param,
"exp_avg": ..., "exp_avg_sq": ...}}`` (moments once they exist) for the whole model, whatever the layout and whether the
optimizer is Megatron's distributed one (state sharded over DP) or a plain one. Two runs at
different layouts can then be compared tensor by tensor. fp32 CPU tensors; test-sized models only.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from megatron_stare.models.sharding import is_expert_param, local_params, unshard
from megatron_stare.runtime.parallel import ParallelGroups

KEYS = ("param", "exp_avg", "exp_avg_sq")


def _sub_optimizers(optimizer):
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _local_state(optimizer, param) -> Dict[str, tuple]:
    """{key: (start, end, flat tensor)} of this rank's range of ``param``'s state."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in _sub_optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer):
            try:
                rng = opt._get_model_param_range_map(param)["param"]
            except KeyError:  # no part of this parameter lives on this DP rank
                continue
            st = opt._get_main_param_and_optimizer_states(param)
            return {k: (rng.start, rng.end, st[k].detach().float().reshape(-1).cpu().clone()) for k in KEYS if k in st}
        main = getattr(param, "main_param", None)
        if main is None:
            main = param
        if main in opt.optimizer.state:
            st = {"param": main, **opt.optimizer.state[main]}
            return {k: (0, param.numel(), st[k].detach().float().reshape(-1).cpu().clone()) for k in KEYS if k in st}
    return {}


@torch.no_grad()
def gather_optimizer_state(optimizer, model: torch.nn.Module, groups: ParallelGroups
                           ) -> Dict[str, Dict[str, torch.Tensor]]:
    """Canonical optimizer state of the whole model on every rank (see the module docstring)."""
    mine = {canon: _local_state(optimizer, p) for _, canon, p in local_params(model)}
    pieces = [None] * groups.layout.dp
    dist.all_gather_object(pieces, mine, group=groups.dp_group)
    # Expert weights are sharded over the expert-data-parallel group, and each EP rank holds
    # its own experts: their pieces come from that group, the other experts from the EP group.
    lay = groups.layout
    experts = any(is_expert_param(p) for _, _, p in local_params(model))
    if experts:
        expert_pieces = [None] * lay.edp
        dist.all_gather_object(expert_pieces, mine, group=groups.edp_group)
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for local, canon, p in local_params(model):
        pieces_p = expert_pieces if is_expert_param(p) else pieces
        full = {}
        # Before the first step the moments do not exist yet (the same on every rank).
        for k in (k for k in KEYS if any(k in part[canon] for part in pieces_p)):
            flat = torch.full((p.numel(),), float("nan"))
            for part in pieces_p:
                if k in part[canon]:
                    start, end, t = part[canon][k]
                    flat[start:end] = t
            shard = flat.view(p.shape)
            if is_expert_param(p) and lay.etp > 1 and getattr(p, "tensor_model_parallel", False):
                dev = shard.to(p.device)
                parts = [torch.empty_like(dev) for _ in range(lay.etp)]
                dist.all_gather(parts, dev.contiguous(), group=groups.etp_group)
                shard = unshard([t.cpu() for t in parts], p, local, glu=True)
            elif not is_expert_param(p) and groups.layout.tp > 1 and getattr(p, "tensor_model_parallel", False):
                dev = shard.to(p.device)  # NCCL gathers device tensors
                parts = [torch.empty_like(dev) for _ in range(groups.layout.tp)]
                dist.all_gather(parts, dev.contiguous(), group=groups.tp_group)
                shard = unshard([t.cpu() for t in parts], p, local, glu=True)
            full[k] = shard
        out[canon] = full
    if experts and lay.ep > 1:
        ranks = [None] * lay.ep
        dist.all_gather_object(ranks, out, group=groups.ep_group)
        out = {k: v for r in ranks for k, v in r.items()}
    if groups.layout.pp > 1:
        stages = [None] * groups.layout.pp
        dist.all_gather_object(stages, out, group=groups.pp_group)
        out = {k: v for st in stages for k, v in st.items()}
    return out
