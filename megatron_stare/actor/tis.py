"""Off-policy correction from the engine's (behaviour) log-probs: truncated importance sampling
and the ratio band mask.

Both read the token ratio ``r = exp(old_logp - engine_logp)`` ``[B, L]``: the trainer's
log-prob of a sampled token over the behaviour policy's. TIS weights each token's loss by
``min(r, cap)``; the band mask (asynchronous training, ``rollout/async_loop.py``) leaves out of
the loss the tokens whose ``r`` lies outside ``[low, high]`` (default ``[0.5, 2]``): a stale
sample whose policy has moved too far teaches nothing reliable. The two compose by product.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from megatron_stare.types import MicroBatch


def ratio_band_mask(old_logp: Tensor, engine_logp: Tensor, band: Tuple[float, float]) -> Tensor:
    """``[B, L]`` bool: True where ``low <= exp(old_logp - engine_logp) <= high`` (kept tokens).
    Compared in log space, so no ratio overflows; padding's values do not matter (the loss
    masks them)."""
    low, high = band
    log_r = old_logp - engine_logp
    keep = log_r >= torch.log(torch.tensor(float(low), dtype=log_r.dtype))
    if high != float("inf"):
        keep &= log_r <= torch.log(torch.tensor(float(high), dtype=log_r.dtype))
    return keep


def tis_weight(mb: MicroBatch, cap: Optional[float],
               band: Optional[Tuple[float, float]] = None) -> Optional[Tensor]:
    """The token weight ``[B, L]`` (no grad): ``min(exp(old_logp - engine_logp), cap)`` with TIS
    on (``cap``), times the band mask with ``band`` set; None when neither applies or the engine
    sent no log-probs. Padding holds finite values the loss masks."""
    if mb.engine_logp is None or (cap is None and band is None):
        return None
    w = None if cap is None else torch.exp(mb.old_logp - mb.engine_logp).clamp(max=cap)
    if band is None:
        return w
    keep = ratio_band_mask(mb.old_logp, mb.engine_logp, band).to(mb.old_logp.dtype)
    return keep if w is None else w * keep
