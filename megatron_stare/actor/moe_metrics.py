"""Mixture-of-experts metrics of one update: the expert load of each MoE layer and the router's
auxiliary losses as megatron-core computed them.

``ExpertLoad`` counts, while ``active``, the tokens each router sends to each expert (top-k:
a token counts once for each of its k experts), from forward hooks on the routers. Only real
tokens count: ``feed``, called with each micro-batch before its forward, marks them in the
routers' token order (``routing_replay.real_tokens``), so that no padding is counted - a packed
row's slot padding and sequence parallel multiple, a padded row's tail, and under context
parallel the padding in this rank's chunks of each slot (which differs with the layout, so
counting it made the metric layout-dependent). ``metrics`` sums the counts over all ranks (each
token is routed on one rank of its TP group under sequence parallel, on every TP rank without
it) and reports per MoE layer ``i``:

- ``moe/layer{i}/load_max``: the busiest expert's share of the layer's routed tokens over the
  mean share (1 = perfectly balanced, ``num_experts`` = every token to one expert);
- ``moe/layer{i}/load_min``: the idlest expert's share over the mean share.

``router_loss_metrics`` reads megatron's per-layer tracker of the load-balancing loss and the
z-loss (filled only when their coefficients are > 0), summed over the layers and over the
pipeline stages, averaged over micro-batches and data-parallel ranks, and clears it:
``moe/aux_loss``, ``moe/z_loss`` (the unscaled losses, before their coefficients).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

from megatron_stare.actor.routing_replay import real_tokens
from megatron_stare.models.sharding import unwrap
from megatron_stare.runtime.parallel import ParallelGroups
from megatron_stare.types import MicroBatch


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer of this stage while ``active``."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_experts: int, groups: ParallelGroups) -> None:
        self.groups = groups
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.active = False
        self._real: Optional[torch.Tensor] = None
        self._handles = []
        for layer in unwrap(model).decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                self._handles.append(router.register_forward_hook(self._hook(layer.layer_number - 1)))

    def feed(self, mb: MicroBatch) -> None:
        """Before ``mb``'s forward on this stage (while ``active``): which router tokens are real."""
        self._real = real_tokens(mb, self.groups) if self.active else None

    def _hook(self, index: int):
        def hook(module, inputs, output) -> None:
            if not self.active or not torch.is_grad_enabled():
                return
            routing_map = output[1]  # [tokens, experts] bool, tokens in (sequence, batch) order
            # Under full recompute with pipeline parallel the counted pass (the recompute in
            # backward) can follow a later micro-batch's feed: a mask that does not fit counts all.
            if self._real is not None and self._real.numel() == routing_map.shape[0]:
                routing_map = routing_map[self._real.to(routing_map.device)]
            self.counts[index] += routing_map.sum(0).double().cpu()

        return hook

    def reset(self) -> None:
        self.counts.zero_()

    def metrics(self, layer_pattern) -> Dict[str, float]:
        """The module docstring's per-layer load metrics over all ranks (collective)."""
        g, lay = self.groups, self.groups.layout
        total = self.counts.to(g.device)
        dist.all_reduce(total)
        if lay.tp > 1 and not lay.sequence_parallel:
            total = total / lay.tp  # every TP rank routed the same tokens
        out = {}
        for i, sparse in enumerate(layer_pattern):
            if not sparse:
                continue
            c = total[i].cpu()
            mean = c.sum() / c.numel()
            if mean > 0:
                out[f"moe/layer{i}/load_max"] = float(c.max() / mean)
                out[f"moe/layer{i}/load_min"] = float(c.min() / mean)
        return out


def router_loss_metrics(groups: ParallelGroups, num_micro_batches: int) -> Dict[str, float]:
    """``moe/aux_loss`` and ``moe/z_loss`` from megatron's MoE tracker (see the module docstring);
    empty when neither loss is on. Collective over the world.

    The tracker holds, per layer and summed over this rank's micro-batches, the load-balancing
    loss of this rank's tokens (its TP x CP ranks' parts sum to the micro-batch's loss) and the
    z-loss as the mean over this rank's tokens (its TP x CP ranks' means average to it)."""

    tracker = get_moe_layer_wise_logging_tracker()
    names = ("load_balancing_loss", "z_loss")
    vals = torch.tensor([float(tracker[n]["values"].sum()) if n in tracker else 0.0 for n in names]
                        + [float(num_micro_batches), float(sum(n in tracker for n in names))],
                        dtype=torch.float64, device=groups.device)
    dist.all_reduce(vals)
    clear_aux_losses_tracker()
    aux, z, n_total, present = vals.tolist()
    if present == 0:
        return {}
    lay = groups.layout
    per_replica = n_total / lay.pp  # micro-batches summed over the data-parallel replicas, x tp x cp
    return {"moe/aux_loss": aux / (per_replica / (lay.tp * lay.cp)), "moe/z_loss": z / per_replica}
