"""GEPO: group-entropy-controlled advantage shaping (a reconstruction; no public code exists).

    H_g    = token-mean entropy over all responses of prompt g (old-log-prob pass)
    tau_lo = mu - kappa*sigma,  tau_hi = mu + kappa*sigma
    A'_i   = A_i * (1 - lam_pos*[A_i > 0 and H_g < tau_lo]) * (1 - lam_neg*[A_i < 0 and H_g > tau_hi])

Reconstruction choices (documented because the source gives only the formula above):
- History is causal: step k is shaped with (mu, sigma) built from steps < k only; ``observe`` adds
  step k afterwards. ``__call__`` does both in that order.
- mu and sigma are EMAs of the first two moments of the step's group entropies:
  ``m1 <- (1-r) m1 + r mean_g(H_g)``, ``m2 <- (1-r) m2 + r mean_g(H_g^2)``, ``sigma = sqrt(max(m2 - m1^2, 0))``,
  so sigma holds both the spread across groups and the drift across steps. The first observation
  initialises ``m1, m2`` directly (no bias towards 0).
- Warm-up: no shaping until ``warmup_steps`` steps have been observed (thresholds are -inf/+inf).
- Groups without valid tokens have ``H_g = NaN``: never shaped and left out of the history; a step
  with no finite ``H_g`` leaves the history unchanged.
- ``kappa = inf`` means infinite thresholds (no shaping) even when sigma = 0.
Invariants (tested): lam = 0 or infinite thresholds give the input exactly; signs kept; |A'| <= |A|.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.algorithms.aggregation import all_reduce_sum
from megatron_stare.config.algorithm import GepoConfig
from megatron_stare.types import cat_padded


def group_token_mean(
    values: Tensor,
    mask: Tensor,
    group_index: Tensor,
    num_groups: int,
    *,
    dp_group: Optional[dist.ProcessGroup] = None,
) -> Tensor:
    """``[G]`` float64 token-mean of ``values`` ``[N, T]`` over each group's valid tokens.

    ``group_index`` ``[N]`` int64 in ``[0, num_groups)``, a global index when rows are spread over
    ranks; sums and counts are all-reduced over ``dp_group`` (one collective). NaN for empty groups.
    """
    m = mask.to(torch.float64)
    sums = torch.zeros(2, num_groups, dtype=torch.float64, device=values.device)
    sums[0].index_add_(0, group_index, (values.detach().to(torch.float64) * m).sum(-1))
    sums[1].index_add_(0, group_index, m.sum(-1))
    all_reduce_sum(sums, dp_group)
    return sums[0] / sums[1]


@dataclass
class GepoState:
    """EMA history; saved with checkpoints."""

    mean: float = 0.0
    sq_mean: float = 0.0
    num_updates: int = 0


@dataclass
class GepoOutput:
    advantages: Tensor
    """``[N]`` shaped advantages."""
    tau_lo: float
    tau_hi: float
    frac_pos_shrunk: float
    """Fraction of responses whose positive advantage was shrunk."""
    frac_neg_shrunk: float


class GepoShaper:
    """Causal group-entropy advantage shaping; one call per training step."""

    def __init__(self, cfg: GepoConfig):
        cfg.validate()
        self.cfg = cfg
        self.state = GepoState()

    def thresholds(self) -> tuple[float, float]:
        """``(tau_lo, tau_hi)`` from the history so far; infinite during warm-up."""
        if self.state.num_updates < self.cfg.warmup_steps or math.isinf(self.cfg.kappa):
            return -math.inf, math.inf
        sigma = math.sqrt(max(self.state.sq_mean - self.state.mean**2, 0.0))
        return self.state.mean - self.cfg.kappa * sigma, self.state.mean + self.cfg.kappa * sigma

    def shape(self, advantages: Tensor, group_entropy: Tensor, group_index: Tensor) -> GepoOutput:
        """Shape ``advantages`` ``[N]`` with the history of past steps (does not update it).

        ``group_entropy`` ``[G]`` (``group_token_mean`` of the entropy); ``group_index`` ``[N]``.
        """
        tau_lo, tau_hi = self.thresholds()
        h = group_entropy.to(torch.float64)[group_index]
        pos = (advantages > 0) & (h < tau_lo)
        neg = (advantages < 0) & (h > tau_hi)
        one = torch.ones((), dtype=advantages.dtype, device=advantages.device)
        factor = torch.where(pos, one - self.cfg.lam_pos, one) * torch.where(neg, one - self.cfg.lam_neg, one)
        n = max(advantages.numel(), 1)
        return GepoOutput(
            advantages=advantages * factor,
            tau_lo=tau_lo,
            tau_hi=tau_hi,
            frac_pos_shrunk=float(pos.sum()) / n,
            frac_neg_shrunk=float(neg.sum()) / n,
        )

    def observe(self, group_entropy: Tensor) -> None:
        """Add this step's finite group entropies ``[G]`` to the EMA history."""
        h = group_entropy.detach().to(torch.float64)
        h = h[torch.isfinite(h)]
        if h.numel() == 0:
            return
        m1, m2 = float(h.mean()), float(h.square().mean())
        s, r = self.state, self.cfg.ema_rate
        if s.num_updates == 0:
            s.mean, s.sq_mean = m1, m2
        else:
            s.mean = (1 - r) * s.mean + r * m1
            s.sq_mean = (1 - r) * s.sq_mean + r * m2
        s.num_updates += 1

    def __call__(self, advantages: Tensor, group_entropy: Tensor, group_index: Tensor) -> GepoOutput:
        out = self.shape(advantages, group_entropy, group_index)
        self.observe(group_entropy)
        return out

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = GepoState(**state)


def shape_batches(shaper: GepoShaper, batches, num_groups: int, dp_group: Optional[dist.ProcessGroup]) -> None:
    """GEPO on the trainer's prepared batches (mini-batches of micro-batches, after the log-prob
    pass filled ``entropy``): each micro-batch's ``advantages`` ``[B]`` replaced in place by the
    shaped ones. The group means of token entropy are reduced over ``dp_group`` (collective)."""
    flat = [mb for mini in batches for mb in mini]
    gid = torch.cat([mb.group_ids for mb in flat])
    ent = group_token_mean(cat_padded([mb.entropy for mb in flat]),
                           cat_padded([mb.loss_mask for mb in flat], False), gid, num_groups, dp_group=dp_group)
    adv = shaper(torch.cat([mb.advantages for mb in flat]).double(), ent, gid).advantages.float()
    offset = 0
    for mb in flat:
        mb.advantages = adv[offset: offset + mb.advantages.numel()]
        offset += mb.advantages.numel()
