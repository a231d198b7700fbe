"""The off-policy corrections (``algorithm.off_policy_correction``) against hand cases of
docs/algorithms.md (last section), worked out here by hand; ``k = 1`` gives the base loss; the
per-sequence rules and GSPO are exact when a response is split over context-parallel ranks; the
old fields map onto the new ones; bounds are checked with one line naming the field."""

import math

import pytest
import torch

from megatron_stare.algorithms.aggregation import sequence_token_counts
from megatron_stare.config.algorithm import AlgorithmConfig, OffPolicyConfig
from megatron_stare.algorithms.losses import MiniBatchInput, PolicyLossInput, build_policy_loss
from megatron_stare.algorithms.off_policy import OffPolicyCorrection, off_policy_weights, resolve_off_policy
from megatron_stare.testing.distributed import run_on_ranks

#: Response 1: k = 0.4, 1.0, 1.5, 3.0 (product 1.8, geometric mean 1.8**0.25 = 1.1583);
#: response 2: k = 1.2, 1.1 and a padded token (product 1.32, geometric mean 1.1489).
K = [[0.4, 1.0, 1.5, 3.0], [1.2, 1.1, 50.0, 1.0]]
MASK = torch.tensor([[True] * 4, [True, True, False, False]])


def _weights(rules, **bounds):
    old = torch.log(torch.tensor(K, dtype=torch.float64))
    out = off_policy_weights(old, torch.zeros_like(old), MASK, OffPolicyCorrection(rules, OffPolicyConfig(**bounds)))
    return torch.where(MASK, out.weight, torch.zeros_like(out.weight)), out.masked & MASK


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_tis_truncates():
    w, masked = _weights(("tis",), tis_cap=2.0)
    torch.testing.assert_close(w, _t([[0.4, 1.0, 1.5, 2.0], [1.2, 1.1, 0, 0]]))
    assert not masked.any()


def test_token_mis_masks_ratios_above_the_cap():
    w, masked = _weights(("mis_token",), mis_cap=2.0)
    torch.testing.assert_close(w, _t([[0.4, 1.0, 1.5, 0.0], [1.2, 1.1, 0, 0]]))
    assert masked.tolist() == [[False, False, False, True], [False] * 4]


def test_sequence_mis_weights_by_the_product_or_masks_the_response():
    """C = 2: both products (1.8, 1.32) are kept and weight their tokens; C = 1.5: response 1
    (1.8) is masked whole, response 2 keeps 1.32."""
    w, _ = _weights(("mis_sequence",), mis_cap=2.0)
    torch.testing.assert_close(w, _t([[1.8] * 4, [1.32, 1.32, 0, 0]]))
    w, masked = _weights(("mis_sequence",), mis_cap=1.5)
    torch.testing.assert_close(w, _t([[0.0] * 4, [1.32, 1.32, 0, 0]]))
    assert masked.sum() == 4


def test_band_mask_keeps_the_band():
    w, masked = _weights(("band_mask",), band_low=0.5, band_high=2.0)
    torch.testing.assert_close(w, _t([[0.0, 1, 1, 0], [1, 1, 0, 0]]))
    assert masked.sum() == 2


def test_geo_mask_drops_responses_whose_geometric_mean_leaves_the_band():
    """C = 1.155: 1.1583 > C (response 1 masked), 1.1489 <= C (kept); C = 1.2 keeps both."""
    w, masked = _weights(("geo_mask",), geo_cap=1.155)
    torch.testing.assert_close(w, _t([[0.0] * 4, [1, 1, 0, 0]]))
    assert masked.sum() == 4
    w, _ = _weights(("geo_mask",), geo_cap=1.2)
    torch.testing.assert_close(w, MASK.double())


def test_geo_mask_is_two_sided():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    out = off_policy_weights(old, torch.zeros_like(old), torch.ones(1, 2, dtype=torch.bool),
                             OffPolicyCorrection(("geo_mask",), OffPolicyConfig(geo_cap=1.5)))
    assert out.masked.all()  # geometric mean 0.5 < 1/1.5


def test_a_weight_and_a_mask_compose_by_product():
    w, _ = _weights(("tis", "band_mask"), tis_cap=1.4)
    torch.testing.assert_close(w, _t([[0.0, 1.0, 1.4, 0.0], [1.2, 1.1, 0, 0]]))


@pytest.mark.parametrize("rule", ["tis", "mis_token", "mis_sequence", "band_mask", "geo_mask"])
def test_no_correction_at_k_one(rule):
    """k = 1 everywhere: weight 1, so the loss equals the uncorrected one."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(2, 5, generator=g)).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(2, 5, generator=g)
    mask = torch.ones(2, 5, dtype=torch.bool)
    keys = torch.arange(10).view(2, 5)
    adv = torch.tensor([1.0, -0.5])
    w = off_policy_weights(old, old.clone(), mask, OffPolicyCorrection((rule,)))
    assert torch.equal(w.weight, torch.ones(2, 5)) and not w.masked.any()
    fn = build_policy_loss(AlgorithmConfig())
    plan = fn.plan(MiniBatchInput(old_logp=old, advantages=adv, mask=mask, token_keys=keys))
    base = fn(PolicyLossInput(logp=logp, old_logp=old, advantages=adv, mask=mask, token_keys=keys), plan)
    corr = fn(PolicyLossInput(logp=logp, old_logp=old, advantages=adv, mask=mask, token_keys=keys,
                              tis_weight=w.weight), plan)
    assert torch.equal(base.loss, corr.loss)


# ---------------------------------------------------------------- a response split over CP ranks
def _split(rank, world):
    """Each rank holds every other token of each response (as CP chunks do); the per-sequence
    rules and GSPO's ratio must equal the whole response's."""
    import torch.distributed as dist

    cp = dist.group.WORLD
    old_all = torch.log(torch.tensor(K, dtype=torch.float64))
    cols = list(range(rank, 4, world))
    old, mask = old_all[:, cols], MASK[:, cols]
    out = {}
    for rule, bounds in (("mis_sequence", OffPolicyConfig(mis_cap=1.5)), ("geo_mask", OffPolicyConfig(geo_cap=1.155))):
        w = off_policy_weights(old, torch.zeros_like(old), mask, OffPolicyCorrection((rule,), bounds), cp)
        out[rule] = torch.where(mask, w.weight, torch.zeros_like(w.weight)).tolist()
    # GSPO: log-ratios of the whole response are 0.1, -0.3, 0.2, -0.4 (mean -0.1, s = e^-0.1).
    lr = torch.tensor([[0.1, -0.3, 0.2, -0.4]], dtype=torch.float64)[:, cols]
    logp = torch.full_like(lr, -1.0).requires_grad_()
    keys = torch.tensor([cols])
    m = torch.ones_like(lr, dtype=torch.bool)
    fn = build_policy_loss(AlgorithmConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean"))
    plan = fn.plan(MiniBatchInput(old_logp=logp.detach() - lr, advantages=torch.ones(1, dtype=torch.float64),
                                  mask=m, token_keys=keys), dp_group=cp, cp_group=cp)
    loss = fn(PolicyLossInput(logp=logp, old_logp=logp.detach() - lr, advantages=torch.ones(1, dtype=torch.float64),
                              mask=m, token_keys=keys, cp_group=cp, seq_num_tokens=sequence_token_counts(m, cp)),
              plan).loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp)
    out["gspo_loss"], out["gspo_grad"] = float(total), logp.grad.tolist()
    return out


def test_per_sequence_rules_and_gspo_are_exact_when_a_response_is_split():
    r0, r1 = run_on_ranks(_split, 2)
    # Rank 0 holds columns 0 and 2, rank 1 columns 1 and 3 (response 2's are padding there).
    assert r0["mis_sequence"] == [[0.0, 0.0], [1.32, 0.0]] and r1["mis_sequence"] == [[0.0, 0.0], [1.32, 0.0]]
    assert r0["geo_mask"] == [[0.0, 0.0], [1.0, 0.0]] and r1["geo_mask"] == [[0.0, 0.0], [1.0, 0.0]]
    # GSPO, A = +1, s = e^-0.1 below 1 - eps_lo: the unclipped -s; each token's gradient -s/4
    # (ds = s * mean_t dlogp_t over the whole response, not the rank's half).
    s = math.exp(-0.1)
    assert r0["gspo_loss"] == pytest.approx(-s, rel=1e-12) and r1["gspo_loss"] == pytest.approx(-s, rel=1e-12)
    for r in (r0, r1):
        assert r["gspo_grad"][0] == pytest.approx([-s / 4, -s / 4], rel=1e-12)


# ------------------------------------------------------------------------------------- config
def test_old_fields_map_onto_the_new_ones():
    corr, notes = resolve_off_policy(AlgorithmConfig(tis_cap=3.0))
    assert corr.rules == ("tis",) and corr.bounds.tis_cap == 3.0 and "algorithm.tis_cap is deprecated" in notes[0]
    corr, notes = resolve_off_policy(AlgorithmConfig(tis_cap=3.0), staleness=1, ratio_mask_low=0.25)
    assert corr.rules == ("tis", "band_mask") and (corr.bounds.band_low, corr.bounds.band_high) == (0.25, 2.0)
    assert len(notes) == 2 and all("\n" not in n for n in notes)
    # The asynchronous default is the band; an explicit choice wins; synchronous runs get none.
    assert resolve_off_policy(AlgorithmConfig(), staleness=2)[0].rules == ("band_mask",)
    assert resolve_off_policy(AlgorithmConfig(off_policy_correction="none"), staleness=2)[0].rules == ()
    assert resolve_off_policy(AlgorithmConfig())[0].rules == ()
    assert resolve_off_policy(AlgorithmConfig(off_policy_correction="geo_mask"))[0].rules == ("geo_mask",)


@pytest.mark.parametrize("cfg,needle", [
    (dict(off_policy_correction="icepop"), "algorithm.off_policy_correction must be 'none' or one of"),
    (dict(off_policy_correction="tis+mis_token"), "joins two weights or two masks"),
    (dict(off_policy_correction="tis", tis_cap=2.0), "algorithm.tis_cap (deprecated) and algorithm.off_policy_correction"),
    (dict(off_policy=OffPolicyConfig(tis_cap=0.5)), "algorithm.off_policy.tis_cap must be >= 1"),
    (dict(off_policy=OffPolicyConfig(mis_cap=0.9)), "algorithm.off_policy.mis_cap must be >= 1"),
    (dict(off_policy=OffPolicyConfig(band_low=0.0)), "algorithm.off_policy.band_low must be in (0, 1]"),
    (dict(off_policy=OffPolicyConfig(band_high=0.5)), "algorithm.off_policy.band_high must be >= 1"),
    (dict(off_policy=OffPolicyConfig(geo_cap=0.99)), "algorithm.off_policy.geo_cap must be >= 1"),
])
def test_bounds_are_checked_with_one_line_naming_the_field(cfg, needle):
    with pytest.raises(ValueError) as e:
        AlgorithmConfig(**cfg).validate()
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
