"""The dry-run planner's mixture-of-experts terms (``plan.py``), per GPU of one pipeline stage.

- **Expert weights**: the routed experts (``ParamCounts.experts``) shard over expert parallel,
  ``E / ep`` whole experts per rank, each split over ``etp``; routers, shared experts, dense
  layers and attention shard over tp as in a dense model. Grads follow the weights.
- **Expert optimizer state**: megatron-core's distributed optimizer shards the experts' fp32
  master copy and Adam moments over the expert-data-parallel group, ``edp = world / (ep * etp *
  pp)`` ranks (the dense part over dp*cp); without it each rank holds its experts' state whole.
- **Activations**: each token runs ``topk`` experts of width ``I`` (+ the shared expert), so
  the MLP term of the layer formula sees an effective width ``topk*I + S``; on top the experts
  keep their permuted inputs (``topk`` copies of each token's hidden state), scaled by the
  load imbalance (``Assumptions.moe_imbalance``: the busiest rank's routed tokens over the mean).
- **Dispatcher buffers**: the all-to-all's send and receive buffers of one MoE layer (transient,
  one layer at a time): ``2 * topk * s * h`` bf16 elements per rank (/tp with sequence parallel),
  times the imbalance.
- **Routing replay** (``rollout.routing_replay``): int16 expert indices, per token and MoE layer
  ``topk`` of them: r3 carries the engine's for every layer (``MicroBatch.routes``, every stage
  holds the micro-batch) plus the log-prob pass's record of the stage's layers
  (``MicroBatch.replay``); r2 the record only. Every micro-batch of the step is on the device
  from the log-prob pass to the last update: this rank's tokens of the whole step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_stare.config.fields import ConfigError
from megatron_stare.runtime.parallel import LayoutError, ModelShape, ParallelLayout

__all__ = ["MoEPlan", "plan_moe"]

ROUTE_BYTES = 2
"""One expert index (int16; ``batching.ROUTES_DTYPE``)."""


@dataclass(frozen=True)
class MoEPlan:
    """The mixture-of-experts part of a plan (one GPU of the planned stage)."""

    num_experts: int
    topk: int
    moe_layers: int
    ep: int
    etp: int
    edp: int
    """Expert-data-parallel ranks (what the experts' optimizer state shards over)."""
    expert_params: float
    """Routed-expert parameters on one rank of the stage."""
    activation_ffn: int
    """The MLP width the layer activation formula sees: ``topk * I + S``."""
    permuted_bytes_per_layer: float
    """The experts' saved permuted inputs, one layer, one micro-batch."""
    dispatcher_bytes: float
    routing_bytes: float
    routing_bytes_per_token: int
    replay: str

    def line(self) -> str:
        replay = "" if self.replay == "none" else (
            f"; routing replay {self.replay}: {self.routing_bytes_per_token} B/token, "
            f"{self.routing_bytes / 2 ** 30:.2f} GiB for the step's micro-batches")
        return (f"  experts  {self.num_experts} experts x top-{self.topk} in {self.moe_layers} layers; ep {self.ep} x "
                f"etp {self.etp} -> {self.num_experts // self.ep} experts per rank "
                f"({self.expert_params / 1e9:.2f}B params), their optimizer state sharded over edp {self.edp}; "
                f"dispatcher {self.dispatcher_bytes / 2 ** 30:.2f} GiB{replay}")


def plan_moe(spec, counts, cfg, world_size: int, s_local: int, step_tokens: float, imbalance: float) -> MoEPlan:
    """The ``MoEPlan`` of ``spec`` (a MoE ``GPTSpec``) under ``cfg.parallel`` on ``world_size``
    GPUs; ``s_local``: one micro-batch's tokens on a CP rank; ``step_tokens``: this rank's tokens
    of the whole step (every micro-batch, all mini-batches). ConfigError on a bad expert grid."""
    p, moe = cfg.parallel, spec.moe
    try:
        lay = ParallelLayout.from_world(world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp,
                                        sequence_parallel=p.sequence_parallel,
                                        distributed_optimizer=p.distributed_optimizer)
        lay.validate(world_size=world_size, shape=ModelShape(
            num_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_query_groups, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            num_experts=moe.num_experts, moe_ffn_hidden_size=moe.ffn_hidden_size))
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    h, k, sparse = spec.hidden_size, moe.topk, sum(moe.layer_pattern)
    edp = world_size // (p.ep * p.etp * p.pp)
    sp = p.tp if p.sequence_parallel else 1
    tokens = s_local / sp  # what one rank's routers see
    mode = cfg.rollout.routing_replay
    layers_per_stage = math.ceil(sparse / p.pp)
    per_token = {"none": 0, "r2": layers_per_stage, "r3": sparse + layers_per_stage}[mode] * k * ROUTE_BYTES
    return MoEPlan(
        num_experts=moe.num_experts, topk=k, moe_layers=sparse, ep=p.ep, etp=p.etp, edp=edp,
        expert_params=(spec.num_layers // p.pp) * counts.experts / (p.ep * p.etp),
        activation_ffn=k * moe.ffn_hidden_size + moe.shared_expert_size,
        permuted_bytes_per_layer=2.0 * k * tokens * h * imbalance,
        dispatcher_bytes=2 * 2.0 * k * tokens * h * imbalance,
        routing_bytes=step_tokens * per_token, routing_bytes_per_token=per_token, replay=mode)
