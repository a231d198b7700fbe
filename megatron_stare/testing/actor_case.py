"""A fixed synthetic rollout batch and one actor update, for the layout-equivalence tests.

``run_actor_case(rank, world, tp, pp, **kw)`` runs, at (tp, pp, cp, dp = world/(tp*pp*cp)), the
log-prob pass, the STARE controller and one update of the tiny Qwen2-style model on a batch of
mixed prompt/response lengths and mixed advantages, and returns what must be layout-independent:
the losses, grad norms, metrics, selected token keys and the updated canonical weights (fp32);
the micro-batch widths this rank ran; and the log-prob pass's per-token results by token key.
Knobs: context parallel, packed or padded micro-batches, sequence parallel, the distributed
optimizer, bf16, and the model (``spec``: ``MOE_SPEC`` is a tiny Qwen3-MoE, run at expert
parallel layouts with ``ep``/``etp``; ``routing_replay`` with synthetic ``engine_routes``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Dict, List, Optional, Sequence

import torch

from megatron_stare.algorithms.advantages import compute_advantages
from megatron_stare.config.algorithm import AlgorithmConfig, StareConfig
from megatron_stare.algorithms.stare import StareController
from megatron_stare.config.load import OptimizerConfig, ParallelConfig
from megatron_stare.models import moe_router
from megatron_stare.models.gpt import GPTSpec, MoESpec, transformer_engine_error
from megatron_stare.models.sharding import load_canonical
from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
from megatron_stare.testing.megatron_tiny import TINY_SPEC, gather_full_weights, seeded_canonical
from megatron_stare.types import Sample
from megatron_stare.actor import ActorSettings, MegatronActor


#: A tiny Qwen3-MoE: q/k norms, 8 experts of width 32, top-2 with renormalised probabilities.
MOE_SPEC = dataclasses.replace(TINY_SPEC, num_layers=2, add_qkv_bias=False, qk_layernorm=True, architecture="qwen3_moe",
                               moe=MoESpec(num_experts=8, topk=2, ffn_hidden_size=32, layer_pattern=(1, 1)))


def synthetic_samples(groups: int = 4, n: int = 4, seed: int = 0, vocab: int = TINY_SPEC.vocab_size) -> List[Sample]:
    """``groups`` prompts x ``n`` responses; lengths 2-24, rewards in {0, 1} (some equal groups)."""
    rng = random.Random(seed)
    out: List[Sample] = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
        for _ in range(n):
            resp = [rng.randrange(vocab) for _ in range(rng.choice([2, 5, 11, 24]))]
            out.append(Sample(sample_id=len(out), group_id=g, prompt_ids=prompt, response_ids=resp,
                              reward=float(rng.random() < 0.5) if g != 1 else 1.0))
    rewards = torch.tensor([s.reward for s in out])
    adv = compute_advantages(rewards, torch.tensor([s.group_id for s in out]), AlgorithmConfig())
    for s, a in zip(out, adv.tolist()):
        s.advantage = a
    return out


def gather_full_model(actor) -> Dict[str, torch.Tensor]:
    """Canonical fp32 weights of the whole model on every rank (test-sized models only)."""
    return gather_full_weights(actor.module, actor.groups)


def case_groups(world: int, tp: int, pp: int, *, cp: int = 1, distributed_optimizer: bool = False,
                sequence_parallel: bool = False, ep: int = 1, etp: int = 1):
    """Process groups of the layout (tp, pp, cp, dp = world/(tp*pp*cp); experts at ep, etp);
    once per process."""
    lay = ParallelLayout.from_world(world, tp=tp, pp=pp, cp=cp, distributed_optimizer=distributed_optimizer,
                                    sequence_parallel=sequence_parallel, ep=ep, etp=etp)
    return init_distributed(lay, seed=1234)


def build_case_actor(groups, *, policy_loss: str = "stare", target_entropy: float = 100.0,
                     variant: str = "C2", max_rows=None, micro_batch_tokens: int = 4096,
                     lr: float = 1e-5, dtype=torch.float32, weights_seed: int = 0,
                     pack_sequences: bool = True, algorithm: Optional[dict] = None,
                     spec: GPTSpec = TINY_SPEC, moe_router_losses=(0.0, 0.0),
                     routing_replay: str = "none", recompute: Optional[str] = None,
                     fused_adam: bool = True):
    """(actor, algorithm config) of the tiny model at ``groups.layout``, its weights
    ``seeded_canonical(.., weights_seed)``; context and sequence parallel and the distributed
    optimizer follow the layout. ``algorithm``: further ``AlgorithmConfig`` fields (aggregation
    mode, entropy bonus, Cov configs, ...); with ``kl_loss_coef`` > 0 the actor also holds a
    reference model, weights ``seeded_canonical(.., weights_seed + 1)``. ``spec``: the model
    (``MOE_SPEC``: experts at the layout's ep/etp, router losses ``moe_router_losses``,
    ``routing_replay`` none | r3 | r2); ``recompute``: ``parallel.recompute``; ``fused_adam``:
    ``optimizer.fused_adam``."""
    lay = groups.layout
    algo = AlgorithmConfig(policy_loss=policy_loss, clip_ratio_c=10.0, **(algorithm or {}),
                           stare=StareConfig(variant=variant, top_p=0.2, target_entropy=target_entropy))
    settings = ActorSettings(parallel=ParallelConfig(tp=lay.tp, pp=lay.pp, cp=lay.cp,
                                                     micro_batch_tokens=micro_batch_tokens,
                                                     pack_sequences=pack_sequences,
                                                     sequence_parallel=lay.sequence_parallel,
                                                     distributed_optimizer=lay.distributed_optimizer,
                                                     ep=lay.ep, etp=lay.etp, recompute=recompute),
                             optimizer=OptimizerConfig(lr=lr, clip_grad=1.0, fused_adam=fused_adam), algorithm=algo,
                             dtype=dtype, max_rows_per_micro_batch=max_rows,
                             moe_router_losses=tuple(moe_router_losses), routing_replay=routing_replay,
                             # The tests' explicit choice where transformer-engine is absent (no fallback).
                             attention="auto" if transformer_engine_error() is None else "torch")

    def loader(seed):
        return lambda stage, g: load_canonical(stage, lambda n, s: seeded_canonical(n, s, seed).to(dtype),
                                               g.tp_rank, g.layout.tp, etp_rank=g.etp_rank, etp=g.layout.etp)

    ref = loader(weights_seed + 1) if algo.kl_loss_coef > 0 else None
    return MegatronActor(spec, groups, settings, loader(weights_seed), ref), algo


def token_values(batches, name: str) -> Dict[int, float]:
    """``{token key: value}`` of a per-token field over this rank's response tokens."""
    out: Dict[int, float] = {}
    for mini in batches:
        for mb in mini:
            m = mb.loss_mask
            out.update(zip(mb.token_keys[m].tolist(), getattr(mb, name)[m].double().tolist()))
    return out


def gather_full_grads(actor) -> Optional[Dict[str, torch.Tensor]]:
    """Canonical fp32 gradients of the last mini-batch (reduced over DP/CP, clipped) on every
    rank; None with the distributed optimizer (each rank then holds a shard of them)."""
    if actor.groups.layout.distributed_optimizer:
        return None
    params = list(actor.module.parameters())
    saved = [p.data for p in params]
    try:
        for p in params:  # gather_canonical reads .data: show it the gradient buffers
            p.data = p.main_grad.to(p.dtype)
        return gather_full_model(actor)
    finally:
        for p, data in zip(params, saved):
            p.data = data


def synthetic_routes(samples: Sequence[Sample], spec: GPTSpec, covered: str = "full") -> None:
    """Give every sample "engine" routes (``Sample.routed_experts``): ``topk`` distinct experts per
    position and MoE layer, a function of the sample id only. ``covered``: ``full`` every input
    position (an engine that returns prefill routes), ``response`` the last ``T`` only."""
    moe = spec.moe
    for s in samples:
        n = s.num_tokens - 1 if covered == "full" else len(s.response_ids)
        g = torch.Generator().manual_seed(1000 + s.sample_id)
        scores = torch.rand(n, sum(moe.layer_pattern), moe.num_experts, generator=g)
        s.routed_experts = scores.argsort(-1)[..., :moe.topk].to(torch.int16)


def actor_case_result(groups, *, mini_batches: int = 1, poison_advantage: bool = False,
                      engine_logp: bool = False, engine_routes: Optional[str] = None,
                      megatron_z_loss: bool = False, on_policy: bool = False, **knobs) -> dict:
    """One log-prob pass, controller update and STARE update at ``groups`` (see the module
    docstring); ``knobs`` go to ``build_case_actor``. ``engine_logp``: give every token a
    behaviour log-prob ``old_logp - 0.8*sin(1.7*key)`` (ratios in [0.45, 2.2], a function of the
    token's key) for the off-policy corrections. ``engine_routes``: ``synthetic_routes`` coverage
    (full | response) for routing replay. ``megatron_z_loss``: megatron-core's own per-rank
    z-loss instead of ``models.moe_router``'s (to show what that patch changes).
    ``on_policy``: the old log-probs stay the pass's (ratio 1; ``on_policy_case_result``)."""
    if on_policy:
        return on_policy_case_result(groups, engine_logp=engine_logp, **knobs)
    actor, algo = build_case_actor(groups, **knobs)
    if megatron_z_loss:
        moe_router.uninstall()
    samples = synthetic_samples()
    if engine_routes is not None:
        synthetic_routes(samples, actor.spec, engine_routes)
    if poison_advantage:  # a non-finite advantage must make the step skip, not corrupt weights
        samples[3].advantage = float("nan")
    batches = actor.prepare(samples, mini_batches=mini_batches)
    stats = actor.compute_logprobs(batches)
    logp, entropy = token_values(batches, "old_logp"), token_values(batches, "entropy")
    state = StareController(algo.stare).update(stats.entropy)
    # A second, perturbed "old" policy makes rho != 1 so the clip branches are exercised.
    for mini in batches:
        for mb in mini:
            if engine_logp:
                mb.engine_logp = mb.old_logp - 0.8 * torch.sin(1.7 * mb.token_keys.double()).float()
            mb.old_logp = mb.old_logp + 0.05 * torch.sin(mb.token_keys.double()).float()
    res = actor.update(batches, step=0, stare_state=state, collect_selection=True)
    if megatron_z_loss:
        moe_router.install()
    return {"loss": res.loss, "grad_norm": res.grad_norm, "metrics": res.metrics,
            "skipped": res.skipped_steps, "widths": [mb.model_shape[1] for mini in batches for mb in mini],
            "tokens": sum(mb.model_shape[0] * mb.model_shape[1] for mini in batches for mb in mini),
            "selected": res.selected_keys, "entropy": stats.entropy, "gate_on": state.gate_on,
            "num_tokens": stats.num_tokens, "logp": logp, "token_entropy": entropy,
            "grads": gather_full_grads(actor), "weights": gather_full_model(actor)}


def on_policy_case_result(groups, *, logprob_pass: bool = True, engine_logp: bool = False, **knobs) -> dict:
    """One on-policy step (one mini-batch, the old log-probs the current policy's) as the trainer
    runs it: with the separate log-prob pass, or (``logprob_pass`` False) with the update's
    forward filling its fields (``update(fill_old=True)``, then ``step_stats``). Returns the
    update's results, the pass's statistics (entropy, mismatch, masked fraction), the entropy
    diagnostics and the per-token old log-probs/entropies. ``engine_logp``: behaviour
    log-probs ``-log(V) - 0.8*sin(1.7*key)`` (near the random model's, set before either path)."""
    actor, algo = build_case_actor(groups, **knobs)
    batches = actor.prepare(synthetic_samples())
    flat = [mb for mini in batches for mb in mini]
    if engine_logp:
        for mb in flat:
            mb.engine_logp = (-math.log(actor.spec.vocab_size) - 0.8 * torch.sin(1.7 * mb.token_keys.double())).float()
    controller = StareController(algo.stare)
    if logprob_pass:
        stats = actor.compute_logprobs(batches)
        state = controller.update(stats.entropy)
        plans = actor.loss_plans(batches, 0, state)
        res = actor.update(batches, step=0, stare_state=state, plans=plans)
    else:
        actor.reference_logprobs(batches)
        plans = actor.loss_plans(batches, 0, controller.state)
        res = actor.update(batches, step=0, stare_state=controller.state, plans=plans, fill_old=True)
        stats = actor.step_stats(batches)
    return {"loss": res.loss, "grad_norm": res.grad_norm, "metrics": res.metrics, "selected": [],
            "num_tokens": stats.num_tokens, "entropy": stats.entropy,
            "mismatch": (stats.mismatch_mean, stats.mismatch_max),
            "masked_frac": stats.ratio_masked_frac, "dynamics": actor.entropy_diagnostics(batches, plans),
            "logp": token_values(batches, "old_logp"), "token_entropy": token_values(batches, "entropy"),
            "weights": gather_full_model(actor)}


def run_actor_case(rank: int, world: int, tp: int, pp: int, *, cp: int = 1,
                   distributed_optimizer: bool = False, sequence_parallel: bool = False, ep: int = 1,
                   etp: int = 1, **knobs):
    """``actor_case_result`` at (tp, pp, cp, dp = world/(tp*pp*cp); ep, etp); entry point for
    ``run_on_ranks``."""
    groups = case_groups(world, tp, pp, cp=cp, distributed_optimizer=distributed_optimizer,
                         sequence_parallel=sequence_parallel, ep=ep, etp=etp)
    return actor_case_result(groups, **knobs)


def run_actor_variants(rank: int, world: int, tp: int, pp: int, variants: Sequence[dict], *,
                       cp: int = 1, ep: int = 1, etp: int = 1) -> List[dict]:
    """``actor_case_result`` of each of ``variants`` (knob dicts; ``sequence_parallel`` and
    ``distributed_optimizer`` among them: they change the actor, not the process groups) on one
    set of process groups, in one process: spawning ranks and importing megatron-core costs far
    more than a tiny case, so tests batch their variants here."""
    groups = case_groups(world, tp, pp, cp=cp, ep=ep, etp=etp, sequence_parallel=tp > 1 and ep > 1)
    out = []
    for knobs in variants:
        knobs = dict(knobs)
        lay = dataclasses.replace(groups.layout, sequence_parallel=knobs.pop("sequence_parallel", groups.layout.sequence_parallel),
                                  distributed_optimizer=knobs.pop("distributed_optimizer", False))
        out.append(actor_case_result(dataclasses.replace(groups, layout=lay.validate()), **knobs))
    return out
