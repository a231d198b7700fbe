"""Truncated importance sampling: correct the gap between the rollout engine and the trainer."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_stare.types import MicroBatch


def tis_weight(mb: MicroBatch, cap: Optional[float]) -> Optional[Tensor]:
    """``min(exp(old_logp - engine_logp), cap)`` ``[B, L]`` (no grad), or None when TIS is off
    (``cap`` None) or the engine sent no log-probs. Padding holds finite values the loss masks."""
    if cap is None or mb.engine_logp is None:
        return None
    return torch.exp(mb.old_logp - mb.engine_logp).clamp(max=cap)
