"""Megatron's optimizer and LR schedule for the actor, and one optimizer step with a guard.

``guarded_step`` is Megatron's ``step()`` taken apart (prepare grads, grad norm, clip, step) so
that a non-finite loss or gradient norm skips the step with the weights and the optimizer state
untouched, instead of writing NaN into them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from megatron.core.optimizer import OptimizerConfig as MOptConfig, clip_grads, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from megatron_stare.config.load import OptimizerConfig
from megatron_stare.runtime.parallel import ParallelLayout


def build_optimizer(model, o: OptimizerConfig, layout: ParallelLayout, dtype: torch.dtype,
                    total_steps: int):
    """(Megatron Adam over the DDP-wrapped ``model``, its ``OptimizerParamScheduler``).

    bf16 params get fp32 main params and fp32 gradient accumulation (Megatron's mixed precision).
    """

    opt = get_megatron_optimizer(
        MOptConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                   adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                   clip_grad=o.clip_grad, bf16=dtype == torch.bfloat16,
                   params_dtype=dtype, use_distributed_optimizer=layout.distributed_optimizer),
        [model],
    )
    if o.fused_adam:
        use_fused_adam(opt)
    steps = max(total_steps, o.warmup_steps + 1)
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps, lr_decay_steps=steps, lr_decay_style=o.lr_schedule,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=steps,
        wd_incr_style="constant")
    return opt, sched


def torch_adams(optimizer):
    """The torch ``Adam``/``AdamW`` instances megatron-core's (chained) optimizer steps with."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if isinstance(inner, torch.optim.Adam):
            yield inner


def use_fused_adam(optimizer) -> int:
    """Switch megatron-core's torch-Adam fallback to torch's fused kernel; returns how many
    optimizers were switched.

    Without transformer-engine or Apex megatron-core builds ``torch.optim.AdamW`` with torch's
    defaults, which on CPU tensors is the single-tensor Python loop (5.9x slower than fused over
    SmolLM2's parameters alone; ~0.5 s of a ~100 s step in the run, docs/performance.md). The fused kernel computes the same update (up to float
    rounding: it is the same formula in one pass). Optimizers over a device the kernel does not
    support, or non-float parameters, keep their loop. The flags live in the param groups, which
    a checkpoint load overwrites: ``models/dist_ckpt.load_optimizer`` keeps the running choice.
    """

    supported, switched = set(_get_fused_kernels_supported_devices()), 0
    for inner in torch_adams(optimizer):
        params = [p for g in inner.param_groups for p in g["params"]]
        if params and all(p.device.type in supported and p.is_floating_point() for p in params):
            for g in inner.param_groups:
                g["fused"], g["foreach"] = True, False
            switched += 1
    return switched


@dataclass
class StepOutcome:
    applied: bool
    """False when the step was skipped (non-finite loss or gradient norm)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    seconds: float = 0.0
    """Wall time of the whole step (gradient preparation, norm, clip, Adam), this rank."""


def guarded_step(optimizer, scheduler, clip_grad: float, loss_value: float) -> StepOutcome:
    """Megatron's step with a non-finite guard: skip (weights untouched) on NaN/inf."""

    t0 = time.perf_counter()
    optimizer.prepare_grads()
    gnorm = float(optimizer.get_grad_norm())
    if not (math.isfinite(gnorm) and math.isfinite(loss_value)):
        return StepOutcome(applied=False, grad_norm=gnorm, seconds=time.perf_counter() - t0)
    if clip_grad > 0:
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = sub.get_parameters()
            if params:
                clip_grads.clip_grad_by_total_norm_fp32(params, clip_grad, gnorm)
    optimizer.step_with_ready_grads()
    scheduler.step(increment=1)
    return StepOutcome(applied=True, grad_norm=gnorm, seconds=time.perf_counter() - t0)
