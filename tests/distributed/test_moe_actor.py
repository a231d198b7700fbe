"""One STARE update of a tiny Qwen3-MoE (8 experts, top-2, 2 MoE layers; ``MOE_SPEC``) is
layout-invariant: at EP2 (DP2 for the dense weights), EP2xTP2 (sequence parallel; EP spans the
TP ranks, expert-data-parallel 2), EP2xPP2, EP2xTP2 on 2 ranks (no data parallel), EP2xCP2 and
DP2, each with and without Megatron's distributed optimizer (over the data-parallel and the
expert-data-parallel groups), it gives the single process's loss, grad norm (1e-5 relative),
selected tokens, every metric (the per-layer expert load among them: under CP it counted the
padding in each rank's chunks of the slots, layer 0's load_max 1.45 at EP2xCP2 against one
process's 1.29) and updated weights (1e-6). With the router's load-balancing and z-losses on, the update (loss, grad norm,
selection, every metric and the logged aux and z-loss values, weights within 1e-6) equals one
process's where the micro-batches are the same (EP2xTP2 on 2 ranks: megatron's aux loss is a
per-micro-batch quantity, so data parallel changes it by definition). Two things made it so
(measured before: the weights 2e-5 apart): the row's padding to the TP multiple is now masked
out of the router's losses (``actor.schedule._row_padding``; it was routed and counted, 5% of
the aux-loss gradient), and the z-loss is the micro-batch's token mean under sequence parallel
(``models.moe_router``; megatron's per-rank mean is 0.5% off when the ranks hold unequal counts
of real tokens: shown by a variant with megatron's own z-loss).

Same harness as ``test_actor_layouts.py`` (``run_actor_variants``: one spawn per set of
process groups, its variants in it)."""

import dataclasses

import pytest

from megatron_stare.models.gpt import MoESpec
from megatron_stare.testing.actor_case import MOE_SPEC, run_actor_variants
from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.megatron_tiny import seeded_canonical

from tests.distributed.test_actor_layouts import assert_same_update, assert_tokens_seen_once

pytestmark = pytest.mark.distributed

MOE = {"spec": MOE_SPEC}
#: Another shape: Qwen2-MoE's attention, a dense first layer, 6 experts top-3 unnormalised, a
#: gated shared expert of another width than the routed experts'.
SHARED = {"spec": dataclasses.replace(MOE_SPEC, architecture="qwen2_moe", add_qkv_bias=True, qk_layernorm=False,
                                      moe=MoESpec(num_experts=6, topk=3, ffn_hidden_size=16, layer_pattern=(0, 1),
                                                  norm_topk_prob=False, shared_expert_size=24, shared_expert_gate=True))}
DISTOPT = {"distributed_optimizer": True}
AUX = {"moe_router_losses": (0.01, 0.001)}
#: name -> (world, tp, pp, cp, ep, {variant: knobs})
RUNS = {
    "one": (1, 1, 1, 1, 1, {"ref": MOE, "shared": SHARED, "aux": dict(MOE, **AUX)}),
    "ep2": (2, 1, 1, 1, 2, {"ref": MOE, "distopt": dict(MOE, **DISTOPT), "shared": SHARED}),
    "dp2": (2, 1, 1, 1, 1, {"distopt": dict(MOE, **DISTOPT)}),
    # (the variants without router losses first: megatron's tracker keeps a loss's name once on)
    "ep2tp2_w2": (2, 2, 1, 1, 2, {"ref": MOE, "shared": SHARED, "aux": dict(MOE, **AUX),
                                  "megatron_z": dict(MOE, **AUX, megatron_z_loss=True)}),
    "ep2tp2": (4, 2, 1, 1, 2, {"ref": MOE, "distopt": dict(MOE, **DISTOPT)}),
    "ep2pp2": (4, 1, 2, 1, 2, {"ref": MOE, "distopt": dict(MOE, **DISTOPT)}),
    "ep2cp2": (4, 1, 1, 2, 2, {"ref": MOE}),
}


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def run(name):
        if name not in cache:
            world, tp, pp, cp, ep, variants = RUNS[name]
            ranks = run_on_ranks(run_actor_variants, world, tp, pp, list(variants.values()), cp=cp, ep=ep)
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


@pytest.mark.parametrize("name,variant", [(n, v) for n in RUNS if n != "one" for v in RUNS[n][5] if v in ("ref", "distopt")])
def test_moe_layouts_match_single_process(runs, reference, name, variant):
    world, tp, pp, cp, ep, _ = RUNS[name]
    ranks = runs(name)[variant]
    for got in ranks:
        assert_same_update(reference, got)
    assert_tokens_seen_once(reference, ranks, tp * pp)


@pytest.mark.parametrize("name", ["ep2", "ep2tp2_w2"])
def test_shared_expert_shape_matches_single_process(runs, name):
    ref = runs("one")["shared"][0]
    assert len([n for n in ref["weights"] if ".experts.local_experts." in n]) == 6 * 2
    assert any(".shared_experts.gate_weight" in n for n in ref["weights"])
    ranks = runs(name)["shared"]
    for got in ranks:
        assert_same_update(ref, got)
    assert_tokens_seen_once(ref, ranks, RUNS[name][1])


def test_router_losses_match_single_process(runs, reference):
    ref = runs("one")["aux"][0]
    assert ref["metrics"]["moe/aux_loss"] > 0 and ref["metrics"]["moe/z_loss"] > 0
    assert ref["loss"] == reference["loss"]  # the policy loss is logged without the router's
    assert any((ref["weights"][n] - w).abs().max() > 0 for n, w in reference["weights"].items()), \
        "the router losses changed no weight"
    ranks = runs("ep2tp2_w2")["aux"]
    for got in ranks:
        assert_same_update(ref, got)  # the logged moe/aux_loss and moe/z_loss among the metrics
    assert_tokens_seen_once(ref, ranks, 2)


def test_megatron_z_loss_differs_from_one_process_under_sequence_parallel(runs):
    """What ``models.moe_router`` fixes: megatron's per-rank z-loss mean (109 and 108 real
    tokens on the two TP ranks) moves the weights away from one process."""
    ref = runs("one")["aux"][0]
    for got in runs("ep2tp2_w2")["megatron_z"]:
        worst = max((w - got["weights"][n]).abs().max().item() for n, w in ref["weights"].items())
        assert worst > 1e-6, worst
