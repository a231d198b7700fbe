"""GEPO advantage shaping: invariants, causal EMA history, warm-up, checkpoint state."""

import math

import pytest
import torch

from megatron_stare.algorithms import GepoConfig, GepoShaper, group_token_mean


def step_inputs(seed, g=6, n=4):
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(g * n, generator=gen, dtype=torch.float64)
    adv[::5] = 0.0
    h = torch.rand(g, generator=gen, dtype=torch.float64)
    return adv, h, torch.arange(g).repeat_interleave(n)


def test_group_token_mean():
    ent = torch.tensor([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    out = group_token_mean(ent, mask, torch.tensor([0, 0, 1]), 2)
    assert out[0].item() == pytest.approx(2.0) and math.isnan(out[1].item())


def test_warmup_then_hand_shaping():
    s = GepoShaper(GepoConfig(lam_pos=0.5, lam_neg=0.25, kappa=1.0, ema_rate=1.0))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    idx = torch.tensor([0, 0, 1, 1, 2, 2])
    out = s(adv, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64), idx)
    assert torch.equal(out.advantages, adv) and out.tau_lo == -math.inf  # no history yet
    # History: mean 0.5, second moment (0.01 + 0.25 + 0.81)/3 -> sigma = sqrt(0.1067) ~ 0.3266
    assert s.thresholds() == pytest.approx((0.5 - math.sqrt(0.32 / 3), 0.5 + math.sqrt(0.32 / 3)))
    out = s.shape(adv, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64), idx)
    assert out.advantages.tolist() == [0.5, -1.0, 1.0, -1.0, 1.0, -0.75]
    assert out.frac_pos_shrunk == pytest.approx(1 / 6) and out.frac_neg_shrunk == pytest.approx(1 / 6)


@pytest.mark.parametrize("cfg", [GepoConfig(lam_pos=0.0, lam_neg=0.0), GepoConfig(kappa=math.inf)])
def test_zero_lambda_or_infinite_thresholds_is_identity(cfg):
    s = GepoShaper(cfg)
    for step in range(4):
        adv, h, idx = step_inputs(step)
        assert torch.equal(s(adv, h, idx).advantages, adv)


def test_signs_kept_magnitudes_shrink_only_two_cells_change():
    s = GepoShaper(GepoConfig(lam_pos=0.7, lam_neg=0.4, kappa=0.3, ema_rate=0.5))
    changed_any = False
    for step in range(6):
        adv, h, idx = step_inputs(step)
        lo, hi = s.thresholds()
        out = s(adv, h, idx).advantages
        assert torch.equal(torch.sign(out), torch.sign(adv)) and (out.abs() <= adv.abs()).all()
        hs = h[idx]
        may = ((adv > 0) & (hs < lo)) | ((adv < 0) & (hs > hi))
        assert torch.equal(out[~may], adv[~may])
        changed_any |= bool((out != adv).any())
    assert changed_any


def test_history_is_causal_and_checkpointable():
    cfg = GepoConfig(lam_pos=0.5, lam_neg=0.5, kappa=0.5, ema_rate=0.3)
    a, b = GepoShaper(cfg), GepoShaper(cfg)
    for step in range(3):
        adv, h, idx = step_inputs(step)
        a(adv, h, idx)
        b(adv, h, idx)
    adv, h, idx = step_inputs(3)
    # Step 3's own entropies do not move step 3's thresholds.
    before = a.thresholds()
    out = a.shape(adv, h, idx)
    assert (out.tau_lo, out.tau_hi) == before
    a.observe(h)
    assert a.thresholds() != before
    c = GepoShaper(cfg)
    c.load_state_dict(b.state_dict())
    assert torch.equal(c(adv, h, idx).advantages, out.advantages) and c.state == a.state


def test_nan_groups_are_ignored():
    s = GepoShaper(GepoConfig(ema_rate=1.0))
    s.observe(torch.tensor([float("nan")]))
    assert s.state.num_updates == 0
    s.observe(torch.tensor([0.2, float("nan"), 0.4]))
    assert s.state.mean == pytest.approx(0.3)
