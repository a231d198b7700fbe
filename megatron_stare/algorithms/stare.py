"""STARE token weights, their exact global selection, and the closed-loop controller.

    T+ = valid & (A > 0);  T- = valid & (A < 0)            (A == 0 in neither)
    k(n) = min(n, max(1, ceil(n*P)));  n = 0 or P = 0 -> 0
    L+ = the k(|T+|) highest-surprisal tokens of T+;  L- likewise of T- (C2 only)
    omega = 1;  gate_on: omega[L+] = W, and for C2 omega[L-] = M

Selection scopes:
- ``global`` (default): the thresholds are computed ONCE per optimizer mini-batch, before any
  backward, from the old-log-prob pass surprisal ``-old_logp`` with the exact distributed top-k of
  ``megatron_stare.ops.selection`` over all data(×context)-parallel ranks, and applied to every
  micro-batch. The selected set is the same for any micro-batch size or parallel layout.
- ``microbatch``: top-k inside each micro-batch on this rank, k from the micro-batch's own counts,
  surprisal ``-logp.detach()`` of the current forward (the public reference's choice).
Ties (both scopes): a token is selected iff ``s > thr`` or ``s == thr and key <= thr_key``, i.e.
among equal surprisals the smaller global token key wins, so exactly k tokens are selected.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.config.algorithm import StareConfig
from megatron_stare.ops.selection import TopKThreshold, local_topk_among, selected_among, topk_thresholds


def stare_k(n: int, p: float) -> int:
    """``k(n) = min(n, max(1, ceil(n*P)))``, 0 when n = 0 or P = 0.

    ``P`` is read as the decimal it prints as (``Fraction(repr(p))``), so ``k(30, 0.1) = 3`` rather
    than float ``ceil(3.0000000000000004) = 4``.
    """
    n = int(n)
    if n <= 0 or p <= 0:
        return 0
    return min(n, max(1, math.ceil(n * Fraction(repr(float(p))))))


def broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """``[B]`` or ``[B, T]`` advantages as ``[B, T]`` (a view, no copy)."""
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == like.dim() - 1 else advantages


# ------------------------------------------------------------------------------------------------
@dataclass
class StareState:
    """What the loss needs from the controller for one step; saved with checkpoints."""

    gate_on: bool = False
    w: float = 1.1
    m: float = 0.9
    entropy: float = float("nan")
    """The last finite global entropy the controller saw (for logging)."""


class StareController:
    """Closed-loop gate and (optional) adaptive W/M; ``update`` once per step before its update.

    ``gate_on = H < H_tgt`` (strict). Adaptive: ``sigma = sign(H_tgt - H)``,
    ``W = clip(W + alpha*sigma, 1, w_max)``, ``M = clip(M - alpha*sigma, m_min, 1)``; the new W/M
    are used by the same step. A non-finite H leaves the whole state unchanged.
    """

    def __init__(self, cfg: StareConfig):
        cfg.validate()
        self.cfg = cfg
        self.state = StareState(gate_on=False, w=cfg.w, m=cfg.m)

    def update(self, global_entropy: float) -> StareState:
        """``global_entropy``: token-mean entropy of the whole training batch (all ranks)."""
        h = float(global_entropy)
        if not math.isfinite(h):
            return self.state
        c, s = self.cfg, self.state
        s.gate_on = h < c.target_entropy
        if c.adaptive:
            sigma = (c.target_entropy > h) - (c.target_entropy < h)
            s.w = min(max(s.w + c.alpha * sigma, 1.0), c.w_max)
            s.m = min(max(s.m - c.alpha * sigma, c.m_min), 1.0)
        s.entropy = h
        return s

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = StareState(**state)


# ------------------------------------------------------------------------------------------------
@dataclass
class StareSelection:
    """Global-scope thresholds of one mini-batch (identical on every rank)."""

    pos: Optional[TopKThreshold]
    """Threshold of L+ in T+; None when nothing is selected."""
    neg: Optional[TopKThreshold]
    """Threshold of L- in T- (C2 only); None when nothing is selected."""
    k_pos: int = 0
    k_neg: int = 0


@dataclass
class StareWeights:
    """Per-micro-batch result of the weighting, all ``[B, T]``."""

    omega: Tensor
    """Token weights (no grad), 1 outside L+ and L-."""
    pos_candidates: Tensor = field(repr=False)
    neg_candidates: Tensor = field(repr=False)
    pos_selected: Tensor = field(repr=False)
    neg_selected: Tensor = field(repr=False)


def candidate_sets(advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(T+, T-)`` bool ``[B, T]``; A == 0 is in neither."""
    a = broadcast_advantages(advantages, mask)
    valid = mask.bool()
    return valid & (a > 0), valid & (a < 0)


@torch.no_grad()
def stare_global_selection(
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    token_keys: Tensor,
    cfg: StareConfig,
    *,
    dp_group: Optional[dist.ProcessGroup] = None,
) -> StareSelection:
    """Exact global thresholds from this rank's WHOLE mini-batch ``[N, T]`` (old-log-prob pass).

    Collective over ``dp_group`` (data×context-parallel): every rank must call it, in the same
    order, with its own rows; ``token_keys`` are global, layout-independent keys.
    """
    s = -old_logp.detach()
    t_pos, t_neg = candidate_sets(advantages, mask)
    sets = (t_pos, t_neg) if cfg.variant == "C2" else (t_pos,)
    # k from each set's global size; C2's two thresholds share every collective.
    k_of = lambda n: stare_k(n, cfg.top_p)  # noqa: E731
    thr = topk_thresholds([(s[c], token_keys[c], k_of) for c in sets], group=dp_group)
    pos = thr[0] if thr[0].k else None
    neg = thr[1] if len(thr) > 1 and thr[1].k else None
    return StareSelection(pos=pos, neg=neg, k_pos=thr[0].k, k_neg=thr[1].k if len(thr) > 1 else 0)


@torch.no_grad()
def stare_weights(
    surprisal: Tensor,
    advantages: Tensor,
    mask: Tensor,
    token_keys: Tensor,
    cfg: StareConfig,
    state: StareState,
    selection: Optional[StareSelection] = None,
) -> StareWeights:
    """Token weights ``omega`` ``[B, T]`` of one micro-batch.

    ``surprisal`` ``[B, T]``: ``-old_logp`` in global scope (the values the thresholds were built
    from), ``-logp.detach()`` in microbatch scope. ``selection``: required in global scope, ignored
    in microbatch scope. Gate off: omega is all ones and nothing is selected.
    """
    s = surprisal.detach()
    t_pos, t_neg = candidate_sets(advantages, mask)
    none = torch.zeros_like(t_pos)
    sel_pos, sel_neg = none, none
    if state.gate_on:
        if cfg.selection_scope == "global":
            if selection is None:
                raise ValueError("algorithm.stare.selection_scope 'global' needs the mini-batch StareSelection")
            sel_pos = selected_among(selection.pos, s, token_keys, t_pos)
            if cfg.variant == "C2":
                sel_neg = selected_among(selection.neg, s, token_keys, t_neg)
        else:
            sel_pos = local_topk_among(s, token_keys, t_pos, stare_k(int(t_pos.sum()), cfg.top_p))
            if cfg.variant == "C2":
                sel_neg = local_topk_among(s, token_keys, t_neg, stare_k(int(t_neg.sum()), cfg.top_p))
    omega = torch.ones_like(s)
    omega = torch.where(sel_pos, torch.full_like(s, state.w), omega)
    omega = torch.where(sel_neg, torch.full_like(s, state.m), omega)
    return StareWeights(omega=omega, pos_candidates=t_pos, neg_candidates=t_neg, pos_selected=sel_pos, neg_selected=sel_neg)
