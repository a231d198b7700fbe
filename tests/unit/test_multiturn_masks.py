"""Loss masks honoured: tool / environment tokens go through the batch with mask 0, and no loss,
metric, candidate set or STARE selection sees them - even where they have the highest surprisal
of the batch. The losses and metrics equal those of the same batch with the tool tokens removed."""

from __future__ import annotations

import pytest
import torch

from megatron_stare.algorithms import AlgorithmConfig, MiniBatchInput, PolicyLossInput, StareState, build_policy_loss
from megatron_stare.algorithms.stare import candidate_sets, stare_global_selection, stare_k, stare_weights
from megatron_stare.testing.masked_case import compact_case, masked_case


def _run(policy_loss, variant, scope, case):
    old_logp, adv, mask, keys = case
    cfg = AlgorithmConfig(policy_loss=policy_loss)
    cfg.stare.variant, cfg.stare.selection_scope, cfg.stare.top_p = variant, scope, 0.3
    fn = build_policy_loss(cfg)
    plan = fn.plan(MiniBatchInput(old_logp, adv, mask, keys), stare_state=StareState(True, 1.3, 0.6))
    logp = (old_logp + 0.05 * torch.sin(torch.arange(old_logp.numel(), dtype=old_logp.dtype)
                                         ).view_as(old_logp)).requires_grad_(True)  # off-policy
    out = fn(PolicyLossInput(logp=logp, old_logp=old_logp, advantages=adv, mask=mask, token_keys=keys), plan)
    out.loss.backward()
    return out, logp.grad, plan


@pytest.mark.parametrize("variant", ["O1", "C2"])
@pytest.mark.parametrize("scope", ["global", "microbatch"])
def test_stare_never_selects_a_tool_token(variant, scope):
    old_logp, adv, mask, keys, tool = masked_case()
    assert tool.any() and not (tool & mask).any()
    # The tool tokens ARE the batch's most surprising: an unmasked top-k would take them all.
    assert (-old_logp)[tool].min() > (-old_logp)[mask].max()
    cfg = AlgorithmConfig().stare
    cfg.variant, cfg.selection_scope, cfg.top_p = variant, scope, 0.3
    sel = stare_global_selection(old_logp, adv, mask, keys, cfg) if scope == "global" else None
    w = stare_weights(-old_logp, adv, mask, keys, cfg, StareState(True, 1.3, 0.6), sel)
    chosen = w.pos_selected | w.neg_selected
    assert chosen.any() and not (chosen & tool).any()
    assert not ((w.pos_candidates | w.neg_candidates) & tool).any()
    assert (w.omega[tool] == 1).all()
    t_pos, t_neg = candidate_sets(adv, mask)
    if scope == "global":  # the global quantiles count model tokens only
        assert sel.k_pos == stare_k(int(t_pos.sum()), 0.3)
        assert sel.k_neg == (stare_k(int(t_neg.sum()), 0.3) if variant == "C2" else 0)


@pytest.mark.parametrize("policy_loss", ["vanilla", "stare", "clip_cov", "kl_cov"])
def test_losses_and_metrics_equal_the_batch_without_tool_tokens(policy_loss):
    old_logp, adv, mask, keys, tool = masked_case()
    full, grad, _ = _run(policy_loss, "C2", "global", (old_logp, adv, mask, keys))
    assert (grad[tool] == 0).all() and (grad[mask] != 0).any()
    # The same trained tokens without the tool tokens: their perturbation must line up too.
    lp, a, m, k = compact_case(old_logp, adv, mask, keys)
    cfg = AlgorithmConfig(policy_loss=policy_loss)
    cfg.stare.variant, cfg.stare.top_p = "C2", 0.3
    fn = build_policy_loss(cfg)
    plan = fn.plan(MiniBatchInput(lp, a, m, k), stare_state=StareState(True, 1.3, 0.6))
    pert = torch.zeros_like(old_logp)
    pert.view(-1)[:] = 0.05 * torch.sin(torch.arange(old_logp.numel(), dtype=old_logp.dtype))
    cpert = compact_case(pert, adv, mask, keys)[0]
    out = fn(PolicyLossInput(logp=lp + cpert, old_logp=lp, advantages=a, mask=m, token_keys=k), plan)
    assert full.loss.item() == pytest.approx(out.loss.item(), rel=1e-12, abs=1e-15)
    fm, cm = full.metrics.means(), out.metrics.means()
    assert set(fm) == set(cm)
    for name in fm:
        assert fm[name] == pytest.approx(cm[name], rel=1e-12, abs=1e-15), name
