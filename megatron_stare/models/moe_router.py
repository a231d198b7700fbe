"""The router's z-loss as the token mean over the whole micro-batch under sequence / context
parallel, where megatron-core 0.16.1 takes a mean per rank.

The z-loss of a micro-batch is ``coeff * mean_t logsumexp(logits_t)^2`` over its real tokens
(ST-MoE). Under sequence parallel (and CP) each of the ``n = |tp_cp|`` ranks routes a slice of
the tokens, and megatron's ``TopKRouter.apply_z_loss`` gives each rank ``(coeff / n) * mean over
its own real tokens``: the ranks' parts sum to the average of the per-rank means, which is the
micro-batch's mean only when every rank holds as many real tokens. With the row's padding
masked (``padding_mask``, the row padded to the TP multiple) they do not: measured on the tiny
Qwen3-MoE at EP2xTP2 (217 real tokens, 109 and 108 per rank) the z-loss gradients were 0.5%
off one process's (2.7e-6 in the weights' gradients). ``GlobalMeanZLoss`` makes each rank's
part ``coeff * sum over its real tokens / real tokens of the micro-batch`` (one scalar
all-reduce over tp_cp), so the parts sum to the micro-batch's mean at any layout. The value
logged to megatron's tracker keeps megatron's scale (the parts times ``n / coeff``, whose
average over the ranks is the mean: ``actor.moe_metrics.router_loss_metrics``).

Without padding, without SP/CP, or with ``calculate_per_token_loss`` megatron's own code runs
(equal counts give the same number). ``install`` patches ``TopKRouter`` once per process; the
model builder calls it for every mixture-of-experts model.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import router as megatron_router
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker

_MEGATRON_Z_LOSS = megatron_router.TopKRouter.apply_z_loss


def global_mean_z_loss(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``TopKRouter.apply_z_loss`` with the micro-batch's token mean (the module docstring).
    ``logits`` ``[tokens, experts]`` of this rank; ``padding_mask`` ``[tokens]``, True at padding."""
    cfg, group = self.config, self.tp_cp_group
    if (cfg.moe_z_loss_coeff is None or not self.training or not torch.is_grad_enabled()
            or padding_mask is None or group.size() == 1 or self.calculate_per_token_loss):
        return _MEGATRON_Z_LOSS(self, logits, padding_mask=padding_mask)
    valid = ~padding_mask
    total = valid.sum().to(torch.float32).detach().clone()
    dist.all_reduce(total, group=group)  # real tokens of the micro-batch over its tp x cp ranks
    z_loss = (torch.logsumexp(logits, dim=-1).square() * valid).sum() / total.clamp(min=1.0) * cfg.moe_z_loss_coeff
    logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
    num_layers = cfg.num_layers + (cfg.mtp_num_layers or 0)
    # megatron logs z_loss / (coeff / n) per rank: the same scale, so the ranks average to the mean.
    save_to_aux_losses_tracker("z_loss", z_loss * group.size() / cfg.moe_z_loss_coeff, self.layer_number, num_layers)
    return logits


def install() -> None:
    """Make ``TopKRouter.apply_z_loss`` the micro-batch mean (idempotent, process-wide)."""
    megatron_router.TopKRouter.apply_z_loss = global_mean_z_loss


def uninstall() -> None:
    """Back to megatron-core's per-rank mean (tests show what the patch changes)."""
    megatron_router.TopKRouter.apply_z_loss = _MEGATRON_Z_LOSS
