"""The Megatron actor: log-prob pass and policy update over Megatron's pipeline schedule.

One step, on every rank, from the same global list of samples:

    batches = actor.prepare(samples)                # this DP rank's mini-batches of micro-batches
    stats   = actor.compute_logprobs(batches)       # old log-prob, entropy (+ ref) per token
    state   = controller.update(stats.entropy)      # STARE gate from the GLOBAL token-mean entropy
    result  = actor.update(batches, step, state)    # registered loss, Megatron optimizer

Correctness across layouts rests on three things: every rank derives the same micro-batch plan;
loss denominators and STARE/Cov selections are global (computed once per mini-batch from the
old-log-prob pass over the data(x context)-parallel group); and the backward scale undoes
exactly what Megatron's schedule and DDP divide by (``aggregation.backward_scale``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_stare.algorithms.aggregation import (MetricSums, backward_scale, global_token_mean,
                                                   sequence_token_counts)
from megatron_stare.algorithms.config import AlgorithmConfig
from megatron_stare.algorithms.losses import MiniBatchInput, PolicyLossInput, build_policy_loss
from megatron_stare.algorithms.stare import StareState
from megatron_stare.batching import plan_rank_batches
from megatron_stare.config import OptimizerConfig, ParallelConfig
from megatron_stare.models.gpt import GPTSpec
from megatron_stare.models.provider import build_model_stage
from megatron_stare.ops.vocab_parallel import vocab_parallel_logprobs_entropy
from megatron_stare.parallel import ParallelGroups
from megatron_stare.types import MicroBatch, Sample, cat_padded

WeightLoader = Callable[[torch.nn.Module, ParallelGroups], None]


@dataclass
class ActorSettings:
    """What the actor needs beyond the model: a view of the run config's relevant sections."""

    parallel: ParallelConfig
    optimizer: OptimizerConfig
    algorithm: AlgorithmConfig
    temperature: float = 1.0
    """Log-probs are those of softmax(logits / temperature), the rollout's distribution."""
    dtype: torch.dtype = torch.float32
    total_optimizer_steps: int = 1000
    """Length of the LR schedule (decay steps)."""
    max_rows_per_micro_batch: Optional[int] = None
    logprob_chunk: int = 1024
    tis_cap: Optional[float] = None
    """Truncated importance sampling: weight each token by min(exp(old - engine), cap)."""


@dataclass
class StepStats:
    """Global results of the log-prob pass (identical on every rank)."""

    entropy: float
    """Token-mean entropy of the whole training batch (all DP ranks): the controller's input."""
    num_tokens: int
    mismatch_mean: Optional[float] = None
    """Mean |logp_engine - logp_train| over response tokens (when engine log-probs came)."""
    mismatch_max: Optional[float] = None


@dataclass
class UpdateResult:
    loss: List[float]
    """Global mini-batch loss per optimizer step."""
    grad_norm: List[float]
    metrics: Dict[str, float] = field(default_factory=dict)
    skipped_steps: int = 0
    selected_keys: Optional[List[int]] = None
    """Debug: global keys of STARE-selected tokens (sorted), when requested."""


class MegatronActor:
    """A policy (and optionally a reference) model stage on this rank, plus its optimizer."""

    def __init__(self, spec: GPTSpec, groups: ParallelGroups, settings: ActorSettings,
                 load_weights: WeightLoader, load_ref_weights: Optional[WeightLoader] = None,
                 trainable: bool = True):
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig, finalize_model_grads)

        self.spec, self.groups, self.s = spec, groups, settings
        lay = groups.layout
        p = settings.parallel
        stage, self.config = build_model_stage(spec, groups, dtype=settings.dtype, recompute=p.recompute)
        load_weights(stage, groups)
        self.loss_fn = build_policy_loss(settings.algorithm)
        self.ref = None
        if load_ref_weights is not None:
            self.ref, _ = build_model_stage(spec, groups, dtype=settings.dtype)
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
        self.optimizer, self.scheduler = self._build_optimizer()
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync

    # ------------------------------------------------------------------ setup
    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig as MOptConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o, lay = self.s.optimizer, self.groups.layout
        opt = get_megatron_optimizer(
            MOptConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                       adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                       clip_grad=o.clip_grad, bf16=self.s.dtype == torch.bfloat16,
                       params_dtype=self.s.dtype, use_distributed_optimizer=lay.distributed_optimizer),
            [self.model],
        )
        steps = max(self.s.total_optimizer_steps, o.warmup_steps + 1)
        sched = OptimizerParamScheduler(
            opt, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=steps, lr_decay_style=o.lr_schedule,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=steps,
            wd_incr_style="constant")
        return opt, sched

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped GPTModel stage."""
        return getattr(self.model, "module", self.model)

    def prepare(self, samples: Sequence[Sample], mini_batches: int = 1) -> List[List[MicroBatch]]:
        """This DP rank's mini-batches of micro-batches for the step's global ``samples``."""
        lay = self.groups.layout
        per_mini = len(samples) // max(mini_batches, 1)
        if per_mini < lay.dp:
            raise ValueError(f"a mini-batch of {per_mini} samples cannot feed {lay.dp} data-parallel "
                             f"ranks; raise trainer.prompts_per_step or lower the DP degree")
        with_engine = all(s.engine_logprobs is not None for s in samples)
        batches = plan_rank_batches(samples, mini_batches=mini_batches, dp_rank=self.groups.dp_rank,
                                    dp_size=lay.dp, token_budget=self.s.parallel.micro_batch_tokens,
                                    max_rows=self.s.max_rows_per_micro_batch, with_engine_logp=with_engine,
                                    cp=lay.cp, cp_rank=self.groups.cp_rank)
        return [[mb.to(self.groups.device) for mb in mini] for mini in batches]

    # ------------------------------------------------------------------ per-token statistics
    def _token_stats(self, logits: torch.Tensor, mb: MicroBatch, *, entropy_grad: bool,
                     sensitivity: bool):
        b, l, v = logits.shape
        return vocab_parallel_logprobs_entropy(
            logits.reshape(b * l, v), mb.targets.reshape(-1), tp_group=self.groups.tp_group,
            valid_vocab_size=self.spec.vocab_size, temperature=self.s.temperature,
            with_entropy=True, entropy_grad=entropy_grad, with_sensitivity=sensitivity,
            chunk_size=self.s.logprob_chunk)

    def _run(self, model, micro_batches: List[MicroBatch], loss_func_for, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iter, m):
            mb = next(data_iter)
            out = m(mb.input_ids, mb.position_ids, None)
            return out, loss_func_for(mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.shape[1] for mb in micro_batches),
            micro_batch_size=max(mb.shape[0] for mb in micro_batches), forward_only=forward_only)

    def _broadcast_from_last_stage(self, tensors: List[torch.Tensor]) -> None:
        """Make the last pipeline stage's per-token results available on every stage."""
        if self.groups.layout.pp == 1:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0, device=self.groups.device)
        dist.broadcast(flat, src=self.groups.pp_last_rank, group=self.groups.pp_group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()

    @torch.no_grad()
    def _forward_pass(self, model, micro_batches: List[MicroBatch], sensitivity: bool) -> List[dict]:
        results: List[dict] = []

        def loss_func_for(mb):
            def collect(logits):
                o = self._token_stats(logits.float() if logits.dtype == torch.float16 else logits, mb,
                                      entropy_grad=False, sensitivity=sensitivity)
                shape = mb.loss_mask.shape
                results.append({k: getattr(o, k).reshape(shape) for k in
                                (("logprobs", "entropy", "sum_p2", "sum_p2_logp") if sensitivity
                                 else ("logprobs", "entropy"))})
                return logits.new_zeros(()), {}
            return collect

        self._run(model, micro_batches, loss_func_for, forward_only=True)
        if not self.groups.is_last_stage:
            keys = ("logprobs", "entropy", "sum_p2", "sum_p2_logp") if sensitivity else ("logprobs", "entropy")
            results = [{k: torch.zeros(mb.loss_mask.shape, device=self.groups.device) for k in keys}
                       for mb in micro_batches]
        self._broadcast_from_last_stage([t for r in results for t in r.values()])
        return results

    def compute_logprobs(self, batches: List[List[MicroBatch]], sensitivity: bool = True) -> StepStats:
        """Forward-only pass: fills ``old_logp``, ``entropy`` (and sensitivity sums, ``ref_logp``)
        of every micro-batch on every rank; returns the global entropy and mismatch."""
        flat = [mb for mini in batches for mb in mini]
        self.model.eval()
        for mb, r in zip(flat, self._forward_pass(self.model, flat, sensitivity)):
            mb.old_logp, mb.entropy = r["logprobs"], r["entropy"]
            mb.sum_p2, mb.sum_p2_logp = r.get("sum_p2"), r.get("sum_p2_logp")
        if self.ref is not None:
            for mb, r in zip(flat, self._forward_pass(self.ref, flat, False)):
                mb.ref_logp = r["logprobs"]
        self.model.train()
        g = self.groups
        mask = cat_padded([mb.loss_mask for mb in flat], False)
        ent = global_token_mean(cat_padded([mb.entropy for mb in flat]), mask, dp_group=g.dp_cp_group)
        n = torch.tensor([float(mask.sum())], dtype=torch.float64, device=g.device)
        dist.all_reduce(n, group=g.dp_cp_group)
        stats = StepStats(entropy=ent, num_tokens=int(n.item()))
        if all(mb.engine_logp is not None for mb in flat):
            diff = torch.cat([(mb.engine_logp - mb.old_logp).abs()[mb.loss_mask] for mb in flat]).double()
            agg = torch.stack([diff.sum(), torch.tensor(float(diff.numel()), dtype=torch.float64, device=g.device)])
            dist.all_reduce(agg, group=g.dp_cp_group)
            mx = diff.max() if diff.numel() else torch.zeros((), dtype=torch.float64, device=g.device)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=g.dp_cp_group)
            stats.mismatch_mean = float(agg[0] / agg[1].clamp(min=1))
            stats.mismatch_max = float(mx)
        return stats

    # ------------------------------------------------------------------ update
    def _mini_batch_input(self, micro_batches: List[MicroBatch]) -> MiniBatchInput:
        return MiniBatchInput(
            old_logp=cat_padded([mb.old_logp for mb in micro_batches]),
            advantages=torch.cat([mb.advantages for mb in micro_batches]),
            mask=cat_padded([mb.loss_mask for mb in micro_batches], False),
            token_keys=cat_padded([mb.token_keys for mb in micro_batches]))

    def _optimizer_step(self, loss_value: float) -> tuple:
        """Megatron's step with a non-finite guard: skip (weights untouched) on NaN/inf."""
        from megatron.core.optimizer import clip_grads

        opt = self.optimizer
        opt.prepare_grads()
        gnorm = float(opt.get_grad_norm())
        if not (math.isfinite(gnorm) and math.isfinite(loss_value)):
            return False, gnorm
        clip = self.s.optimizer.clip_grad
        if clip > 0:
            for sub in getattr(opt, "chained_optimizers", [opt]):
                params = sub.get_parameters()
                if params:
                    clip_grads.clip_grad_by_total_norm_fp32(params, clip, gnorm)
        opt.step_with_ready_grads()
        self.scheduler.step(increment=1)
        return True, gnorm

    def update(self, batches: List[List[MicroBatch]], step: int, stare_state: Optional[StareState] = None,
               ppo_epochs: int = 1, collect_selection: bool = False) -> UpdateResult:
        """One optimizer step per mini-batch (per PPO epoch) with the registered policy loss."""
        g, lay = self.groups, self.groups.layout
        entropy_grad = self.s.algorithm.entropy_coeff > 0
        result = UpdateResult(loss=[], grad_norm=[])
        all_metrics = MetricSums()
        selected: List[torch.Tensor] = []
        for _ in range(ppo_epochs):
            for micro_batches in batches:
                plan = self.loss_fn.plan(self._mini_batch_input(micro_batches), dp_group=g.dp_cp_group,
                                         cp_group=g.cp_group if lay.cp > 1 else None,
                                         step=step, stare_state=stare_state)
                scale = backward_scale(grad_reduce_divisor=lay.dp, schedule_divisor=len(micro_batches))
                step_loss = torch.zeros((), dtype=torch.float64, device=g.device)
                metrics = MetricSums()

                def loss_func_for(mb):
                    def loss_func(logits):
                        nonlocal step_loss
                        o = self._token_stats(logits, mb, entropy_grad=entropy_grad, sensitivity=False)
                        shape = mb.loss_mask.shape
                        tis = None
                        # Under CP a sequence's tokens are spread over the CP ranks: the
                        # per-sequence counts of the seq-mean modes must be global.
                        seq_tokens = (sequence_token_counts(mb.loss_mask, g.cp_group)
                                      if lay.cp > 1 else None)
                        if self.s.tis_cap is not None and mb.engine_logp is not None:
                            tis = torch.exp(mb.old_logp - mb.engine_logp).clamp(max=self.s.tis_cap)
                        out = self.loss_fn(PolicyLossInput(
                            logp=o.logprobs.reshape(shape), old_logp=mb.old_logp, advantages=mb.advantages,
                            mask=mb.loss_mask, token_keys=mb.token_keys,
                            entropy=o.entropy.reshape(shape) if o.entropy is not None else None,
                            ref_logp=mb.ref_logp, tis_weight=tis, seq_num_tokens=seq_tokens), plan)
                        step_loss = step_loss + out.loss.detach().double()
                        metrics.merge(out.metrics)
                        if collect_selection and plan.stare is not None:
                            from megatron_stare.algorithms.stare import stare_weights
                            w = stare_weights(-mb.old_logp, mb.advantages, mb.loss_mask, mb.token_keys,
                                              self.s.algorithm.stare, stare_state, plan.stare)
                            selected.append(mb.token_keys[w.pos_selected | w.neg_selected])
                        # The schedule divides the returned loss in place: return a fresh tensor.
                        return out.loss * scale, {}
                    return loss_func

                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
                self._run(self.model, micro_batches, loss_func_for, forward_only=False)
                loss_t = step_loss.reshape(1).clone()
                dist.all_reduce(loss_t, group=g.dp_cp_group)
                self._broadcast_from_last_stage([loss_t])
                ok, gnorm = self._optimizer_step(float(loss_t))
                result.skipped_steps += 0 if ok else 1
                result.loss.append(float(loss_t))
                result.grad_norm.append(gnorm)
                all_metrics.merge(metrics)
        all_metrics.all_reduce(g.dp_cp_group, device=g.device)
        result.metrics = self._pp_share(all_metrics.means())
        result.metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        if collect_selection:
            result.selected_keys = self._gather_keys(selected)
        return result

    @torch.no_grad()
    def entropy_diagnostics(self, batches: List[List[MicroBatch]], stare_state: Optional[StareState] = None
                            ) -> Dict[str, float]:
        """Entropy-dynamics diagnostics of the step (algorithms.md): predicted entropy change
        ``pred_dH = mean_t(omega*A*S)`` with this step's STARE weights, the log-prob/advantage
        covariance and the four advantage-surprisal quadrant fractions; global over DP/CP,
        token-weighted over mini-batches. Needs the sensitivity sums of the log-prob pass."""
        from megatron_stare.algorithms.diagnostics import entropy_dynamics
        from megatron_stare.algorithms.stare import stare_weights

        g, algo = self.groups, self.s.algorithm
        totals: Dict[str, float] = {}
        n_all = 0.0
        for micro_batches in batches:
            mb = self._mini_batch_input(micro_batches)
            cat = lambda name: cat_padded([getattr(m, name) for m in micro_batches])  # noqa: E731
            omega = None
            if algo.policy_loss == "stare" and stare_state is not None and stare_state.gate_on:
                sel = None
                if algo.stare.selection_scope == "global":
                    from megatron_stare.algorithms.stare import stare_global_selection

                    sel = stare_global_selection(mb.old_logp, mb.advantages, mb.mask, mb.token_keys,
                                                 algo.stare, dp_group=g.dp_cp_group)
                omega = stare_weights(-mb.old_logp, mb.advantages, mb.mask, mb.token_keys, algo.stare,
                                      stare_state, sel).omega
            d = entropy_dynamics(mb.old_logp, mb.advantages, mb.mask, cat("entropy"), cat("sum_p2"),
                                 cat("sum_p2_logp"), omega, dp_group=g.dp_cp_group)
            for k in ("pred_dH", "cov", "frac_pos_high", "frac_pos_low", "frac_neg_high", "frac_neg_low"):
                totals[k] = totals.get(k, 0.0) + getattr(d, k) * d.num_tokens
            n_all += d.num_tokens
        return {f"dynamics/{k}": v / max(n_all, 1.0) for k, v in totals.items()}

    def _pp_share(self, metrics: Dict[str, float]) -> Dict[str, float]:
        """The last stage's metric values on every pipeline stage (same key order everywhere)."""
        if self.groups.layout.pp == 1:
            return metrics
        obj = [metrics if self.groups.is_last_stage else None]
        dist.broadcast_object_list(obj, src=self.groups.pp_last_rank, group=self.groups.pp_group)
        return obj[0]

    def _gather_keys(self, selected: List[torch.Tensor]) -> List[int]:
        local = torch.cat(selected).tolist() if selected else []
        obj = [None] * dist.get_world_size(self.groups.dp_cp_group)
        dist.all_gather_object(obj, local, group=self.groups.dp_cp_group)
        keys = sorted({k for part in obj for k in part})
        shared = [keys if self.groups.is_last_stage else None]
        if self.groups.layout.pp > 1:
            dist.broadcast_object_list(shared, src=self.groups.pp_last_rank, group=self.groups.pp_group)
        return shared[0]
