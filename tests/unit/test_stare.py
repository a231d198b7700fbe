"""STARE: hand case, k(n), controller, invariants, selection scopes, independent re-implementation."""

import math

import pytest
import torch

from megatron_stare.algorithms import (
    AlgorithmConfig,
    MiniBatchInput,
    PolicyLossInput,
    StareConfig,
    StareController,
    StareState,
    build_policy_loss,
    stare_k,
)
from megatron_stare.algorithms.stare import stare_global_selection, stare_weights
from tests.unit.test_losses import make_batch, run_layout

D64 = torch.float64


def hand_case():
    """Seq 1: A=+1, surprisal 0.1..1.0; seq 2: A=-1, 10 tokens; seq 3: A=0, 5 tokens (N = 25)."""
    s = torch.zeros(3, 10, dtype=D64)
    s[0] = torch.arange(1, 11, dtype=D64) / 10
    s[1] = torch.arange(1, 11, dtype=D64) / 10
    s[2, :5] = 0.5
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[:2] = True
    mask[2, :5] = True
    adv = torch.tensor([1.0, -1.0, 0.0], dtype=D64)
    keys = (torch.arange(3)[:, None] * 10 + torch.arange(10)[None, :]).to(torch.int64)
    return -s, adv, mask, keys


def hand_loss(policy_loss, variant="O1", gate_on=True, w=1.1, m=0.9, scope="global"):
    old_logp, adv, mask, keys = hand_case()
    cfg = AlgorithmConfig(policy_loss=policy_loss)
    cfg.stare.variant, cfg.stare.selection_scope = variant, scope
    fn = build_policy_loss(cfg)
    plan = fn.plan(MiniBatchInput(old_logp, adv, mask, keys), stare_state=StareState(gate_on, w, m))
    logp = old_logp.clone().requires_grad_(True)  # on-policy: rho = 1
    out = fn(PolicyLossInput(logp=logp, old_logp=old_logp, advantages=adv, mask=mask, token_keys=keys), plan)
    out.loss.backward()
    return out, logp.grad, plan


def test_hand_case_losses_and_ratios():
    grpo, _, _ = hand_loss("vanilla")
    assert grpo.loss.item() == pytest.approx(0.0, abs=1e-15)
    for scope in ("global", "microbatch"):
        o1, _, _ = hand_loss("stare", "O1", scope=scope)
        c2, _, _ = hand_loss("stare", "C2", scope=scope)
        assert o1.loss.item() == pytest.approx(-0.004, abs=1e-12)
        assert c2.loss.item() == pytest.approx(-0.008, abs=1e-12)
        m = o1.metrics.means()
        assert m["stare/positive_candidate_ratio"] == pytest.approx(0.4)
        assert m["stare/negative_candidate_ratio"] == pytest.approx(0.4)
        assert m["stare/positive_reweight_ratio"] == pytest.approx(0.04)
        assert m["stare/negative_reweight_ratio"] == 0.0
        assert m["stare/mean_weight"] == pytest.approx(1.004)
        m2 = c2.metrics.means()
        assert m2["stare/negative_reweight_ratio"] == pytest.approx(0.04)
        assert m2["stare/mean_weight"] == pytest.approx(1.0)


def test_hand_case_selects_highest_surprisal_and_threshold_is_plain_data():
    _, grad, plan = hand_loss("stare", "C2")
    # Only the surprisal-1.0 tokens (position 9) of seq 1 and seq 2 are reweighted.
    assert grad[0, 9].item() == pytest.approx(-1.1 / 25) and grad[1, 9].item() == pytest.approx(0.9 / 25)
    assert grad[0, :9].eq(-1 / 25).all() and grad[1, :9].eq(1 / 25).all() and grad[2].eq(0).all()
    assert isinstance(plan.stare.pos.value, float) and plan.stare.k_pos == 1 and plan.stare.k_neg == 1


@pytest.mark.parametrize("n,p,k", [(0, 0.1, 0), (10, 0.0, 0), (1, 0.1, 1), (5, 0.1, 1), (10, 0.1, 1), (11, 0.1, 2),
                                   (30, 0.1, 3), (100, 0.1, 10), (101, 0.1, 11), (7, 1.0, 7), (3, 0.5, 2)])
def test_k_of_n(n, p, k):
    assert stare_k(n, p) == k


def test_controller_transitions():
    c = StareController(StareConfig())
    assert not c.state.gate_on
    assert not c.update(0.35).gate_on
    assert c.update(0.29).gate_on
    assert not c.update(0.30).gate_on  # strict
    c.update(0.29)
    before = c.state_dict()
    c.update(float("nan"))
    c.update(float("inf"))
    assert c.state_dict() == before and c.state.gate_on
    assert (c.state.w, c.state.m) == (1.1, 0.9)  # not adaptive


def test_adaptive_schedule_and_clipping():
    c = StareController(StareConfig(adaptive=True))
    s = c.update(0.29)
    assert (s.w, s.m) == (pytest.approx(1.11), pytest.approx(0.89))
    s = c.update(0.30)  # sign(0) = 0: unchanged
    assert (s.w, s.m) == (pytest.approx(1.11), pytest.approx(0.89))
    c.update(0.5)
    c.update(0.5)
    assert (c.state.w, c.state.m) == (pytest.approx(1.09), pytest.approx(0.91))
    c = StareController(StareConfig(adaptive=True, w=1.495, m=0.505))
    c.update(0.0)
    assert (c.state.w, c.state.m) == (1.5, 0.5)
    c = StareController(StareConfig(adaptive=True, w=1.005, m=0.995))
    c.update(1.0)
    assert (c.state.w, c.state.m) == (1.0, 1.0)


def test_controller_state_dict_round_trip():
    a = StareController(StareConfig(adaptive=True))
    a.update(0.1)
    b = StareController(StareConfig(adaptive=True))
    b.load_state_dict(a.state_dict())
    assert b.state == a.state and b.update(0.2) == a.update(0.2)


@pytest.mark.parametrize("variant", ["O1", "C2"])
@pytest.mark.parametrize("scope", ["global", "microbatch"])
def test_gate_off_or_unit_weights_is_bitwise_plain_surrogate(variant, scope):
    b = make_batch(seed=5)
    plain = AlgorithmConfig()
    g0, l0, _, _ = run_layout(plain, b, range(8), 3)
    cfg = AlgorithmConfig(policy_loss="stare")
    cfg.stare.variant, cfg.stare.selection_scope, cfg.stare.top_p = variant, scope, 0.5
    for state in (StareState(False, 1.3, 0.7), StareState(True, 1.0, 1.0)):
        g, l, _, _ = run_layout(cfg, b, range(8), 3, stare_state=state)
        assert torch.equal(g, g0) and l == l0
    g, l, _, sel = run_layout(cfg, b, range(8), 3, stare_state=StareState(True, 1.3, 0.7))
    assert not torch.equal(g, g0) and sel


def test_omega_is_detached_and_scales_token_gradients():
    b = make_batch(seed=6)
    rows = list(range(8))
    cfg = AlgorithmConfig(policy_loss="stare")
    cfg.stare.variant, cfg.stare.selection_scope, cfg.stare.top_p = "C2", "microbatch", 0.3
    state = StareState(True, 1.4, 0.6)
    grads = []
    for c in (AlgorithmConfig(), cfg):
        logp = (b["old_logp"] + 0.05).requires_grad_(True)
        fn = build_policy_loss(c)
        plan = fn.plan(MiniBatchInput(b["old_logp"], b["adv"], b["mask"], b["keys"]), stare_state=state)
        fn(PolicyLossInput(logp=logp, old_logp=b["old_logp"], advantages=b["adv"], mask=b["mask"], token_keys=b["keys"]), plan).loss.backward()
        grads.append(logp.grad)
    wts = stare_weights(-(b["old_logp"] + 0.05), b["adv"], b["mask"], b["keys"], cfg.stare, state)
    assert not wts.omega.requires_grad
    torch.testing.assert_close(grads[1], grads[0] * wts.omega, rtol=0, atol=1e-15)
    assert (wts.omega > 0).all()


def crafted_split_case():
    """T+ = 20 tokens: rows 0-1 hold surprisal 0.9.., rows 2-3 hold 0.1..; P = 0.1 -> k = 2."""
    n, t = 4, 5
    s = torch.zeros(n, t, dtype=D64)
    s[:2] = 0.9 + torch.arange(10, dtype=D64).reshape(2, 5) / 100
    s[2:] = 0.1 + torch.arange(10, dtype=D64).reshape(2, 5) / 100
    keys = (torch.arange(n)[:, None] * t + torch.arange(t)).to(torch.int64)
    return -s, torch.ones(n, dtype=D64), torch.ones(n, t, dtype=torch.bool), keys


@pytest.mark.parametrize("scope,same", [("global", True), ("microbatch", False)])
def test_selected_set_vs_microbatch_split(scope, same):
    old_logp, adv, mask, keys = crafted_split_case()
    cfg = StareConfig(selection_scope=scope)
    state = StareState(True, 1.1, 0.9)
    sel = stare_global_selection(old_logp, adv, mask, keys, cfg) if scope == "global" else None
    sets = []
    for mbs in (4, 2):
        chosen = set()
        for i in range(0, 4, mbs):
            r = slice(i, i + mbs)
            w = stare_weights(-old_logp[r], adv[r], mask[r], keys[r], cfg, state, sel)
            chosen |= set(keys[r][w.pos_selected].tolist())
        sets.append(chosen)
    assert (sets[0] == sets[1]) == same
    assert sets[0] == {8, 9}  # the whole-batch top-2


def reference_weights(s, adv, mask, keys, p, w, m, variant):
    """Straight from the formula: sort candidates by (-surprisal, key), take the first k(n)."""
    omega = torch.ones_like(s)
    a = adv[:, None].expand_as(s)
    sets = [(a > 0) & mask, (a < 0) & mask] if variant == "C2" else [(a > 0) & mask]
    for cand, weight in zip(sets, (w, m)):
        items = sorted((-s[i, j].item(), keys[i, j].item(), i, j) for i, j in cand.nonzero().tolist())
        n = len(items)
        k = 0 if n == 0 or p == 0 else min(n, max(1, math.ceil(round(n * p, 9))))
        for _, _, i, j in items[:k]:
            omega[i, j] = weight
    return omega


@pytest.mark.parametrize("seed", range(6))
def test_microbatch_weights_match_independent_implementation(seed):
    g = torch.Generator().manual_seed(seed)
    bsz, t = 6, 9
    s = torch.round(torch.rand(bsz, t, generator=g, dtype=D64) * 10) / 10  # many ties -> key rule
    adv = torch.randint(-1, 2, (bsz,), generator=g).to(D64)
    mask = torch.rand(bsz, t, generator=g) < 0.8
    keys = torch.randperm(1000, generator=g)[: bsz * t].reshape(bsz, t).to(torch.int64)
    for p in (0.1, 0.25, 0.37, 1.0):
        for variant in ("O1", "C2"):
            cfg = StareConfig(variant=variant, top_p=p, selection_scope="microbatch")
            got = stare_weights(s, adv, mask, keys, cfg, StareState(True, 1.2, 0.8)).omega
            torch.testing.assert_close(got, reference_weights(s, adv, mask, keys, p, 1.2, 0.8, variant), rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(3))
def test_global_weights_match_independent_implementation(seed):
    """Global scope: both thresholds of C2 come from one batched selection (k from each set's
    global count); the weights equal the formula's."""
    g = torch.Generator().manual_seed(100 + seed)
    bsz, t = 7, 8
    s = torch.round(torch.rand(bsz, t, generator=g, dtype=D64) * 10) / 10  # many ties -> key rule
    adv = torch.randint(-1, 2, (bsz,), generator=g).to(D64)
    mask = torch.rand(bsz, t, generator=g) < 0.8
    keys = torch.randperm(1000, generator=g)[: bsz * t].reshape(bsz, t).to(torch.int64)
    for p in (0.1, 0.37, 1.0):
        for variant in ("O1", "C2"):
            cfg = StareConfig(variant=variant, top_p=p, selection_scope="global")
            sel = stare_global_selection(-s, adv, mask, keys, cfg)
            got = stare_weights(s, adv, mask, keys, cfg, StareState(True, 1.2, 0.8), sel).omega
            want = reference_weights(s, adv, mask, keys, p, 1.2, 0.8, variant)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_plan_requires_controller_state():
    old_logp, adv, mask, keys = hand_case()
    with pytest.raises(ValueError, match="stare_state"):
        build_policy_loss(AlgorithmConfig(policy_loss="stare")).plan(MiniBatchInput(old_logp, adv, mask, keys))
