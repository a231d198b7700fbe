"""Truncated importance sampling: the TIS weight multiplies each token's policy loss, carries no
gradient, and the cap is validated."""

import pytest
import torch

from megatron_stare.config.algorithm import AlgorithmConfig
from megatron_stare.algorithms.losses import MiniBatchInput, PolicyLossInput, build_policy_loss


def _inputs(tis=None):
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(2, 5, generator=g)).requires_grad_()
    old = logp.detach() + 0.05 * torch.randn(2, 5, generator=g)
    mask = torch.ones(2, 5, dtype=torch.bool)
    keys = torch.arange(10).view(2, 5)
    adv = torch.tensor([1.0, -0.5])
    return logp, PolicyLossInput(logp=logp, old_logp=old, advantages=adv, mask=mask, token_keys=keys,
                                 tis_weight=tis), MiniBatchInput(old_logp=old, advantages=adv, mask=mask, token_keys=keys)


def test_tis_weights_scale_token_losses():
    fn = build_policy_loss(AlgorithmConfig())
    w = torch.tensor([[1.0, 2.0, 0.5, 1.0, 1.5], [0.2, 1.0, 1.0, 2.0, 1.0]])
    logp0, plain, mb = _inputs()
    plan = fn.plan(mb)
    base = fn(plain, plan)
    logp1, weighted, _ = _inputs(w)
    out = fn(weighted, plan)
    assert not torch.allclose(base.loss, out.loss)
    # Per-token check through the gradients: d(loss)/d(logp) scales by exactly the weight.
    base.loss.backward()
    out.loss.backward()
    torch.testing.assert_close(logp1.grad, logp0.grad * w, rtol=1e-6, atol=1e-9)


def test_tis_cap_validated():
    with pytest.raises(ValueError, match="algorithm.tis_cap must be >= 1"):
        AlgorithmConfig(tis_cap=0.5).validate()
