"""Every policy loss on 2 gloo ranks (DP = 2, and CP = 2) equals the single-process result.

One spawned run covers all cases: gradients after a simulated averaging DDP (with
``backward_scale``), summed losses, globally reduced metrics and the STARE selected set.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_stare.algorithms import (
    MetricSums,
    global_token_mean,
    group_token_mean,
    MiniBatchInput,
    PolicyLossInput,
    backward_scale,
    build_policy_loss,
    sequence_token_counts,
)
from megatron_stare.algorithms.diagnostics import entropy_dynamics, sensitivity_stats
from megatron_stare.algorithms.stare import stare_weights
from megatron_stare.testing.distributed import run_on_ranks
from tests.unit.test_losses import all_configs, forward, make_batch, run_layout

pytestmark = pytest.mark.distributed

DP_ROWS = {0: [0, 3, 4, 5, 7], 1: [1, 2, 6]}  # uneven on purpose


def _reduce(grad, loss, metrics, world):
    dist.all_reduce(grad)
    grad /= world  # what an averaging DDP does
    t = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(t)
    return grad, t.item(), metrics.all_reduce(dist.group.WORLD).means()


def _gather_set(s):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, sorted(s) if s is not None else None)
    return None if out[0] is None else set().union(*map(set, out))


def _run_cp(cfg, b, state, cp_rank):
    """Both ranks hold all rows; rank r holds token columns [6r, 6r + 6) (CP = 2, DP = 1)."""
    group = dist.group.WORLD
    cols = slice(6 * cp_rank, 6 * cp_rank + 6)
    rows = list(range(8))
    fn = build_policy_loss(cfg)
    mb = MiniBatchInput(b["old_logp"][:, cols], b["adv"], b["mask"][:, cols], b["keys"][:, cols])
    plan = fn.plan(mb, dp_group=group, cp_group=group, step=3, stare_state=state)
    w = b["w0"].clone().requires_grad_(True)
    total, metrics, selected = 0.0, MetricSums(), set()
    for r in ([0, 1, 2], [3, 4, 5], [6, 7]):
        logp, ent = forward(w, b, r)
        mask = b["mask"][r][:, cols]
        inp = PolicyLossInput(logp=logp[:, cols], old_logp=b["old_logp"][r][:, cols], advantages=b["adv"][r],
                              mask=mask, token_keys=b["keys"][r][:, cols], entropy=ent[:, cols],
                              ref_logp=b["ref_logp"][r][:, cols], seq_num_tokens=sequence_token_counts(mask, group))
        out = fn(inp, plan)
        out.loss.backward()
        total += out.loss.item()
        metrics.merge(out.metrics)
        if cfg.policy_loss == "stare":
            wts = stare_weights(-inp.old_logp, inp.advantages, inp.mask, inp.token_keys, cfg.stare, state, plan.stare)
            selected |= set(inp.token_keys[wts.pos_selected | wts.neg_selected].tolist())
    return w.grad, total, metrics, (selected if cfg.policy_loss == "stare" else None)


def _global_stats(b, rows, group):
    """Global metrics of the old-log-prob pass: entropy mean, GEPO group entropies, diagnostics."""
    logits = b["feats"][rows] @ b["w0"]
    h, p2, p2lp = sensitivity_stats(logits)
    logp, _ = forward(b["w0"], b, rows)
    mask = b["mask"][rows]
    groups = torch.tensor(rows) // 2
    dyn = entropy_dynamics(logp, b["adv"][rows], mask, h, p2, p2lp, omega=1.0 + logp.detach().exp(), dp_group=group)
    return global_token_mean(h, mask, dp_group=group), group_token_mean(h, mask, groups, 4, dp_group=group), dyn


def _worker(rank, world):
    b = make_batch(seed=2)
    results = {"stats": _global_stats(b, DP_ROWS[rank], dist.group.WORLD)}
    for cid, cfg, state in all_configs():
        g, loss, metrics, sel = run_layout(cfg, b, DP_ROWS[rank], 2, dp_group=dist.group.WORLD, stare_state=state,
                                           scale=backward_scale(grad_reduce_divisor=world))
        g, loss, means = _reduce(g, loss, metrics, world)
        results[("dp", cid)] = (g, loss, means, _gather_set(sel))
        g, loss, metrics, sel = _run_cp(cfg, b, state, rank)
        dist.all_reduce(g)
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(t)
        results[("cp", cid)] = (g, t.item(), metrics.all_reduce(dist.group.WORLD).means(), _gather_set(sel))
    return results


def test_losses_match_single_process_under_dp2_and_cp2():
    out = run_on_ranks(_worker, 2, timeout=300)
    b = make_batch(seed=2)
    checked = 0
    for cid, cfg, state in all_configs():
        ref_g, ref_loss, ref_metrics, ref_sel = run_layout(cfg, b, range(8), 8, stare_state=state)
        ref_means = ref_metrics.means()
        for layout in ("dp", "cp"):
            for rank_out in out:
                g, loss, means, sel = rank_out[(layout, cid)]
                torch.testing.assert_close(g, ref_g, rtol=1e-12, atol=1e-14, msg=f"{layout} {cid}")
                assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-14), (layout, cid)
                assert means.keys() == ref_means.keys()
                for k, v in ref_means.items():
                    assert means[k] == pytest.approx(v, rel=1e-12, abs=1e-14), (layout, cid, k)
                assert sel == ref_sel, (layout, cid)
                checked += 1
    assert checked == 2 * 2 * len(all_configs())
    ref = _global_stats(b, list(range(8)), None)
    for rank_out in out:
        h, groups, dyn = rank_out["stats"]
        assert h == pytest.approx(ref[0], rel=1e-12)
        torch.testing.assert_close(groups, ref[1], rtol=1e-12, atol=0, equal_nan=True)
        for name, v in vars(ref[2]).items():
            assert getattr(dyn, name) == pytest.approx(v, rel=1e-12, abs=1e-15), name
