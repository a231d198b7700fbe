"""KL-to-reference estimators (per token); the loss adds kl_loss_coef * agg(kl) (losses.py).

Estimators of KL(pi || pi_ref) from the sampled token, ``logp``/``ref_logp`` ``[B, T]``:
  k1 ``logp - ref_logp``; k2 ``0.5*(logp - ref_logp)^2``; k3 (low_var_kl)
  ``x = clamp(ref_logp - logp, -20, 20); e^x - x - 1`` clamped to [-10, 10]; abs ``|logp - ref_logp|``.
A ``+`` suffix (e.g. ``k3+``) is straight-through: the forward value of that estimator with the
gradient of k2 (an unbiased gradient of the KL, where k1's and k3's are not).
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
from megatron_stare.config.dotted import registrar
from torch import Tensor

KLFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Dict[str, KLFn] = {}
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


register_kl = registrar(KL_ESTIMATORS, "KL estimator")


@register_kl("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


@register_kl("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp).square()


@register_kl("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    x = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(x) - x - 1.0, -10.0, 10.0)


@register_kl("abs")
def kl_abs(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return (logp - ref_logp).abs()


def resolve_kl_type(kind: str) -> tuple[str, bool]:
    """``(canonical estimator name, straight_through)``; ValueError for unknown names."""
    straight = kind.endswith("+")
    base = KL_ALIASES.get(kind.rstrip("+"), kind.rstrip("+"))
    if base not in KL_ESTIMATORS:
        known = sorted(KL_ESTIMATORS) + sorted(KL_ALIASES)
        raise ValueError(f"unknown KL estimator {kind!r}; use one of {known}, optionally with a '+' suffix")
    return base, straight


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate ``[B, T]`` (unmasked; the caller aggregates)."""
    base, straight = resolve_kl_type(kind)
    value = KL_ESTIMATORS[base](logp, ref_logp)
    if not straight:
        return value
    grad_path = kl_k2(logp, ref_logp)
    return grad_path - grad_path.detach() + value.detach()
