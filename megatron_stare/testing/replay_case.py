"""Routing replay cases on one process (``run_on_ranks(run_replay_cases, 1)``): what the routers
chose, captured inside the model, against the routes they were given.

Every case runs padded micro-batches of one sequence each (``max_rows=1``), so a router's token
``i`` is the sequence's input position ``i`` and the expectation needs none of the replay's own
token-order logic; the layouts that reorder tokens are proven equal to these by the update
equivalence tests (``test_routing_replay.py``).

- ``r3``: the log-prob pass routes every engine-routed position to the engine's experts, and
  every forward and recompute of every update routes as the log-prob pass did;
- ``r2``: every mini-batch and PPO epoch routes as the log-prob pass did, while the weights
  have moved enough that their own routing differs (``moe/replay_changed_frac_update`` > 0);
- ``near_tie``: an "engine" whose router weights differ from the trainer's by a small
  perturbation flips some top-k choices of near-tied router logits; the trainer's mean
  |log-prob - engine log-prob| with r3 over the same without replay.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch

from megatron_stare.actor.routing_replay import RoutingReplay
from megatron_stare.algorithms.stare import StareController
from megatron_stare.models.sharding import unwrap
from megatron_stare.testing.actor_case import (MOE_SPEC, actor_case_result, build_case_actor, case_groups,
                                               synthetic_routes, synthetic_samples)


class RouteCapture:
    """Compares, on every router call, the routing map the router produced with the expected
    experts of the micro-batch the schedule is running (``expect(mb, moe_index)`` ->
    ``[tokens, k]``, -1 rows unchecked). No pipelining: a micro-batch's backward (and its
    recompute) directly follows its forward."""

    def __init__(self, actor, expect):
        self.expect, self.mb = expect, None
        self.checked = self.recomputed = self.wrong = 0
        replay: RoutingReplay = actor.replay
        feed = replay.feed

        def fed(mb):
            self.mb = mb
            feed(mb)

        replay.feed = fed
        for layer in unwrap(actor.module).decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.register_forward_hook(self._hook(router.router_replay.moe_index))

    def _hook(self, j: int):
        def hook(module, inputs, output):
            routing_map = output[1]
            want = self.expect(self.mb, j)
            rows = want[:, 0] >= 0
            expected = torch.zeros_like(routing_map)
            expected[rows] = expected[rows].scatter(1, want[rows].long(), True)
            self.wrong += int((routing_map[rows] != expected[rows]).any(1).sum())
            self.checked += int(rows.sum())
            self.recomputed += int(torch._C._current_autograd_node() is not None)

        return hook


def _one_row_routes(mb, j: int) -> torch.Tensor:
    """The engine's routes of a one-sequence micro-batch, ``[L, k]`` in position order."""
    return mb.routes[0, :, j]


def _r3_case(groups, covered: str) -> Dict[str, float]:
    actor, algo = build_case_actor(groups, spec=MOE_SPEC, routing_replay="r3", max_rows=1,
                                   pack_sequences=False, recompute="full", lr=1e-2)
    samples = synthetic_samples()
    synthetic_routes(samples, MOE_SPEC, covered)
    batches = actor.prepare(samples, mini_batches=2)
    cap = RouteCapture(actor, _one_row_routes)
    stats = actor.compute_logprobs(batches)
    state = StareController(algo.stare).update(stats.entropy)
    engine_checked, engine_wrong = cap.checked, cap.wrong
    recorded = {int(mb.sample_ids[0]): mb.replay.clone() for mini in batches for mb in mini}
    cap.expect = lambda mb, j: recorded[int(mb.sample_ids[0])][:, j]
    cap.checked = cap.wrong = 0
    res = actor.update(batches, step=0, stare_state=state, ppo_epochs=2)
    return {"engine_checked": engine_checked, "engine_wrong": engine_wrong, "update_checked": cap.checked,
            "update_wrong": cap.wrong, "recomputed": cap.recomputed, **stats.replay_metrics,
            "changed_update": res.metrics["moe/replay_changed_frac_update"]}


def _r2_case(groups) -> Dict[str, float]:
    actor, algo = build_case_actor(groups, spec=MOE_SPEC, routing_replay="r2", max_rows=1,
                                   pack_sequences=False, lr=3e-2)
    batches = actor.prepare(synthetic_samples(), mini_batches=2)
    cap = RouteCapture(actor, lambda mb, j: torch.full((mb.shape[1], 1), -1))
    state = StareController(algo.stare).update(actor.compute_logprobs(batches).entropy)
    recorded = {int(mb.sample_ids[0]): mb.replay.clone() for mini in batches for mb in mini}
    cap.expect = lambda mb, j: recorded[int(mb.sample_ids[0])][:, j]
    res = actor.update(batches, step=0, stare_state=state, ppo_epochs=2)
    return {"update_checked": cap.checked, "update_wrong": cap.wrong,
            "changed_update": res.metrics["moe/replay_changed_frac_update"]}


def _near_tie_case(groups, router_scale: float = 0.1, noise: float = 0.02) -> Dict[str, float]:
    """Router weights scaled by ``router_scale`` (near-tied logits); the engine's by a further
    relative ``noise``. The engine's routes and log-probs come from its own log-prob pass."""
    def actor(mode):
        a, _ = build_case_actor(groups, spec=MOE_SPEC, routing_replay=mode, max_rows=1, pack_sequences=False)
        with torch.no_grad():
            for name, p in a.module.named_parameters():
                if name.endswith("router.weight"):
                    p.mul_(router_scale)
        return a

    engine = actor("r2")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if name.endswith("router.weight"):
                p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=g).to(p.dtype))
    samples = synthetic_samples()
    by_id = {s.sample_id: s for s in samples}
    batches = engine.prepare(samples)
    engine.compute_logprobs(batches)
    for mb in (mb for mini in batches for mb in mini):
        s = by_id[int(mb.sample_ids[0])]
        s.routed_experts = mb.replay[:s.num_tokens - 1].cpu()
        s.engine_logprobs = mb.old_logp[0][mb.loss_mask[0]].tolist()
    out: Dict[str, float] = {}
    for mode in ("none", "r3"):
        a = actor(mode)
        stats = a.compute_logprobs(a.prepare(samples))
        out[f"mismatch_{mode}"] = stats.mismatch_mean
        out[f"mismatch_max_{mode}"] = stats.mismatch_max
        if mode == "r3":
            out["flipped_frac"] = stats.replay_metrics["moe/replay_changed_frac"]
    out["ratio"] = out["mismatch_r3"] / out["mismatch_none"]
    return out


def run_replay_cases(rank: int, world: int, variants: Sequence[dict] = ()) -> Dict[str, object]:
    """The module docstring's cases on one process, and ``actor_case_result`` of each of
    ``variants`` (the layout tests' single-process references: one spawn for all)."""
    groups = case_groups(world, 1, 1)
    return {"r3_full": _r3_case(groups, "full"), "r3_response": _r3_case(groups, "response"),
            "r2": _r2_case(groups), "near_tie": _near_tie_case(groups),
            "variants": [actor_case_result(groups, **dict(v)) for v in variants]}
