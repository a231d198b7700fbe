"""Clipped surrogate, aggregation, KL/entropy terms, micro-batch split invariance of every loss.

The batch builders and ``run_layout`` here are reused by tests/distributed/test_loss_dist.py.
"""

import math

import pytest
import torch

from megatron_stare.algorithms import (
    AlgorithmConfig,
    LossDenominators,
    MetricSums,
    MiniBatchInput,
    PolicyLossInput,
    StareState,
    aggregate,
    backward_scale,
    build_policy_loss,
    compute_advantages,
    compute_loss_denominators,
)
from megatron_stare.algorithms.kl import kl_penalty
from megatron_stare.algorithms.losses import clipped_surrogate
from megatron_stare.algorithms.stare import stare_weights

D64 = torch.float64


# ----------------------------------------------------------------------------- shared builders
def make_batch(seed=0, n=8, t=12, v=7, d=5, dtype=D64):
    """A tiny "model" (logits = feats @ W) and an off-policy mini-batch of ``n`` responses."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, t, d, generator=g, dtype=dtype)
    w0 = torch.randn(d, v, generator=g, dtype=dtype)
    tokens = torch.randint(0, v, (n, t), generator=g)
    lengths = torch.randint(t // 3, t + 1, (n,), generator=g)
    lengths[0] = 1  # a one-token response
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if n > 3:
        mask[3] = False  # a row with no valid token
    adv = torch.randn(n, generator=g, dtype=dtype)
    adv[min(2, n - 1)] = 0.0  # A == 0 belongs to neither STARE set
    with torch.no_grad():
        logp0 = torch.log_softmax(feats @ w0, -1).gather(-1, tokens[..., None])[..., 0]
    old_logp = logp0 + 0.3 * torch.randn(n, t, generator=g, dtype=dtype)
    ref_logp = logp0 + 0.2 * torch.randn(n, t, generator=g, dtype=dtype)
    keys = torch.arange(n)[:, None] * t + torch.arange(t)[None, :]
    return dict(feats=feats, w0=w0, tokens=tokens, mask=mask, adv=adv, old_logp=old_logp,
                ref_logp=ref_logp, keys=keys.to(torch.int64))


def forward(w, b, rows):
    logits = b["feats"][rows] @ w
    lsm = torch.log_softmax(logits, -1)
    logp = lsm.gather(-1, b["tokens"][rows][..., None])[..., 0]
    entropy = -(lsm.exp() * lsm).sum(-1)
    return logp, entropy


def loss_input(w, b, rows):
    logp, ent = forward(w, b, rows)
    return PolicyLossInput(logp=logp, old_logp=b["old_logp"][rows], advantages=b["adv"][rows],
                           mask=b["mask"][rows], token_keys=b["keys"][rows], entropy=ent,
                           ref_logp=b["ref_logp"][rows])


def run_layout(cfg, b, rows, mb_size, *, dp_group=None, step=3, stare_state=None, scale=1.0):
    """Plan once over this rank's ``rows``, then backward each micro-batch of ``mb_size`` rows.

    Returns (grad of W, summed loss, MetricSums, set of STARE-selected keys (or None)).
    """
    fn = build_policy_loss(cfg)
    rows = list(rows)
    mb = MiniBatchInput(old_logp=b["old_logp"][rows], advantages=b["adv"][rows], mask=b["mask"][rows],
                        token_keys=b["keys"][rows])
    plan = fn.plan(mb, dp_group=dp_group, step=step, stare_state=stare_state)
    w = b["w0"].clone().requires_grad_(True)
    total, metrics, selected = 0.0, MetricSums(), set()
    for i in range(0, len(rows), mb_size):
        r = rows[i:i + mb_size]
        inp = loss_input(w, b, r)
        out = fn(inp, plan)
        (out.loss * scale).backward()
        total += float(out.loss.detach())
        metrics.merge(out.metrics)
        if cfg.policy_loss == "stare":
            s = -(inp.old_logp if cfg.stare.selection_scope == "global" else inp.logp).detach()
            wts = stare_weights(s, inp.advantages, inp.mask, inp.token_keys, cfg.stare, stare_state, plan.stare)
            sel = wts.pos_selected | wts.neg_selected
            selected |= set(inp.token_keys[sel].tolist())
    return w.grad, total, metrics, (selected if cfg.policy_loss == "stare" else None)


def all_configs():
    """(id, AlgorithmConfig, stare_state) covering every loss and aggregation mode."""
    out = []
    for mode in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        c = AlgorithmConfig(loss_agg_mode=mode, seq_mean_norm_const=12.0, entropy_coeff=0.01,
                            kl_loss_coef=0.1, kl_loss_type="k3+")
        out.append((f"vanilla-{mode}", c, None))
    on = StareState(gate_on=True, w=1.3, m=0.7)
    for variant in ["O1", "C2"]:
        c = AlgorithmConfig(policy_loss="stare")
        c.stare.variant, c.stare.top_p = variant, 0.25
        out.append((f"stare-{variant}", c, on))
    c = AlgorithmConfig(policy_loss="clip_cov")
    c.clip_cov.lb, c.clip_cov.ub, c.clip_cov.ratio = -1.0, 1.0, 0.05
    out.append(("clip_cov", c, None))
    c = AlgorithmConfig(policy_loss="kl_cov")
    c.kl_cov.ratio = 0.05
    out.append(("kl_cov", c, None))
    for cid, c, _ in out:
        c.validate()
    return out


# ----------------------------------------------------------------------------- hand cases
@pytest.mark.parametrize("a,rho,expect,grad_zero", [
    (1.0, 1.3, -1.28, True), (1.0, 1.25, -1.25, False), (-1.0, 0.7, 0.8, True), (-1.0, 5.0, 3.0, True),
])
def test_clip_hand_cases(a, rho, expect, grad_zero):
    logp = torch.tensor([math.log(rho)], dtype=D64, requires_grad=True)
    sur = clipped_surrogate(logp, torch.zeros(1, dtype=D64), torch.tensor([a], dtype=D64), 0.2, 0.28, 3.0)
    assert sur.loss.item() == pytest.approx(expect, abs=1e-12)
    sur.loss.sum().backward()
    assert (logp.grad.item() == 0.0) == grad_zero


def test_dual_clip_only_for_negative_advantage_and_disableable():
    logp = torch.log(torch.tensor([5.0, 5.0], dtype=D64))
    a = torch.tensor([-1.0, -1.0], dtype=D64)
    assert clipped_surrogate(logp, torch.zeros(2, dtype=D64), a, 0.2, 0.28, 3.0).loss.tolist() == pytest.approx([3.0, 3.0])
    assert clipped_surrogate(logp, torch.zeros(2, dtype=D64), a, 0.2, 0.28, None).loss.tolist() == pytest.approx([5.0, 5.0])
    # A>0 with a tiny ratio: L = -A*(1-eps) is not touched by the dual clip.
    sur = clipped_surrogate(torch.log(torch.tensor([0.1], dtype=D64)), torch.zeros(1, dtype=D64), torch.ones(1, dtype=D64), 0.2, 0.28, 3.0)
    assert sur.loss.item() == pytest.approx(-0.1) and not sur.dual_clipped.any()


def test_kl_hand_case_and_straight_through():
    lp, ref = torch.tensor([-1.0], dtype=D64), torch.tensor([-2.0], dtype=D64)
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-1), abs=1e-12)
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(0.36787944117144233)
    assert kl_penalty(lp, ref, "abs").item() == pytest.approx(1.0)
    # k3 clamps to 10; straight-through keeps the value and takes k2's gradient (logp - ref).
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").item() == 10.0
    x = lp.clone().requires_grad_(True)
    v = kl_penalty(x, ref, "k3+")
    v.backward()
    assert v.item() == pytest.approx(math.exp(-1)) and x.grad.item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(lp, ref, "k9")


def test_aggregation_modes_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, float("nan")]], dtype=D64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    den = compute_loss_denominators(mask)
    assert den == LossDenominators(num_tokens=4.0, num_seqs=2.0)
    assert aggregate(x, mask, "token-mean", den).item() == pytest.approx(10 / 4)
    assert aggregate(x, mask, "seq-mean-token-mean", den).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(x, mask, "seq-mean-token-sum", den).item() == pytest.approx((6 + 4) / 2)
    assert aggregate(x, mask, "seq-mean-token-sum-norm", den, norm_const=5.0).item() == pytest.approx(10 / 2 / 5)
    # Global denominators: the same tokens seen as a share of a bigger mini-batch.
    assert aggregate(x, mask, "token-mean", LossDenominators(8.0, 4.0)).item() == pytest.approx(10 / 8)
    empty = torch.zeros(1, 3, dtype=torch.bool)
    assert aggregate(x[:1], empty, "token-mean", compute_loss_denominators(empty)).item() == 0.0


def test_entropy_bonus_and_kl_terms_enter_the_loss():
    b = make_batch(seed=1)
    rows = list(range(8))
    base = AlgorithmConfig()
    reg = AlgorithmConfig(entropy_coeff=0.5, kl_loss_coef=0.25, kl_loss_type="k1")
    w = b["w0"].clone().requires_grad_(True)
    inp = loss_input(w, b, rows)
    den = compute_loss_denominators(inp.mask)
    from megatron_stare.algorithms.losses import LossPlan

    plan = LossPlan(denominators=den)
    l0 = build_policy_loss(base)(inp, plan).loss
    l1 = build_policy_loss(reg)(inp, plan).loss
    m = inp.mask
    h = (inp.entropy * m).sum() / m.sum()
    k1 = ((inp.logp - inp.ref_logp) * m).sum() / m.sum()
    assert l1.item() == pytest.approx((l0 - 0.5 * h + 0.25 * k1).item(), abs=1e-12)
    with pytest.raises(ValueError, match="kl_loss_coef > 0 needs reference"):
        inp.ref_logp = None
        build_policy_loss(reg)(inp, plan)


# ----------------------------------------------------------------------------- invariance
@pytest.mark.parametrize("cid,cfg,state", all_configs(), ids=[c[0] for c in all_configs()])
def test_gradient_and_metrics_invariant_to_microbatch_split(cid, cfg, state):
    b = make_batch(seed=2)
    ref_grad, ref_loss, ref_metrics, ref_sel = run_layout(cfg, b, range(8), 8, stare_state=state)
    assert ref_grad.abs().sum() > 0
    means = ref_metrics.means()
    assert means["pg_clipfrac" if cfg.policy_loss != "kl_cov" else "kl_cov/frac"] > 0  # the case bites
    if cfg.policy_loss == "clip_cov":
        assert means["clip_cov/frac"] > 0
    for mbs in (4, 2, 1):
        g, loss, metrics, sel = run_layout(cfg, b, range(8), mbs, stare_state=state)
        torch.testing.assert_close(g, ref_grad, rtol=1e-12, atol=1e-14)
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-14)
        for k, v in ref_metrics.means().items():
            assert metrics.means()[k] == pytest.approx(v, rel=1e-12, abs=1e-14), k
        if cfg.policy_loss == "stare":
            assert sel == ref_sel and len(sel) > 0


def test_per_token_gradient_signs_match_plain_surrogate():
    """omega > 0: STARE never flips a token's gradient sign relative to the surrogate."""
    b = make_batch(seed=4)
    plain = AlgorithmConfig()
    stare = AlgorithmConfig(policy_loss="stare")
    stare.stare.variant, stare.stare.top_p = "C2", 0.5
    grads = []
    for cfg in (plain, stare):
        fn = build_policy_loss(cfg)
        logp = forward(b["w0"], b, list(range(8)))[0].detach().requires_grad_(True)
        inp = PolicyLossInput(logp=logp, old_logp=b["old_logp"], advantages=b["adv"], mask=b["mask"], token_keys=b["keys"])
        plan = fn.plan(MiniBatchInput(b["old_logp"], b["adv"], b["mask"], b["keys"]), stare_state=StareState(True, 1.5, 0.5))
        fn(inp, plan).loss.backward()
        grads.append(logp.grad)
    assert torch.equal(torch.sign(grads[0]), torch.sign(grads[1]))
    assert not torch.equal(grads[0], grads[1])


def test_backward_scale_contract():
    assert backward_scale(grad_reduce_divisor=4) == 4.0
    assert backward_scale(grad_reduce_divisor=2, schedule_divisor=8) == 16.0


def test_metric_sums_merge_and_means():
    a, b = MetricSums(), MetricSums()
    a.add("x", 3.0, 2)
    b.add("x", torch.tensor(5.0), torch.tensor(2))
    b.add("y", 1.0, 0)
    a.merge(b)
    assert a.means() == {"x": 2.0, "y": 0.0}


def test_config_validation_names_the_field():
    c = AlgorithmConfig()
    c.stare.top_p = 1.5
    with pytest.raises(ValueError, match=r"^config: algorithm.stare.top_p must be in \(0, 1\] \(.*\), got 1.5$"):
        c.validate()
    for field, value, pattern in [
        ("policy_loss", "ppo2", "algorithm.policy_loss must be one of"),
        ("adv_estimator", "gae", "algorithm.adv_estimator must be one of"),
        ("loss_agg_mode", "mean", "algorithm.loss_agg_mode must be one of"),
        ("clip_ratio_c", 0.5, "algorithm.clip_ratio_c must be > 1"),
        ("kl_loss_type", "k7", "algorithm.kl_loss_type"),
    ]:
        c = AlgorithmConfig(**{field: value})
        with pytest.raises(ValueError, match=pattern):
            # The names are checked by the registries that own them (above the config types).
            compute_advantages(torch.ones(2), torch.zeros(2, dtype=torch.int64), c)
            build_policy_loss(c)
    with pytest.raises(ValueError, match="seq_mean_norm_const must be > 0"):
        AlgorithmConfig(loss_agg_mode="seq-mean-token-sum-norm").validate()
    c = AlgorithmConfig()
    c.stare.selection_scope = "rank"
    with pytest.raises(ValueError, match="algorithm.stare.selection_scope must be one of"):
        c.validate()
    c = AlgorithmConfig()
    c.gepo.ema_rate = 0.0
    with pytest.raises(ValueError, match=r"algorithm.gepo.ema_rate must be in \(0, 1\]"):
        c.validate()


def test_global_token_mean_and_build_validates():
    from megatron_stare.algorithms import global_token_mean

    x = torch.tensor([[1.0, float("nan")], [3.0, 5.0]])
    mask = torch.tensor([[True, False], [True, True]])
    assert global_token_mean(x, mask) == 3.0
    assert math.isnan(global_token_mean(x, torch.zeros_like(mask)))
    with pytest.raises(ValueError, match="algorithm.policy_loss must be one of"):
        build_policy_loss(AlgorithmConfig(policy_loss="nope"))
