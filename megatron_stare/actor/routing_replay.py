"""MoE routing replay: the updates route each token to the experts it was routed to before.

``rollout.routing_replay``:

- ``r3`` (rollout routing replay): the log-prob pass routes each token to the experts the
  rollout engine chose for it (``Sample.routed_experts``, carried per token through batching
  as ``MicroBatch.routes``); positions the engine did not route (the prompt, when the engine
  returns no prefill routes) take the trainer's own routing there. The pass records what it
  used, and every mini-batch and PPO epoch of the update replays that record.
- ``r2``: the log-prob pass routes itself and records it; the updates replay the record.

The hook is megatron-core's own: the router calls ``router.router_replay.get_replay_topk``
(``moe_utils.topk_routing_with_score_function``), here a ``RouterTape`` per router. We do not use
megatron's ``RouterReplay`` class itself: it keeps every router of the process (policy and
reference, every model a test builds) in one global list and switches forward/backward replay
with one global action, which the 1F1B schedule's interleaving of forwards and recompute in
backward would have to toggle around every micro-batch. A tape instead takes the current
micro-batch's target in the forward and, under full activation recompute, queues it for the
recompute, which runs inside the autograd backward in the order of the forwards.

Token order: the router sees its input ``[s, b, h]`` flattened, token ``s_i * b + b_i``; under
sequence parallel only this TP rank's chunk of ``s``; under context parallel this CP rank's
part of the (already CP-sliced) micro-batch. A packed micro-batch is one row ``[t, 1]``.
``router_order`` puts ``MicroBatch.routes`` into that order; recorded routes stay in it.

Metrics (fractions over every rank's real tokens x top-k choices, padding not counted):
``moe/replay_changed_frac``: of the replayed choices of the log-prob pass (r3: the engine's),
those the trainer's own router would have made differently; ``moe/replay_changed_frac_update``:
the same over the updates (the record against the updated weights' own choice);
``moe/replay_engine_frac``: the share of the log-prob pass's routed tokens the engine's routes
covered (r3).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Deque, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.models.gpt import GPTSpec
from megatron_stare.models.sharding import unwrap
from megatron_stare.runtime.parallel import ParallelGroups
from megatron_stare.types import MicroBatch, Sample

MODES = ("none", "r3", "r2")


def check_sample_routes(samples: Sequence[Sample], spec: GPTSpec) -> None:
    """One ValueError unless every sample carries ``[n, num_moe_layers, topk]`` routes with
    ``n <= num_tokens - 1`` and experts in range (``rollout.routing_replay=r3``)."""
    moe = spec.moe
    layers, bad = sum(moe.layer_pattern), []
    for s in samples:
        r = s.routed_experts
        if r is None:
            bad.append(f"sample {s.sample_id}: no routed experts from the engine")
        elif r.dim() != 3 or tuple(r.shape[1:]) != (layers, moe.topk) or r.shape[0] > s.num_tokens - 1:
            bad.append(f"sample {s.sample_id}: routed experts {tuple(r.shape)}, expected "
                       f"[<= {s.num_tokens - 1}, {layers}, {moe.topk}]")
        elif r.numel() and (int(r.min()) < 0 or int(r.max()) >= moe.num_experts):
            bad.append(f"sample {s.sample_id}: routed expert outside [0, {moe.num_experts})")
        if bad:
            break
    if bad:
        raise ValueError(f"rollout.routing_replay=r3: {bad[0]}; the engine must return every "
                         f"sample's routed experts (or set rollout.routing_replay=r2 or none)")


def router_order(mb: MicroBatch, cells: Tensor, groups: ParallelGroups, pad=-1) -> Tensor:
    """``cells`` ``[B, L, ...]`` (a per-token field of ``mb``) in the routers' token order:
    ``[tokens, ...]`` (see the module docstring); row positions no cell maps to get ``pad``."""
    if mb.packed is not None:
        row = torch.full((mb.packed.input_ids.shape[1], *cells.shape[2:]), pad, dtype=cells.dtype,
                         device=cells.device)
        mapped = mb.packed.index != 0
        mapped[0, 0] = True  # the first sequence's first token sits at row position 0
        row[mb.packed.index[mapped]] = cells[mapped]
        flat = row
    else:
        flat = cells.transpose(0, 1).reshape(-1, *cells.shape[2:])
    lay = groups.layout
    if lay.sequence_parallel and lay.tp > 1:
        flat = flat.chunk(lay.tp)[groups.tp_rank]
    return flat


def real_tokens(mb: MicroBatch, groups: ParallelGroups) -> Tensor:
    """``[tokens]`` bool in the routers' token order: True at ``mb``'s real tokens, False at its
    padding (a packed row's slot and row padding, which under context parallel sits in this
    rank's chunks of each slot; a padded row's tail)."""
    return router_order(mb, mb.position_ids < mb.seq_lens[:, None], groups, pad=False)


class RouterTape:
    """One router's replay state, in megatron's ``RouterReplay`` interface (``get_replay_topk``).

    ``target``: ``[tokens, k]`` the current micro-batch's experts (-1 rows: route yourself), or
    None; ``backlog``: targets queued for the recompute in backward; ``recorded``: the indices
    used, one ``[tokens, k]`` int16 per forward while recording."""

    def __init__(self, moe_index: int):
        self.moe_index = moe_index
        """Index of the router's layer among the model's MoE layers (the routes' layer axis)."""
        self.target: Optional[Tensor] = None
        self.backlog: Deque[Tensor] = deque()
        self.recording = False
        self.recorded: List[Tensor] = []
        self.real: Optional[Tensor] = None
        """``[tokens]`` bool: the current micro-batch's real tokens (padding is not counted)."""
        self.counts: Optional[Tensor] = None
        """(changed choices, replayed choices, routed choices) of real tokens since the last
        ``take_metrics``, on the router's device (no host sync per call)."""

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        # The recompute of full activation checkpointing runs inside the autograd backward.
        in_backward = torch._C._current_autograd_node() is not None
        if in_backward and self.target is not None and not self.backlog:
            raise RuntimeError("routing replay: a recompute in backward found no queued routes")
        target = self.backlog.popleft() if in_backward else self.target
        if self.counts is None:
            self.counts = torch.zeros(3, dtype=torch.float64, device=own.device)
        idx = own
        real = self.real[:, None] if self.real is not None else torch.ones_like(own[:, :1], dtype=torch.bool)
        if target is not None:
            if target.shape != own.shape:
                raise RuntimeError(f"routing replay: routes {tuple(target.shape)} for a router of "
                                   f"{tuple(own.shape)} (token order or layer mismatch)")
            target = target.to(own.device, torch.long)
            given = target[:, :1] >= 0
            idx = torch.where(given, target, own)
            probs = scores.gather(1, idx)  # equals topk's values where the router's own choice stays
            if not in_backward:
                same = (idx.unsqueeze(2) == own.unsqueeze(1)).any(2) | ~given
                self.counts[0] += (~same & real).sum()
                self.counts[1] += (given & real).sum() * topk
        if not in_backward:
            self.counts[2] += real.sum() * topk
        if self.recording:
            self.recorded.append(idx.to(torch.int16))
        return probs, idx


class RoutingReplay:
    """The tapes of this model stage's routers, fed one micro-batch at a time by the schedule."""

    def __init__(self, stage: torch.nn.Module, spec: GPTSpec, groups: ParallelGroups, mode: str):
        if mode not in MODES[1:]:
            raise ValueError(f"routing replay mode {mode!r}; expected one of {MODES[1:]}")
        if spec.moe is None:
            raise ValueError("rollout.routing_replay needs a mixture-of-experts model")
        inner = unwrap(stage)
        cfg = inner.config
        if cfg.moe_router_fusion:
            raise ValueError("routing replay needs the unfused router (moe_router_fusion=False)")
        self.mode, self.groups = mode, groups
        self.recompute = cfg.recompute_granularity == "full"
        pattern = spec.moe.layer_pattern
        self.tapes: List[RouterTape] = []
        for layer in inner.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                tape = RouterTape(sum(pattern[:layer.layer_number - 1]))
                router.router_replay = tape
                self.tapes.append(tape)

    def feed(self, mb: MicroBatch) -> None:
        """Before ``mb``'s forward on this stage: point every tape at its routes (the record
        after the log-prob pass; the sample routes during an r3 log-prob pass)."""
        real = real_tokens(mb, self.groups)
        for t in self.tapes:
            t.real = real
        if self.tapes and self.tapes[0].recording:
            routes = router_order(mb, mb.routes, self.groups) if mb.routes is not None else None
            for t in self.tapes:
                t.target = None if routes is None else routes[:, t.moe_index]
            return
        if mb.replay is None:
            raise RuntimeError("routing replay: no recorded routes on the micro-batch; run the "
                               "log-prob pass (compute_logprobs) on these batches first")
        queue = self.recompute and torch.is_grad_enabled()
        for j, t in enumerate(self.tapes):
            t.target = mb.replay[:, j]
            if queue:
                t.backlog.append(t.target)

    @contextmanager
    def recording(self, micro_batches: Sequence[MicroBatch]):
        """Record the routing of one forward pass over ``micro_batches`` (in schedule order) into
        each micro-batch's ``replay`` ``[tokens, stage MoE layers, k]`` int16."""
        for t in self.tapes:
            t.recording, t.recorded = True, []
        try:
            yield
            for i, mb in enumerate(micro_batches):
                mb.replay = (torch.stack([t.recorded[i] for t in self.tapes], dim=1) if self.tapes
                             else torch.zeros(0, 0, 0, dtype=torch.int16))
        finally:
            for t in self.tapes:
                t.recording, t.recorded, t.target, t.real = False, [], None, None

    def done(self) -> None:
        """After an update's schedule: every queued recompute target was consumed."""
        for t in self.tapes:
            assert not t.backlog, "routing replay: recompute targets left over (schedule mismatch)"
            t.target = t.real = None

    def take_metrics(self, suffix: str = "") -> Dict[str, float]:
        """The module docstring's fractions since the last call, over all ranks (collective)."""
        total = torch.zeros(3, dtype=torch.float64, device=self.groups.device)
        for t in self.tapes:
            if t.counts is not None:
                total += t.counts.to(total.device)
                t.counts.zero_()
        dist.all_reduce(total)
        changed, replayed, routed = total.tolist()
        out = {f"moe/replay_changed_frac{suffix}": changed / max(replayed, 1.0)}
        if self.mode == "r3" and not suffix:
            out["moe/replay_engine_frac"] = replayed / max(routed, 1.0)
        return out
