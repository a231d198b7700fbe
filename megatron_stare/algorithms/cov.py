"""Token covariance and the token selections of Clip-Cov and KL-Cov (Cui et al.).

    cov_t = (A_t - mean(A)) * (logp_t - mean(logp))      means over valid tokens, logp detached
    Clip-Cov: among candidates lb < cov_t < ub pick max(1, floor(r*N)) at random; their loss -> 0
    KL-Cov:   the k = max(1, floor(N*ratio)) largest cov_t get an extra beta*|log rho|

Scopes:
- ``global`` (default): means, N, k and the selection span the whole optimizer mini-batch on all
  data(×context)-parallel ranks, computed once before the backward passes from the old-log-prob
  pass (``logp = old_logp``). The means are exact sums of fixed-point values (resolution 2^-24)
  so they are bitwise identical for every layout, hence so are cov_t and the selected set.
  Clip-Cov's "not already PPO-clipped" filter needs the update-time ratio, unknown before the
  backward passes; here the candidates are taken at the old-log-prob pass (rho = 1, nothing
  clipped). A selected token that is clipped at update time already has zero gradient, so zeroing
  it changes only the loss value.
- ``microbatch``: the reference: everything inside one micro-batch on one rank, ``logp`` the
  current log-prob detached, clipped tokens excluded from Clip-Cov's candidates.
Random pick (both scopes): each token gets ``u = hash(seed, step, global key)`` in [0, 1); the k
candidates with the largest u are chosen with the exact top-k (ties: smaller key). Unlike a per-rank
``randperm`` this is reproducible and, in global scope, independent of the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import torch
from torch import Tensor

from megatron_stare.algorithms.aggregation import all_reduce_sum
from megatron_stare.algorithms.stare import broadcast_advantages
from megatron_stare.ops.selection import KSpec, TopKThreshold, local_topk_among, selected_among, topk_threshold

_M32 = 0xFFFFFFFF
_FIXED_SCALE = float(2**24)


def _mix32(x):
    """A 32-bit integer finaliser; products stay below 2^59 so int64 tensors never overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def token_uniform(token_keys: Tensor, seed: int, step: int) -> Tensor:
    """Deterministic pseudo-random ``[...]`` float64 in [0, 1) per (seed, step, key); keys >= 0."""
    salt = _mix32(_mix32(seed & _M32) ^ (step & _M32))
    h = _mix32((token_keys & _M32) ^ salt)
    h = _mix32(h ^ ((token_keys >> 32) & _M32))
    return h.to(torch.float64) / 2.0**32


def floor_frac(n: float, ratio: float) -> int:
    """``floor(n * ratio)`` with ratio read as the decimal it prints as (``floor(100*0.29) = 29``)."""
    return math.floor(int(n) * Fraction(repr(float(ratio))))


@dataclass(frozen=True)
class CovMeans:
    adv_mean: float
    logp_mean: float
    num_valid: float


def exact_masked_means(logp: Tensor, advantages: Tensor, mask: Tensor, *, dp_group=None) -> CovMeans:
    """Means of A and logp over the valid tokens of all ranks, bitwise layout-independent.

    Each value is rounded to a multiple of 2^-24 and summed as int64 (exact, associative), so the
    result does not depend on how tokens are split over micro-batches or ranks. No overflow while
    sum |x| < 5e11 (e.g. 10^9 tokens of |logp| <= 500).
    """
    valid = mask.bool()
    a = broadcast_advantages(advantages, mask)

    def fixed(x: Tensor) -> Tensor:
        return torch.round(x.detach().to(torch.float64)[valid] * _FIXED_SCALE).to(torch.int64).sum()

    sums = torch.stack([fixed(a), fixed(logp), valid.sum(dtype=torch.int64)])
    sums = all_reduce_sum(sums, dp_group)
    a_sum, l_sum, n = (int(v) for v in sums.tolist())
    d = max(n, 1) * _FIXED_SCALE
    return CovMeans(adv_mean=a_sum / d, logp_mean=l_sum / d, num_valid=float(n))


def local_masked_means(logp: Tensor, advantages: Tensor, mask: Tensor) -> CovMeans:
    """Float means inside one micro-batch (the reference's microbatch scope)."""
    m = mask.to(torch.float64)
    n = float(m.sum())
    a = broadcast_advantages(advantages, mask).to(torch.float64)
    d = max(n, 1.0)
    return CovMeans(float((a * m).sum()) / d, float((logp.detach().to(torch.float64) * m).sum()) / d, n)


def token_cov(logp: Tensor, advantages: Tensor, mask: Tensor, means: CovMeans) -> Tensor:
    """``[B, T]`` float64 ``(A - mean A) * (logp - mean logp)``; -inf at invalid tokens."""
    a = broadcast_advantages(advantages, mask).to(torch.float64)
    cov = (a - means.adv_mean) * (logp.detach().to(torch.float64) - means.logp_mean)
    return cov.masked_fill(~mask.bool(), -math.inf)


@dataclass
class CovSelection:
    """Global-scope plan of one mini-batch (identical on every rank)."""

    means: CovMeans
    threshold: Optional[TopKThreshold]
    """Threshold on the ranking values (Clip-Cov: the hash u; KL-Cov: cov); None selects nothing."""
    k: int


def _threshold(values: Tensor, keys: Tensor, cand: Tensor, k: KSpec, group) -> Optional[TopKThreshold]:
    """``k``: an int, or a function of the global candidate count (no separate count all-reduce)."""
    if isinstance(k, int) and k == 0:
        return None
    thr = topk_threshold(values[cand], keys[cand], k, group=group)
    return thr if thr.k else None


# ---------------------------------------------------------------------------- Clip-Cov
def clip_cov_candidates(cov: Tensor, lb: float, ub: float) -> Tensor:
    return (cov > lb) & (cov < ub)


@torch.no_grad()
def clip_cov_global_selection(old_logp, advantages, mask, token_keys, *, lb, ub, ratio, seed, step, dp_group=None) -> CovSelection:
    """Clip-Cov plan from this rank's WHOLE mini-batch ``[N, T]``; collective over ``dp_group``."""
    means = exact_masked_means(old_logp, advantages, mask, dp_group=dp_group)
    cand = clip_cov_candidates(token_cov(old_logp, advantages, mask, means), lb, ub)
    k_of = lambda n_cand: min(max(1, floor_frac(means.num_valid, ratio)), n_cand)  # noqa: E731
    u = token_uniform(token_keys, seed, step)
    thr = _threshold(u, token_keys, cand, k_of, dp_group)
    return CovSelection(means=means, threshold=thr, k=thr.k if thr else 0)


@torch.no_grad()
def clip_cov_mask(logp, old_logp, advantages, mask, token_keys, *, lb, ub, ratio, seed, step,
                  clipped: Tensor, selection: Optional[CovSelection]) -> Tensor:
    """``[B, T]`` bool: the tokens whose loss Clip-Cov zeroes in this micro-batch.

    Global scope (``selection`` given): candidates from ``old_logp`` and the plan's means.
    Microbatch scope (``selection`` None): candidates from ``logp`` detached and local means,
    excluding ``clipped`` tokens, k from the micro-batch's valid count.
    """
    u = token_uniform(token_keys, seed, step)
    if selection is not None:
        cand = clip_cov_candidates(token_cov(old_logp, advantages, mask, selection.means), lb, ub)
        return selected_among(selection.threshold, u, token_keys, cand)
    means = local_masked_means(logp, advantages, mask)
    cand = clip_cov_candidates(token_cov(logp, advantages, mask, means), lb, ub) & ~clipped
    k = min(max(1, floor_frac(means.num_valid, ratio)), int(cand.sum()))
    return local_topk_among(u, token_keys, cand, k)


# ---------------------------------------------------------------------------- KL-Cov
def kl_cov_k(num_valid: float, ratio: float) -> int:
    """``min(N, max(1, floor(N*ratio)))``; 0 for an empty batch."""
    return min(int(num_valid), max(1, floor_frac(num_valid, ratio))) if num_valid > 0 else 0


@torch.no_grad()
def kl_cov_global_selection(old_logp, advantages, mask, token_keys, *, ratio, dp_group=None) -> CovSelection:
    """KL-Cov plan from this rank's WHOLE mini-batch ``[N, T]``; collective over ``dp_group``."""
    means = exact_masked_means(old_logp, advantages, mask, dp_group=dp_group)
    cov = token_cov(old_logp, advantages, mask, means)
    k = kl_cov_k(means.num_valid, ratio)
    return CovSelection(means=means, threshold=_threshold(cov, token_keys, mask.bool(), k, dp_group), k=k)


@torch.no_grad()
def kl_cov_mask(logp, old_logp, advantages, mask, token_keys, *, ratio, selection: Optional[CovSelection]) -> Tensor:
    """``[B, T]`` bool: the tokens KL-Cov penalises in this micro-batch (scopes as Clip-Cov)."""
    valid = mask.bool()
    if selection is not None:
        cov = token_cov(old_logp, advantages, mask, selection.means)
        return selected_among(selection.threshold, cov, token_keys, valid)
    means = local_masked_means(logp, advantages, mask)
    return local_topk_among(token_cov(logp, advantages, mask, means), token_keys, valid, kl_cov_k(means.num_valid, ratio))
