"""Clip-Cov and KL-Cov: hand case, reference re-implementation, seeded pick, global scope."""

import math

import pytest
import torch

from megatron_stare.algorithms import AlgorithmConfig, MiniBatchInput, PolicyLossInput, build_policy_loss
from megatron_stare.algorithms.cov import exact_masked_means, floor_frac, token_uniform
from megatron_stare.algorithms.losses import clipped_surrogate
from tests.unit.test_losses import make_batch, run_layout

D64 = torch.float64


def test_token_uniform_is_deterministic_and_seeded():
    keys = torch.arange(0, 1 << 40, (1 << 40) // 5000, dtype=torch.int64)
    u = token_uniform(keys, seed=1, step=2)
    assert torch.equal(u, token_uniform(keys.clone(), 1, 2))
    assert torch.equal(u[10:20], token_uniform(keys[10:20], 1, 2))  # per key, not per position
    assert not torch.equal(u, token_uniform(keys, 2, 2)) and not torch.equal(u, token_uniform(keys, 1, 3))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    assert u.unique().numel() > 0.99 * u.numel()


def test_floor_frac_reads_the_decimal():
    assert floor_frac(100, 0.29) == 29 and int(100 * 0.29) == 28
    assert floor_frac(10000, 2e-4) == 2 and floor_frac(4999, 2e-4) == 0


def test_exact_means_close_to_float_means():
    b = make_batch(seed=3)
    m = exact_masked_means(b["old_logp"], b["adv"], b["mask"])
    mask = b["mask"]
    assert m.num_valid == mask.sum().item()
    assert m.logp_mean == pytest.approx(b["old_logp"][mask].mean().item(), abs=1e-7)
    assert m.adv_mean == pytest.approx(b["adv"][:, None].expand_as(mask)[mask].mean().item(), abs=1e-7)


def _inputs(b, rows, logp):
    return PolicyLossInput(logp=logp, old_logp=b["old_logp"][rows], advantages=b["adv"][rows],
                           mask=b["mask"][rows], token_keys=b["keys"][rows])


def _token_grad(cfg, b, rows, step=0):
    fn = build_policy_loss(cfg)
    logp = (b["old_logp"][rows] + 0.25 * torch.sin(b["old_logp"][rows] * 7)).requires_grad_(True)
    plan = fn.plan(MiniBatchInput(b["old_logp"][rows], b["adv"][rows], b["mask"][rows], b["keys"][rows]), step=step)
    out = fn(_inputs(b, rows, logp), plan)
    out.loss.backward()
    return out, logp.grad, logp.detach()


def ref_cov(logp, adv, mask):
    a = adv[:, None].expand_as(logp)
    return (a - a[mask].mean()) * (logp - logp[mask].mean())


def test_clip_cov_microbatch_matches_reference_formula():
    b = make_batch(seed=7, n=10, t=16)
    rows = list(range(10))
    cfg = AlgorithmConfig(policy_loss="clip_cov", clip_ratio_c=None)
    cc = cfg.clip_cov
    cc.lb, cc.ub, cc.ratio, cc.seed, cc.selection_scope = -0.5, 0.5, 0.05, 11, "microbatch"
    out, grad, logp = _token_grad(cfg, b, rows, step=4)
    mask, adv, old = b["mask"], b["adv"], b["old_logp"]
    sur = clipped_surrogate(logp, old, adv, 0.2, 0.28, None)
    cov = ref_cov(logp, adv, mask)
    cand = mask & ~sur.clipped & (cov > cc.lb) & (cov < cc.ub)
    n = int(mask.sum())
    k = min(max(1, int(round(cc.ratio * n, 9))), int(cand.sum()))
    u = token_uniform(b["keys"], cc.seed, 4)
    order = sorted((-u[i, j].item(), b["keys"][i, j].item(), i, j) for i, j in cand.nonzero().tolist())
    corr = torch.ones_like(logp)
    for *_, i, j in order[:k]:
        corr[i, j] = 0.0
    expect = (sur.loss * corr * mask).sum() / n
    assert k >= 2 and out.loss.item() == pytest.approx(expect.item(), rel=1e-12)
    assert out.metrics.means()["clip_cov/frac"] == pytest.approx(k / n)
    assert (grad[corr == 0] == 0).all()


def test_clip_cov_global_picks_exactly_k_and_is_reproducible():
    b = make_batch(seed=8, n=10, t=16)
    cfg = AlgorithmConfig(policy_loss="clip_cov")
    cfg.clip_cov.lb, cfg.clip_cov.ub, cfg.clip_cov.ratio = -0.5, 0.5, 0.05
    n = int(b["mask"].sum())
    _, _, m1, _ = run_layout(cfg, b, range(10), 3, step=5)
    _, _, m2, _ = run_layout(cfg, b, range(10), 10, step=5)
    _, _, m3, _ = run_layout(cfg, b, range(10), 10, step=6)
    picked = m1.sums["clip_cov/frac"].item()
    assert picked == max(1, math.floor(0.05 * n)) == m2.sums["clip_cov/frac"].item()
    assert m3.sums["clip_cov/frac"].item() == picked  # same count, another draw


def test_kl_cov_hand_case():
    # Two sequences of 2 tokens: A = [+1, -1]; logp = [-0.5, -2 | -1, -1]; mean A = 0, mean logp = -1.125.
    old = torch.tensor([[-0.5, -2.0], [-1.0, -1.0]], dtype=D64)
    logp = (old + torch.tensor([[0.1, -0.2], [0.3, 0.0]], dtype=D64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=D64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    keys = torch.arange(4).reshape(2, 2)
    cfg = AlgorithmConfig(policy_loss="kl_cov")
    cfg.kl_cov.ratio, cfg.kl_cov.coef = 0.25, 2.0  # k = 1
    fn = build_policy_loss(cfg)
    plan = fn.plan(MiniBatchInput(old, adv, mask, keys))
    out = fn(PolicyLossInput(logp=logp, old_logp=old, advantages=adv, mask=mask, token_keys=keys), plan)
    # Global scope uses old_logp: cov = [0.625, -0.875, -0.125, -0.125] -> token (0, 0) selected.
    rho = torch.exp(logp.detach() - old)
    tok = -adv[:, None] * rho
    tok[0, 0] += 2.0 * 0.1
    assert out.loss.item() == pytest.approx(tok.mean().item(), rel=1e-12)
    assert out.metrics.means()["kl_cov/frac"] == 0.25
    # microbatch scope uses the current logp: cov = (A - 0)*(logp - mean) -> still token (0, 0) here.
    cfg.kl_cov.selection_scope = "microbatch"
    fn = build_policy_loss(cfg)
    out2 = fn(PolicyLossInput(logp=logp, old_logp=old, advantages=adv, mask=mask, token_keys=keys), fn.plan(MiniBatchInput(old, adv, mask, keys)))
    assert out2.loss.item() == pytest.approx(out.loss.item(), rel=1e-12)


def test_kl_cov_microbatch_matches_reference_formula():
    b = make_batch(seed=9, n=10, t=16)
    rows = list(range(10))
    cfg = AlgorithmConfig(policy_loss="kl_cov")
    cfg.kl_cov.ratio, cfg.kl_cov.coef, cfg.kl_cov.selection_scope = 0.03, 1.5, "microbatch"
    out, grad, logp = _token_grad(cfg, b, rows)
    mask, adv, old = b["mask"], b["adv"], b["old_logp"]
    cov = ref_cov(logp, adv, mask)
    n = int(mask.sum())
    k = max(1, int(round(n * 0.03, 9)))
    flat = sorted((-cov[i, j].item(), b["keys"][i, j].item(), i, j) for i, j in mask.nonzero().tolist())
    lr = logp - old
    tok = -adv[:, None] * torch.exp(lr)
    for *_, i, j in flat[:k]:
        tok[i, j] += 1.5 * lr[i, j].abs()
    assert k >= 2 and out.loss.item() == pytest.approx((tok * mask).sum().item() / n, rel=1e-12)


def test_cov_selection_differs_between_scopes_on_split():
    """Microbatch scope picks per micro-batch (k from each part); global picks once."""
    b = make_batch(seed=10, n=8, t=12)
    cfg = AlgorithmConfig(policy_loss="kl_cov")
    cfg.kl_cov.ratio = 0.02
    _, _, g1, _ = run_layout(cfg, b, range(8), 8)
    _, _, g2, _ = run_layout(cfg, b, range(8), 2)
    assert g1.sums["kl_cov/frac"] == g2.sums["kl_cov/frac"] == 1
    cfg.kl_cov.selection_scope = "microbatch"
    _, _, m2, _ = run_layout(cfg, b, range(8), 2)
    assert m2.sums["kl_cov/frac"].item() == 4  # max(1, .) in each of the 4 micro-batches
