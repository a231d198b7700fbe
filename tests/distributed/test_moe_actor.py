"""One STARE update of a tiny Qwen3-MoE (8 experts, top-2, 2 MoE layers; ``MOE_SPEC``) is
layout-invariant: at EP2 (DP2 for the dense weights), EP2xTP2 (sequence parallel; EP spans the
TP ranks, expert-data-parallel 2), EP2xPP2, EP2xTP2 on 2 ranks (no data parallel) and DP2, each
with and without Megatron's distributed optimizer (over the data-parallel and the
expert-data-parallel groups), it gives the single process's loss, grad norm (1e-5 relative),
selected tokens, every metric (the per-layer expert load among them) and updated weights
(1e-6). With the router's load-balancing and z-losses on, the update and the logged loss
values equal one process where the micro-batches are the same (EP2xTP2 on 2 ranks: megatron's
aux loss is a per-micro-batch quantity, so data parallel changes it by definition): the loss,
the selection, the grad norm and the logged aux loss within 1e-4 relative, the z-loss within
1e-3. The updated weights do NOT (a known gap, an xfail below).

Same harness as ``test_actor_layouts.py`` (``run_actor_variants``: one spawn per set of
process groups, its variants in it)."""

import pytest

from megatron_stare.testing.actor_case import MOE_SPEC, run_actor_variants
from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.megatron_tiny import seeded_canonical

from tests.distributed.test_actor_layouts import assert_same_update, assert_tokens_seen_once

pytestmark = pytest.mark.distributed

MOE = {"spec": MOE_SPEC}
DISTOPT = {"distributed_optimizer": True}
AUX = {"moe_router_losses": (0.01, 0.001)}
#: name -> (world, tp, pp, ep, {variant: knobs})
RUNS = {
    "one": (1, 1, 1, 1, {"ref": MOE, "aux": dict(MOE, **AUX)}),
    "ep2": (2, 1, 1, 2, {"ref": MOE, "distopt": dict(MOE, **DISTOPT)}),
    "dp2": (2, 1, 1, 1, {"distopt": dict(MOE, **DISTOPT)}),
    "ep2tp2_w2": (2, 2, 1, 2, {"ref": MOE, "aux": dict(MOE, **AUX)}),
    "ep2tp2": (4, 2, 1, 2, {"ref": MOE, "distopt": dict(MOE, **DISTOPT)}),
    "ep2pp2": (4, 1, 2, 2, {"ref": MOE, "distopt": dict(MOE, **DISTOPT)}),
}


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def run(name):
        if name not in cache:
            world, tp, pp, ep, variants = RUNS[name]
            ranks = run_on_ranks(run_actor_variants, world, tp, pp, list(variants.values()), ep=ep)
            cache[name] = {v: [r[i] for r in ranks] for i, v in enumerate(variants)}
        return cache[name]

    return run


@pytest.fixture(scope="module")
def reference(runs):
    return runs("one")["ref"][0]


def test_reference_update_is_not_trivial(reference):
    assert reference["gate_on"] and len(reference["selected"]) > 0
    moved = [(w - seeded_canonical(n, w.shape)).abs().max().item() for n, w in reference["weights"].items()
             if ".experts.local_experts." in n]
    assert len(moved) == 2 * 8 * 2 and max(moved) > 5e-6, "the update did not move the experts"
    load = [v for k, v in reference["metrics"].items() if k.startswith("moe/") and k.endswith("load_max")]
    assert len(load) == 2 and all(v > 1.0 for v in load), reference["metrics"]


@pytest.mark.parametrize("name,variant", [(n, v) for n in RUNS if n != "one" for v in RUNS[n][4] if v != "aux"])
def test_moe_layouts_match_single_process(runs, reference, name, variant):
    world, tp, pp, ep, _ = RUNS[name]
    ranks = runs(name)[variant]
    for got in ranks:
        assert_same_update(reference, got)
    assert_tokens_seen_once(reference, ranks, tp * pp)


def test_router_losses_match_single_process(runs, reference):
    ref = runs("one")["aux"][0]
    assert ref["metrics"]["moe/aux_loss"] > 0 and ref["metrics"]["moe/z_loss"] > 0
    assert ref["loss"] == reference["loss"]  # the policy loss is logged without the router's
    assert any((ref["weights"][n] - w).abs().max() > 0 for n, w in reference["weights"].items()), \
        "the router losses changed no weight"
    for got in runs("ep2tp2_w2")["aux"]:
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert got["selected"] == ref["selected"]
        # Measured: grad norm 1.4e-5 relative apart (the z-loss is a per-rank token mean under
        # sequence parallel, and padding to the TP multiple is routed): 1e-4 here, not 1e-5.
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert got["metrics"]["moe/aux_loss"] == pytest.approx(ref["metrics"]["moe/aux_loss"], rel=1e-4)
        # The z-loss is a mean over the router's tokens, and megatron routes the row's padding
        # to the TP multiple as well: measured 1.9e-4 relative apart here.
        assert got["metrics"]["moe/z_loss"] == pytest.approx(ref["metrics"]["moe/z_loss"], rel=1e-3)


@pytest.mark.xfail(strict=True, reason="known gap: with the router losses on, megatron's aux/z-loss "
                   "gradients at TP2 + sequence parallel move the weights ~one Adam step (2e-5) away "
                   "from one process (aux loss alone too); the loss values agree")
def test_router_loss_gradients_match_single_process(runs):
    ref = runs("one")["aux"][0]
    for got in runs("ep2tp2_w2")["aux"]:
        for n, w in ref["weights"].items():
            assert (w - got["weights"][n]).abs().max().item() <= 1e-6, n
