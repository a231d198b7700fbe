"""Trajectory advantages (GRPO, Dr.GRPO, RLOO) and DAPO's reward shaping / group filtering.

All functions take the whole training batch: ``rewards`` ``[N]`` (one scalar per response) and
``group_ids`` ``[N]`` int64 (responses of the same prompt share an id; any labels). They return
``[N]`` advantages in the rewards' floating dtype, computed in float64; the loss broadcasts them
over the response tokens. Run them where the whole batch is (the driver), not per rank.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
from torch import Tensor

from megatron_stare.config.algorithm import AlgorithmConfig
from megatron_stare.config.dotted import registrar

GRPO_EPS = 1e-6

AdvantageFn = Callable[[Tensor, Tensor, AlgorithmConfig], Tensor]
ADVANTAGE_ESTIMATORS: Dict[str, AdvantageFn] = {}


register_advantage = registrar(ADVANTAGE_ESTIMATORS, "advantage estimator")


def compute_advantages(rewards: Tensor, group_ids: Tensor, cfg: AlgorithmConfig) -> Tensor:
    """``[N]`` advantages from the registered estimator ``cfg.adv_estimator``."""
    if cfg.adv_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)}, got {cfg.adv_estimator!r}"
        )
    return ADVANTAGE_ESTIMATORS[cfg.adv_estimator](rewards, group_ids, cfg)


def _out_dtype(rewards: Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-response ``(group size, group mean, group unbiased std)``, each ``[N]`` float64.

    Singleton groups get mean 0 and std 1 (so GRPO passes their reward through).
    """
    r = rewards.to(torch.float64)
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    size = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros_like(size).index_add_(0, inv, r)
    mean = total / size
    sq = torch.zeros_like(size).index_add_(0, inv, (r - mean[inv]).square())
    std = (sq / (size - 1).clamp(min=1)).sqrt()
    single = size == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return size[inv], mean[inv], std[inv]


@register_advantage("grpo")
def grpo_advantage(rewards: Tensor, group_ids: Tensor, cfg: AlgorithmConfig) -> Tensor:
    """``(r - mean_g) / (std_g + 1e-6)`` (unbiased std), or ``r - mean_g`` if not norm_adv_by_std."""
    _, mean, std = group_stats(rewards, group_ids)
    adv = rewards.to(torch.float64) - mean
    if cfg.norm_adv_by_std:
        adv = adv / (std + GRPO_EPS)
    return adv.to(_out_dtype(rewards))


@register_advantage("dr_grpo")
def dr_grpo_advantage(rewards: Tensor, group_ids: Tensor, cfg: AlgorithmConfig) -> Tensor:
    """Dr.GRPO: ``r - mean_g`` (no std), meant for ``seq-mean-token-sum-norm`` aggregation."""
    _, mean, _ = group_stats(rewards, group_ids)
    return (rewards.to(torch.float64) - mean).to(_out_dtype(rewards))


@register_advantage("rloo")
def rloo_advantage(rewards: Tensor, group_ids: Tensor, cfg: AlgorithmConfig) -> Tensor:
    """RLOO: ``r_i - mean_{j != i} r_j``; a singleton group has baseline 0 (``A = r``)."""
    size, mean, _ = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    loo = torch.where(size == 1, torch.zeros_like(r), (mean * size - r) / (size - 1).clamp(min=1))
    return (r - loo).to(_out_dtype(rewards))


# ------------------------------------------------------------------------------------------------
# DAPO extras
def overlong_penalty(lengths: Tensor, *, max_len: int = 20480, buffer_len: int = 4096, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong shaping, ``[N]`` float: ``min(-(|y| - (L_max - L_buf)) / L_buf * factor, 0)``.

    Added to the reward before advantages. ``lengths`` ``[N]``: response lengths in tokens.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    excess = lengths.to(torch.float64) - (max_len - buffer_len)
    return torch.clamp(-excess / buffer_len * factor, max=0.0).to(torch.float32)


def nonzero_variance_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """DAPO dynamic sampling: ``[N]`` bool, False for responses of groups whose rewards are all equal.

    Singleton groups are kept (they carry no variance information to drop on).
    """
    size, mean, _ = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    _, inv = torch.unique(group_ids, return_inverse=True)
    spread = torch.zeros(int(inv.max()) + 1 if inv.numel() else 0, dtype=torch.float64, device=r.device)
    spread = spread.index_add_(0, inv, (r - mean).abs())[inv]
    return (spread > 0) | (size == 1)


def first_groups(group_ids: Tensor, keep: Tensor, num_groups: int) -> Tensor:
    """``[N]`` bool: ``keep`` restricted to the first ``num_groups`` kept groups (order of first
    appearance). Used to truncate the accumulated dynamic-sampling buffer to the train batch."""
    out = torch.zeros_like(keep)
    seen: Dict[int, int] = {}
    for i, (g, k) in enumerate(zip(group_ids.tolist(), keep.tolist())):
        if not k:
            continue
        if g not in seen:
            if len(seen) == num_groups:
                continue
            seen[g] = len(seen)
        out[i] = True
    return out
