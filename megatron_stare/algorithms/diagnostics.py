"""Entropy-dynamics diagnostics: predicted entropy change, batch covariance, the four quadrants.

A logit-space policy-gradient step ``dz = eta*A*(e_a - pi)`` on a softmax changes the entropy by
``dH ~= eta*A*S(a)`` with

    S(a) = pi_a*(s_a - H) - sum_j pi_j^2 (s_j - H),       s_j = -log pi_j
         = pi_a*(s_a - H) + sum_j pi_j^2 log pi_j + H * sum_j pi_j^2

and ``E_{a~pi}[S(a)] = 0``. ``sum_j pi_j^2`` and ``sum_j pi_j^2 log pi_j`` are sums over the vocabulary,
reducible over tensor-parallel vocab shards like the entropy itself (the vocab-parallel kernel
provides them; ``sensitivity_stats`` is the single-shard reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.algorithms.aggregation import all_reduce_sum
from megatron_stare.algorithms.stare import broadcast_advantages


@torch.no_grad()
def sensitivity_stats(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(H, sum_j p_j^2, sum_j p_j^2 log p_j)``, each ``[...]``, from full-vocab logits ``[..., V]``."""
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    p = logp.exp()
    return -(p * logp).sum(-1), p.square().sum(-1), (p.square() * logp).sum(-1)


def entropy_sensitivity(logp: Tensor, entropy: Tensor, sum_p2: Tensor, sum_p2_logp: Tensor) -> Tensor:
    """``S(a)`` per token ``[...]`` for the sampled token's log-prob ``logp`` (all inputs detached)."""
    logp, entropy = logp.detach().to(torch.float64), entropy.detach().to(torch.float64)
    pi_a = logp.exp()
    return pi_a * (-logp - entropy) + sum_p2_logp.to(torch.float64) + entropy * sum_p2.to(torch.float64)


@dataclass
class EntropyDynamics:
    """Global (all ranks) per-step diagnostics."""

    pred_dH: float
    """``mean_t(omega * A * S)`` over valid tokens: predicted entropy change per unit step size."""
    cov: float
    """``E[logp*A] - E[logp]*E[A]`` over valid tokens (dH ~ -cov)."""
    frac_pos_high: float
    """Among valid tokens with A != 0: A > 0 and surprisal > H (raises entropy)."""
    frac_pos_low: float
    """A > 0 and surprisal <= H (lowers entropy)."""
    frac_neg_high: float
    """A < 0 and surprisal > H (lowers entropy)."""
    frac_neg_low: float
    """A < 0 and surprisal <= H (raises entropy)."""
    num_tokens: float


@torch.no_grad()
def entropy_dynamics(
    logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    entropy: Tensor,
    sum_p2: Tensor,
    sum_p2_logp: Tensor,
    omega: Optional[Tensor] = None,
    *,
    dp_group: Optional[dist.ProcessGroup] = None,
) -> EntropyDynamics:
    """From this rank's tokens ``[N, T]`` (old-log-prob pass); one all-reduce over ``dp_group``.

    ``omega``: the STARE weights of the same tokens (None = 1). Quadrants split by the sign of A
    and by ``s_a > H``, the sign of the leading term of S(a).
    """
    valid = mask.bool()
    m = valid.to(torch.float64)
    a = broadcast_advantages(advantages, mask).to(torch.float64)
    lp = logp.detach().to(torch.float64)
    h = entropy.detach().to(torch.float64)
    w = torch.ones_like(a) if omega is None else omega.detach().to(torch.float64)
    s = entropy_sensitivity(lp, h, sum_p2, sum_p2_logp)
    # Masked positions may hold garbage (NaN): select, do not multiply.
    z = torch.zeros_like(a)

    def msum(x: Tensor) -> Tensor:
        return torch.where(valid, x, z).sum()

    high = -lp > h
    pos, neg = valid & (a > 0), valid & (a < 0)
    sums = torch.stack([
        m.sum(), msum(w * a * s), msum(lp * a), msum(lp), msum(a),
        (pos & high).sum(dtype=torch.float64), (pos & ~high).sum(dtype=torch.float64),
        (neg & high).sum(dtype=torch.float64), (neg & ~high).sum(dtype=torch.float64),
    ])
    n, wAS, lpA, slp, sa, ph, pl, nh, nl = all_reduce_sum(sums, dp_group).tolist()
    d = max(n, 1.0)
    nz = max(ph + pl + nh + nl, 1.0)
    return EntropyDynamics(
        pred_dH=wAS / d,
        cov=lpA / d - (slp / d) * (sa / d),
        frac_pos_high=ph / nz,
        frac_pos_low=pl / nz,
        frac_neg_high=nh / nz,
        frac_neg_low=nl / nz,
        num_tokens=n,
    )
