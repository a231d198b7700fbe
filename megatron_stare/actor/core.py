"""``MegatronActor``: the policy (and optional reference) stage on this rank, its DDP wrapper
and optimizer, and the step's public calls, each handed to the part that does the work."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

from megatron_stare.actor.batches import prepare_batches
from megatron_stare.actor.diagnostics import entropy_diagnostics, gather_selected_keys
from megatron_stare.actor.logprob_pass import (fill_old_logprobs, fill_reference_logprobs, logprob_pass_reason,
                                               share_update_stats, step_stats)
from megatron_stare.actor.loss_plans import plan_step
from megatron_stare.actor.mismatch import masked_fraction
from megatron_stare.actor.optim import build_optimizer
from megatron_stare.actor.routing_replay import RoutingReplay, check_sample_routes
from megatron_stare.actor.schedule import share_from_last_stage
from megatron_stare.actor.token_stats import TokenStatsKernel
from megatron_stare.actor.types import ActorSettings, StepStats, UpdateResult, WeightLoader
from megatron_stare.actor.update import LossContext, train_mini_batch
from megatron_stare.algorithms.aggregation import MetricSums
from megatron_stare.algorithms.losses import LossPlan, build_policy_loss
from megatron_stare.algorithms.off_policy import resolve_off_policy
from megatron_stare.algorithms.stare import StareState
from megatron_stare.models.gpt import GPTSpec
from megatron_stare.actor.moe_metrics import ExpertLoad, router_loss_metrics
from megatron_stare.models.provider import build_model_stage
from megatron_stare.runtime.parallel import ParallelGroups
from megatron_stare.types import MicroBatch, Sample


class MegatronActor:
    """A policy (and optionally a reference) model stage on this rank, plus its optimizer."""

    def __init__(self, spec: GPTSpec, groups: ParallelGroups, settings: ActorSettings,
                 load_weights: WeightLoader, load_ref_weights: Optional[WeightLoader] = None,
                 trainable: bool = True):

        self.spec, self.groups, self.s = spec, groups, settings
        lay = groups.layout
        aux, z = settings.moe_router_losses
        stage, self.config = build_model_stage(spec, groups, dtype=settings.dtype, attention=settings.attention,
                                               recompute=settings.parallel.recompute,
                                               moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
        load_weights(stage, groups)
        self.expert_load = (ExpertLoad(stage, spec.num_layers, spec.moe.num_experts, groups)
                            if spec.moe is not None else None)
        self.replay = (RoutingReplay(stage, spec, groups, settings.routing_replay)
                       if settings.routing_replay != "none" else None)
        self._replay_metrics: Dict[str, float] = {}
        self.loss_fn = build_policy_loss(settings.algorithm)
        self.off_policy = settings.off_policy or resolve_off_policy(settings.algorithm)[0]
        self.kernel = TokenStatsKernel(tp_group=groups.tp_group, valid_vocab_size=spec.vocab_size,
                                       temperature=settings.temperature, chunk_size=settings.logprob_chunk)
        self.ref = None
        if load_ref_weights is not None:
            self.ref, _ = build_model_stage(spec, groups, dtype=settings.dtype, attention=settings.attention)
            load_ref_weights(self.ref, groups)
            self.ref.requires_grad_(False)
        if not trainable:
            self.model, self.optimizer, self.scheduler = stage, None, None
            return
        self.model = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=lay.distributed_optimizer),
            module=stage,
        )
        self.optimizer, self.scheduler = build_optimizer(self.model, settings.optimizer, lay, settings.dtype,
                                                         settings.total_optimizer_steps)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped GPTModel stage."""
        return getattr(self.model, "module", self.model)

    def prepare(self, samples: Sequence[Sample], mini_batches: int = 1) -> List[List[MicroBatch]]:
        """This DP rank's mini-batches of micro-batches for the step's global ``samples``."""
        if self.s.routing_replay == "r3":
            check_sample_routes(samples, self.spec)
        return prepare_batches(samples, self.groups, self.s, mini_batches)

    def logprob_pass_reason(self, mode: str, mini_batches: int, ppo_epochs: int, gepo: bool) -> Optional[str]:
        """Why a step needs ``compute_logprobs`` before ``update``; None: ``update(fill_old=True)``
        stands in for it (``logprob_pass.logprob_pass_reason``)."""
        return logprob_pass_reason(mode, self.loss_fn, mini_batches=mini_batches, ppo_epochs=ppo_epochs,
                                   gepo=gepo, routing_replay=self.s.routing_replay)

    def compute_logprobs(self, batches: List[List[MicroBatch]], sensitivity: bool = True) -> StepStats:
        """Forward-only pass: fills ``old_logp``, ``entropy`` (and sensitivity sums, ``ref_logp``)
        of every micro-batch on every rank; returns the global entropy and mismatch."""
        stats = fill_old_logprobs(self.model, self.ref, batches, self.kernel, self.groups, sensitivity, self.replay)
        if self.replay is not None:
            stats.replay_metrics = self._replay_metrics = self.replay.take_metrics()
        return self._with_masked_fraction(stats, batches)

    def reference_logprobs(self, batches: List[List[MicroBatch]]) -> None:
        """Fill ``ref_logp`` of every micro-batch (a reference model held) without the policy's
        pass (its values come from ``update(fill_old=True)``)."""
        if self.ref is not None:
            fill_reference_logprobs(self.ref, [mb for mini in batches for mb in mini], self.kernel, self.groups)

    def step_stats(self, batches: List[List[MicroBatch]]) -> StepStats:
        """``compute_logprobs``'s result, read after ``update(fill_old=True)`` filled the fields."""
        return self._with_masked_fraction(step_stats([mb for mini in batches for mb in mini], self.groups), batches)

    def _with_masked_fraction(self, stats: StepStats, batches: List[List[MicroBatch]]) -> StepStats:
        if self.off_policy.masks:
            g = self.groups
            stats.ratio_masked_frac = masked_fraction([mb for mini in batches for mb in mini], self.off_policy,
                                                      g.dp_cp_group, g.cp_group if g.layout.cp > 1 else None,
                                                      g.device)
        return stats

    def loss_plans(self, batches: List[List[MicroBatch]], step: int,
                   stare_state: Optional[StareState] = None) -> List[LossPlan]:
        """The loss plan of every mini-batch (collective); pass them to ``update`` and
        ``entropy_diagnostics`` so both read the same global selections."""
        return plan_step(self.loss_fn, batches, self.groups, step, stare_state)

    def entropy_diagnostics(self, batches: List[List[MicroBatch]], plans: Sequence[LossPlan]
                            ) -> Dict[str, float]:
        """Entropy dynamics of the step from the plans' STARE selections (``diagnostics``)."""
        return entropy_diagnostics(batches, plans, self.s.algorithm, self.groups.dp_cp_group)

    def update(self, batches: List[List[MicroBatch]], step: int, stare_state: Optional[StareState] = None,
               ppo_epochs: int = 1, collect_selection: bool = False,
               plans: Optional[Sequence[LossPlan]] = None, fill_old: bool = False) -> UpdateResult:
        """One optimizer step per mini-batch (per PPO epoch) with the registered policy loss.

        ``plans``: the mini-batches' loss plans (``loss_plans``); computed here when None.
        ``fill_old``: no ``compute_logprobs`` ran (``logprob_pass_reason`` is None): the forward
        fills its fields on every rank (then ``step_stats``); one mini-batch, one epoch only.
        """
        g, lay = self.groups, self.groups.layout
        if fill_old and (ppo_epochs != 1 or len(batches) != 1):
            raise ValueError(f"update(fill_old=True) needs one mini-batch and one epoch, got "
                             f"{len(batches)} x {ppo_epochs}: later steps would not be at the sampling weights")
        if plans is None:
            plans = self.loss_plans(batches, step, stare_state)
        ctx = LossContext(loss_fn=self.loss_fn, kernel=self.kernel,
                          entropy_grad=self.s.algorithm.entropy_coeff > 0, off_policy=self.off_policy,
                          cp_group=g.cp_group if lay.cp > 1 else None, stare=self.s.algorithm.stare,
                          collect_selection=collect_selection, fill_old=fill_old)
        result = UpdateResult(loss=[], grad_norm=[])
        all_metrics = MetricSums()
        if self.expert_load is not None:
            self.expert_load.reset()
            self.expert_load.active = True
        selected: list = []
        optimizer_s = 0.0
        for _ in range(ppo_epochs):
            for micro_batches, plan in zip(batches, plans):
                r = train_mini_batch(self.model, self.optimizer, self.scheduler, micro_batches, plan, ctx,
                                     g, self.s.optimizer.clip_grad, self.replay, self.expert_load)
                result.skipped_steps += 0 if r.applied else 1
                result.loss.append(r.loss)
                result.grad_norm.append(r.grad_norm)
                optimizer_s += r.optimizer_s
                all_metrics.merge(r.metrics)
                selected.extend(r.selected_keys)
        if fill_old:
            share_update_stats([mb for mini in batches for mb in mini], g)
        all_metrics.all_reduce(g.dp_cp_group, device=g.device)
        result.metrics = share_from_last_stage(all_metrics.means(), g)
        result.metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        result.optimizer_s = optimizer_s
        if self.replay is not None:  # the log-prob pass's replay metrics are logged with the update's
            result.metrics.update({**self._replay_metrics, **self.replay.take_metrics("_update")})
        if self.expert_load is not None:
            self.expert_load.active = False
            result.metrics.update(self.expert_load.metrics(self.spec.moe.layer_pattern))
            result.metrics.update(router_loss_metrics(g, ppo_epochs * sum(len(m) for m in batches)))
        if collect_selection:
            result.selected_keys = gather_selected_keys(selected, g)
        return result
