"""GSPO, CISPO and forking-token training against the hand cases of docs/algorithms.md (last
section), each value worked out by hand here; their invariants (rho = 1 is the base loss, a
micro-batch split changes nothing) and their config bounds."""

import math

import pytest
import torch

from megatron_stare.config.algorithm import AlgorithmConfig, CispoConfig, ForkingTokensConfig, GspoConfig
from megatron_stare.algorithms.losses import MiniBatchInput, PolicyLossInput, build_policy_loss


def _case(logp, old, adv, mask=None, entropy=None):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(old, dtype=torch.float64)
    mask = torch.ones_like(old, dtype=torch.bool) if mask is None else torch.tensor(mask)
    keys = torch.arange(old.numel()).view(old.shape)
    adv = torch.tensor(adv, dtype=torch.float64)
    ent = None if entropy is None else torch.tensor(entropy, dtype=torch.float64)
    inp = PolicyLossInput(logp=logp, old_logp=old, advantages=adv, mask=mask, token_keys=keys, old_entropy=ent)
    return logp, inp, MiniBatchInput(old_logp=old, advantages=adv, mask=mask, token_keys=keys, entropy=ent)


def _run(cfg, inp, mb):
    fn = build_policy_loss(cfg)
    return fn(inp, fn.plan(mb))


# ---------------------------------------------------------------------------------------- GSPO
def test_gspo_sequence_ratio_hand_case():
    """Log-ratios 0.1 and -0.3 -> s = exp(-0.1) ~= 0.9048. A = +1: s < 1 - eps_lo, so the
    unclipped -A*s is the max (-0.9048 > -0.9997): loss -0.9048 and d/dlogp_t = -s/2 per token
    (ds = s * mean_t dlogp_t). A = -1: max(s, clip(s) = 0.9997) = 0.9997, clipped, no gradient."""
    s = math.exp(-0.1)
    cfg = AlgorithmConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean")
    logp, inp, mb = _case([[-1.0, -2.0]], [[-1.1, -1.7]], [1.0])
    out = _run(cfg, inp, mb)
    assert out.loss.item() == pytest.approx(-s, rel=1e-12)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -s / 2, dtype=torch.float64))
    assert out.metrics.means()["pg_clipfrac"] == 0.0

    logp, inp, mb = _case([[-1.0, -2.0]], [[-1.1, -1.7]], [-1.0])
    out = _run(cfg, inp, mb)
    assert out.loss.item() == pytest.approx(1 - 3e-4, rel=1e-12)
    out.loss.backward()
    assert torch.count_nonzero(logp.grad) == 0
    assert out.metrics.means()["pg_clipfrac"] == 1.0


def test_gspo_two_responses_padding_and_aggregation():
    """Response 1: log-ratios 0.1, -0.3 (s1 = e^-0.1), A = 1. Response 2: one valid token of
    log-ratio 2e-4 (s2 = e^2e-4 = 1.0002, inside [1 - 3e-4, 1 + 4e-4]) and a padded token with a
    huge ratio that must not count. Mean over responses (the paper): -(s1 + s2)/2; token-mean
    weights by length: -(2*s1 + s2)/3."""
    s1, s2 = math.exp(-0.1), math.exp(2e-4)
    args = ([[-1.0, -2.0], [-0.5, 0.0]], [[-1.1, -1.7], [-0.5002, -30.0]], [1.0, 1.0],
            [[True, True], [True, False]])
    out = _run(AlgorithmConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean"), *_case(*args)[1:])
    assert out.loss.item() == pytest.approx(-(s1 + s2) / 2, rel=1e-9)
    out = _run(AlgorithmConfig(policy_loss="gspo"), *_case(*args)[1:])
    assert out.loss.item() == pytest.approx(-(2 * s1 + s2) / 3, rel=1e-9)


def test_gspo_clips_above_with_wider_eps():
    """s = exp(0.2) = 1.2214 with eps_hi = 0.1, A = +1: max(-1.2214, -1.1) = -1.1, no gradient."""
    cfg = AlgorithmConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
                          gspo=GspoConfig(clip_ratio_low=0.1, clip_ratio_high=0.1))
    logp, inp, mb = _case([[-1.0, -1.0]], [[-1.1, -1.3]], [1.0])
    out = _run(cfg, inp, mb)
    assert out.loss.item() == pytest.approx(-1.1, rel=1e-12)
    out.loss.backward()
    assert torch.count_nonzero(logp.grad) == 0


# --------------------------------------------------------------------------------------- CISPO
def test_cispo_hand_case():
    """r = 1.5, eps_hi = 0.28, A = 1: weight 1.28 on -logp (logp = -0.5: loss 0.64, gradient
    -1.28). r = 0.5 has no lower clip by default (weight 0.5: loss 0.25, gradient -0.5); with
    eps_lo = 0.2 its weight is 0.8. Token mean over the two tokens."""
    lr = [[math.log(1.5), math.log(0.5)]]
    logp, inp, mb = _case([[-0.5, -0.5]], [[-0.5 - lr[0][0], -0.5 - lr[0][1]]], [1.0])
    out = _run(AlgorithmConfig(policy_loss="cispo"), inp, mb)
    assert out.loss.item() == pytest.approx((1.28 * 0.5 + 0.5 * 0.5) / 2, rel=1e-12)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.28 / 2, -0.5 / 2]], dtype=torch.float64))
    assert out.metrics.means()["pg_clipfrac"] == 0.5

    logp, inp, mb = _case([[-0.5, -0.5]], [[-0.5 - lr[0][0], -0.5 - lr[0][1]]], [1.0])
    out = _run(AlgorithmConfig(policy_loss="cispo", cispo=CispoConfig(clip_ratio_low=0.2)), inp, mb)
    assert out.loss.item() == pytest.approx((1.28 * 0.5 + 0.8 * 0.5) / 2, rel=1e-12)


def test_cispo_negative_advantage_keeps_gradient_of_clipped_tokens():
    """A = -1, r = 3 (clipped weight 1.28): PPO would drop this token's gradient, CISPO keeps it:
    loss = 1.28 * logp = -1.28 * 0.5, gradient 1.28."""
    logp, inp, mb = _case([[-0.5]], [[-0.5 - math.log(3.0)]], [-1.0])
    out = _run(AlgorithmConfig(policy_loss="cispo"), inp, mb)
    assert out.loss.item() == pytest.approx(-0.64, rel=1e-12)
    out.loss.backward()
    assert logp.grad.item() == pytest.approx(1.28, rel=1e-12)


# ------------------------------------------------------------------------------ forking tokens
#: Response 1 (keys 0-4, A = +1) and response 2 (keys 5-9, A = -1), on-policy (rho = 1: the
#: surrogate is -A). Entropies: the top 3 (rho = 0.3, k = ceil(3) = 3) are 1.0 (key 5, A = -1),
#: 0.9 (key 2, A = +1) and one of the two 0.8's: key 4 (A = +1) beats key 9 on the smaller key.
ENT = [[0.1, 0.5, 0.9, 0.3, 0.8], [1.0, 0.2, 0.4, 0.6, 0.8]]
LOGP = [[-1.0, -0.7, -0.4, -2.0, -1.5], [-0.3, -0.9, -1.2, -0.6, -0.8]]


def _forking(rho, normalizer="all"):
    return AlgorithmConfig(policy_loss="forking_tokens",
                           forking_tokens=ForkingTokensConfig(rho=rho, normalizer=normalizer))


def test_forking_tokens_hand_case():
    """Kept losses +1 (key 5), -1 (key 2), -1 (key 4): sum -1. Normaliser 'all': -1/10;
    'selected': -1/3. Gradients only on the kept tokens: d(-A*rho)/dlogp = -A / denominator."""
    logp, inp, mb = _case(LOGP, LOGP, [1.0, -1.0], entropy=ENT)
    out = _run(_forking(0.3), inp, mb)
    assert out.loss.item() == pytest.approx(-0.1, rel=1e-12)
    out.loss.backward()
    expect = torch.zeros(2, 5, dtype=torch.float64)
    expect[0, 2] = expect[0, 4] = -1 / 10
    expect[1, 0] = 1 / 10
    torch.testing.assert_close(logp.grad, expect)
    assert out.metrics.means()["forking/kept_frac"] == pytest.approx(0.3)

    logp, inp, mb = _case(LOGP, LOGP, [1.0, -1.0], entropy=ENT)
    out = _run(_forking(0.3, "selected"), inp, mb)
    assert out.loss.item() == pytest.approx(-1 / 3, rel=1e-12)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, expect * 10 / 3)


def test_forking_tokens_rho_one_is_the_base_loss_bitwise():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 6, generator=g, dtype=torch.float64)).tolist()
    old = (torch.tensor(logp) + 0.1 * torch.randn(3, 6, generator=g, dtype=torch.float64)).tolist()
    ent = torch.rand(3, 6, generator=g, dtype=torch.float64).tolist()
    base = _run(AlgorithmConfig(), *_case(logp, old, [1.0, -0.5, 0.3], entropy=ent)[1:])
    for normalizer in ("all", "selected"):
        out = _run(_forking(1.0, normalizer), *_case(logp, old, [1.0, -0.5, 0.3], entropy=ent)[1:])
        assert torch.equal(out.loss, base.loss)


def test_forking_tokens_split_over_micro_batches_sums_to_the_whole():
    """The threshold comes from the whole mini-batch (the plan): each response as its own
    micro-batch gives the same total loss and the same kept set."""
    fn = build_policy_loss(_forking(0.3))
    _, whole, mb = _case(LOGP, LOGP, [1.0, -1.0], entropy=ENT)
    plan = fn.plan(mb)
    parts = []
    for row in range(2):
        logp, inp, _ = _case(LOGP[row:row + 1], LOGP[row:row + 1], [[1.0, -1.0][row]], entropy=ENT[row:row + 1])
        inp.token_keys = inp.token_keys + 5 * row  # the rows' global keys
        parts.append(fn(inp, plan).loss.item())
    assert sum(parts) == pytest.approx(fn(whole, plan).loss.item(), rel=1e-12)
    assert parts == pytest.approx([-2 / 10, 1 / 10])


def test_forking_tokens_needs_the_entropy():
    _, inp, mb = _case(LOGP, LOGP, [1.0, -1.0])
    with pytest.raises(ValueError, match="forking_tokens' needs the old-log-prob pass's entropy"):
        build_policy_loss(_forking(0.3)).plan(mb)


# ------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("cfg,needle", [
    (dict(gspo=GspoConfig(clip_ratio_low=1.0)), "algorithm.gspo.clip_ratio_low must be in [0, 1)"),
    (dict(gspo=GspoConfig(clip_ratio_high=-1e-4)), "algorithm.gspo.clip_ratio_high must be >= 0"),
    (dict(cispo=CispoConfig(clip_ratio_high=-0.1)), "algorithm.cispo.clip_ratio_high must be >= 0"),
    (dict(cispo=CispoConfig(clip_ratio_low=1.5)), "algorithm.cispo.clip_ratio_low must be in [0, 1)"),
    (dict(forking_tokens=ForkingTokensConfig(rho=0.0)), "algorithm.forking_tokens.rho must be in (0, 1]"),
    (dict(forking_tokens=ForkingTokensConfig(rho=1.2)), "algorithm.forking_tokens.rho must be in (0, 1]"),
    (dict(forking_tokens=ForkingTokensConfig(normalizer="kept")), "algorithm.forking_tokens.normalizer must be one of"),
])
def test_bounds_are_checked_with_one_line_naming_the_field(cfg, needle):
    with pytest.raises(ValueError) as e:
        AlgorithmConfig(**cfg).validate()
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
