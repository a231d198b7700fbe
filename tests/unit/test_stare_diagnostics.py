"""Entropy-dynamics diagnostics: S(a) against finite differences, E[S] = 0, cov, quadrants."""

import math

import pytest
import torch

from megatron_stare.algorithms.diagnostics import entropy_dynamics, entropy_sensitivity, sensitivity_stats

D64 = torch.float64


def entropy(z):
    lp = torch.log_softmax(z, -1)
    return -(lp.exp() * lp).sum(-1)


def test_uniform_entropy_is_ln4():
    h, p2, p2lp = sensitivity_stats(torch.zeros(4))
    assert h.item() == pytest.approx(math.log(4)) and h.item() == pytest.approx(1.386, abs=1e-3)
    assert p2.item() == pytest.approx(0.25) and p2lp.item() == pytest.approx(0.25 * math.log(0.25))


@pytest.mark.parametrize("seed", range(3))
def test_sensitivity_matches_finite_difference_and_has_zero_mean(seed):
    z = torch.randn(7, generator=torch.Generator().manual_seed(seed), dtype=D64) * 2
    pi = torch.softmax(z, -1)
    h, p2, p2lp = sensitivity_stats(z)
    logp = torch.log(pi)
    s = entropy_sensitivity(logp, h.expand(7), p2.expand(7), p2lp.expand(7))
    eta = 1e-6
    for a in range(7):
        dz = eta * (torch.nn.functional.one_hot(torch.tensor(a), 7).to(D64) - pi)
        fd = (entropy(z + dz) - entropy(z - dz)) / 2
        assert fd.item() == pytest.approx(eta * s[a].item(), rel=1e-6, abs=1e-15)
    assert (pi * s).sum().item() == pytest.approx(0.0, abs=1e-14)
    # Textbook form: S(a) = pi_a (s_a - H) - sum_j pi_j^2 (s_j - H)
    direct = pi * (-logp - h) - (pi.square() * (-logp - h)).sum()
    torch.testing.assert_close(s, direct, rtol=1e-12, atol=1e-14)


def test_entropy_dynamics_hand_case():
    # Two tokens of one uniform-over-4 distribution: surprisal ln4 == H -> "low" quadrant.
    z = torch.zeros(2, 3, 4, dtype=D64)
    z[0, 1, 0] = 3.0  # token (0,1) peaked: sample the unlikely index 1 -> high surprisal
    h, p2, p2lp = sensitivity_stats(z)
    lsm = torch.log_softmax(z, -1)
    logp = lsm[..., 1]
    adv = torch.tensor([1.0, -2.0], dtype=D64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    omega = torch.full((2, 3), 2.0, dtype=D64)
    out = entropy_dynamics(logp, adv, mask, h, p2, p2lp, omega)
    s = entropy_sensitivity(logp, h, p2, p2lp)
    a = adv[:, None].expand(2, 3)
    assert out.pred_dH == pytest.approx((2 * a * s)[mask].mean().item(), rel=1e-12)
    lp, av = logp[mask], a[mask]
    assert out.cov == pytest.approx(((lp * av).mean() - lp.mean() * av.mean()).item(), rel=1e-12)
    assert out.num_tokens == 3
    assert (out.frac_pos_high, out.frac_pos_low, out.frac_neg_high, out.frac_neg_low) == pytest.approx((1 / 3, 1 / 3, 0, 1 / 3))
