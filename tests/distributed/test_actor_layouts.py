"""One STARE update of the Megatron actor is layout-invariant: at every (TP, PP, CP, DP) and
micro-batch split, with packed or padded micro-batches, it gives the single process's loss,
grad norm, selected tokens and updated weights (fp32). lr is 1e-5 (RL scale): Adam turns any
gradient into a step of ~lr, so the weight tolerance 1e-6 is a tenth of a step, and the test
checks the step really happened. The same holds with sequence parallel (micro-batches padded
to a multiple of TP, the padding masked out), context parallel (Megatron's load-balanced
chunks; packed sequences each padded to 2*CP) and Megatron's distributed optimizer; bf16 with
the distributed optimizer agrees with fp32 within a stated bf16 tolerance.

Spawning ranks and importing megatron-core costs ~20 s per process, a tiny case under a
second: every run here computes its variants (packed and padded, ...) in one spawn
(``run_actor_variants``), cached for the module."""

import math

import pytest
import torch

from megatron_stare.config.algorithm import (CispoConfig, ClipCovConfig, ForkingTokensConfig, GspoConfig, KLCovConfig,
                                             OffPolicyConfig)
from megatron_stare.testing.actor_case import run_actor_variants
from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.megatron_tiny import CLUSTER_LAYOUT_IDS, seeded_canonical

pytestmark = pytest.mark.distributed

PADDED = {"pack_sequences": False}
SP, DISTOPT = {"sequence_parallel": True}, {"distributed_optimizer": True}
#: The losses beyond STARE's token-mean, one process against CP2, where a sequence's tokens
#: (so its per-sequence counts, and the candidates of a global selection) span the CP ranks:
#: each aggregation mode with per-sequence counts, the entropy bonus's gradient, a KL term on a
#: reference model's log-prob pass, Clip-Cov's and KL-Cov's global selections.
LOSSES = {
    "seq_mean": {"algorithm": {"loss_agg_mode": "seq-mean-token-mean"}},
    "seq_sum_kl": {"algorithm": {"loss_agg_mode": "seq-mean-token-sum", "kl_loss_coef": 0.1,
                                 "entropy_coeff": 0.01}},
    "seq_sum_norm": {"algorithm": {"loss_agg_mode": "seq-mean-token-sum-norm", "seq_mean_norm_const": 24.0}},
    "clip_cov": {"policy_loss": "clip_cov",
                 "algorithm": {"clip_cov": ClipCovConfig(ratio=0.2, lb=-math.inf, ub=math.inf)}},
    "kl_cov": {"policy_loss": "kl_cov", "algorithm": {"kl_cov": KLCovConfig(ratio=0.1)}},
}
#: The baselines and off-policy corrections of issue 31. GSPO (per-sequence ratio, wider eps so
#: some responses clip and some do not), sequence MIS and the geometric mask reduce per-sequence
#: sums over the CP ranks; forking tokens is a global entropy quantile. The corrections read
#: behaviour log-probs that differ from the trainer's (``engine_logp``), with bounds that mask
#: some tokens and keep others.
OFF = OffPolicyConfig(tis_cap=1.5, mis_cap=1.8, geo_cap=1.15)
NEW = {
    "gspo": {"policy_loss": "gspo", "algorithm": {"loss_agg_mode": "seq-mean-token-mean",
                                                  "gspo": GspoConfig(clip_ratio_low=0.01, clip_ratio_high=0.01)}},
    "cispo": {"policy_loss": "cispo", "algorithm": {"cispo": CispoConfig(clip_ratio_high=0.02, clip_ratio_low=0.02)}},
    "forking": {"policy_loss": "forking_tokens", "algorithm": {"forking_tokens": ForkingTokensConfig(rho=0.3)}},
    "forking_sel": {"policy_loss": "forking_tokens",
                    "algorithm": {"forking_tokens": ForkingTokensConfig(rho=0.3, normalizer="selected")}},
    **{name: {"policy_loss": "vanilla", "engine_logp": True,
              "algorithm": {"off_policy_correction": rule, "off_policy": OFF}}
       for name, rule in (("tis_band", "tis+band_mask"), ("mis_token", "mis_token"),
                          ("mis_seq", "mis_sequence"), ("geo", "geo_mask"))},
}
#: The per-sequence and selection ones, also at 1, 2 and 4 rows per micro-batch.
PER_SEQUENCE = ("gspo", "mis_seq", "geo", "forking")
LOSSES.update(NEW)


#: On-policy steps, with the separate log-prob pass and with the update's forward standing in
#: for it (``trainer.logprob_pass`` auto): the plain surrogate, a KL term on a reference model
#: with a masking off-policy correction on behaviour log-probs, and GSPO's per-sequence ratio.
ON_POLICY = {"vanilla": {"policy_loss": "vanilla"},
             "kl_tis": {"policy_loss": "vanilla", "engine_logp": True,
                        "algorithm": {"kl_loss_coef": 0.1, "off_policy_correction": "tis+band_mask",
                                      "off_policy": OFF}},
             "gspo": NEW["gspo"]}
ON_POLICY_RUNS = {f"onpolicy_{name}/{mode}": dict(knobs, on_policy=True, logprob_pass=mode == "pass")
                  for name, knobs in ON_POLICY.items() for mode in ("pass", "fused")}


def both(name: str, **knobs) -> dict:
    """The variant ``name`` packed (the default) and ``name/padded``."""
    return {name: knobs, f"{name}/padded": dict(knobs, **PADDED)}


#: One spawn per set of process groups: name -> (world, tp, pp, cp, {variant: knobs}).
RUNS = {
    "one": (1, 1, 1, 1, {**both("ref"), **both("rows1", max_rows=1), **both("rows2", max_rows=2),
                         **both("rows4", max_rows=4), **both("two_mini", mini_batches=2, max_rows=3),
                         "stare_gate_off": {"policy_loss": "stare", "target_entropy": 0.0},
                         "grpo": {"policy_loss": "vanilla", "target_entropy": 0.0},
                         "lr4": {"lr": 1e-4}, **LOSSES,
                         **{f"{n}/rows{r}": dict(NEW[n], max_rows=r) for n in PER_SEQUENCE for r in (1, 2, 4)},
                         **ON_POLICY_RUNS}),
    "tp2": (2, 2, 1, 1, {**both("ref"), **both("sp", **SP), **both("sp_rows1", max_rows=1, **SP), **NEW,
                         **ON_POLICY_RUNS}),
    "pp2": (2, 1, 2, 1, {**both("ref"), "poisoned": {"poison_advantage": True}, **NEW, **ON_POLICY_RUNS}),
    "dp2": (2, 1, 1, 1, {**both("ref"), **both("two_mini", mini_batches=2, max_rows=3),
                         **both("distopt", **DISTOPT), "bf16": {"lr": 1e-4, "dtype": torch.bfloat16, **DISTOPT},
                         **NEW, **ON_POLICY_RUNS}),
    "cp2": (2, 1, 1, 2, {**both("ref"), **{k: v for name, knobs in LOSSES.items() for k, v in both(name, **knobs).items()}}),
    "tp2pp2": (4, 2, 2, 1, both("ref")),
    "tp2dp2": (4, 2, 1, 1, both("sp_distopt", **SP, **DISTOPT)),
    "tp2cp2": (4, 2, 1, 2, {**both("ref"), **both("sp", **SP)}),
    "pp2cp2": (4, 1, 2, 2, both("ref")),  # the 32B recipe's PP2 x CP2
}


@pytest.fixture(scope="module")
def runs():
    """``runs(name)`` -> ``{variant: [result of each rank]}`` of ``RUNS[name]``, cached."""
    cache = {}

    def run(name):
        if name not in cache:
            world, tp, pp, cp, variants = RUNS[name]
            ranks = run_on_ranks(run_actor_variants, world, tp, pp, list(variants.values()), cp=cp)
            cache[name] = {v: [r[i] for r in ranks] for i, v in enumerate(variants)}
        return cache[name]

    return run


@pytest.fixture(scope="module")
def reference(runs):
    return runs("one")["ref"][0]


def rel(a, b):
    return abs(a - b) / max(abs(a), 1e-12)


def assert_same_update(ref, got):
    assert len(ref["loss"]) == len(got["loss"])
    for a, b in zip(ref["loss"], got["loss"]):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (ref["loss"], got["loss"])
    for a, b in zip(ref["grad_norm"], got["grad_norm"]):
        assert abs(a - b) <= 1e-5 * abs(a), (ref["grad_norm"], got["grad_norm"])
    assert got["selected"] == ref["selected"], "STARE selected a different token set"
    assert got["num_tokens"] == ref["num_tokens"]
    for name, w in ref["weights"].items():
        diff = (w - got["weights"][name]).abs().max().item()
        assert diff <= 1e-6, f"{name} differs by {diff}"
    assert ref["metrics"].keys() == got["metrics"].keys()
    for k, a in ref["metrics"].items():  # every metric: token-mean ratios, selection fractions
        assert abs(a - got["metrics"][k]) <= 1e-6 * max(1.0, abs(a)), (k, a, got["metrics"][k])


def assert_tokens_seen_once(ref, ranks, replicas):
    """Over a run's ranks, every response token's log-prob is computed on exactly ``replicas``
    ranks (the TP x PP ranks that share its data/context shard) and equals the reference's."""
    seen = [key for r in ranks for key in r["logp"]]
    assert sorted(set(seen)) == sorted(ref["logp"]) and len(seen) == replicas * len(ref["logp"])
    for r in ranks:
        worst = max(rel(ref["logp"][k], v) for k, v in r["logp"].items())
        assert worst <= 1e-5, worst


def assert_packed_equals_padded(packed_ranks, padded_ranks):
    """Packed and padded micro-batches on the same ranks: log-probs and entropies per token
    (over all ranks: under CP the two split a sequence at different places), loss and gradients
    to 1e-6 relative, the same STARE selection, and fewer tokens computed packed."""
    for name in ("logp", "token_entropy"):
        packed = {k: v for r in packed_ranks for k, v in r[name].items()}
        padded = {k: v for r in padded_ranks for k, v in r[name].items()}
        assert packed.keys() == padded.keys()
        worst = max(rel(padded[k], v) for k, v in packed.items())
        assert worst <= 1e-6, (name, worst)
    for packed, padded in zip(packed_ranks, padded_ranks):
        for a, b in zip(padded["loss"], packed["loss"]):
            assert rel(a, b) <= 1e-6
        scale = max(g.abs().max().item() for g in padded["grads"].values())
        worst = max((g - packed["grads"][n]).abs().max().item() for n, g in padded["grads"].items()) / scale
        assert worst <= 1e-6, worst
        assert packed["selected"] == padded["selected"]
        assert packed["tokens"] < padded["tokens"], "packing computed no fewer tokens"


def test_reference_update_is_not_trivial(reference):
    assert reference["gate_on"] and len(reference["selected"]) > 0
    moved = [(w - seeded_canonical(n, w.shape)).abs().max().item() for n, w in reference["weights"].items()]
    assert max(moved) > 5e-6, "the update did not move the weights"
    assert 0 < reference["metrics"]["stare/positive_reweight_ratio"] < reference["metrics"]["stare/positive_candidate_ratio"]


@pytest.mark.parametrize("name", ["tp2", "pp2", "dp2", "tp2pp2", "cp2", "tp2cp2", "pp2cp2"])
def test_layouts_match_single_process(runs, reference, name):
    """TP2, PP2, DP2, TP2xPP2, CP2, TP2xCP2 and PP2xCP2, packed and padded; every token once."""
    world, tp, pp, cp, _ = RUNS[name]
    for variant in ("ref", "ref/padded"):
        ranks = runs(name)[variant]
        for got in ranks:
            assert_same_update(reference, got)
        assert_tokens_seen_once(reference, ranks, tp * pp)


def test_context_parallel_with_sequence_parallel_pads_odd_lengths(runs, reference):
    """TP2+SP+CP2 (4 ranks): the case's sequences have odd lengths; packed, each is padded to a
    multiple of 2*CP and the row to 2*CP*TP, padded rows to 2*CP*TP; no number changes."""
    assert reference["widths"][0] % 2, "the case has no odd length to pad"
    for variant in ("sp", "sp/padded"):
        ranks = runs("tp2cp2")[variant]
        for got in ranks:
            assert_same_update(reference, got)
            assert all(w * 2 % 8 == 0 for w in got["widths"])  # local widths x CP
        assert_tokens_seen_once(reference, ranks, 2)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_sees_each_token_once_under_context_parallel(runs, name):
    """Each of ``LOSSES`` at CP2, packed and padded, equals one process: loss, grad norm,
    weights, every metric, and the log-prob pass's tokens each computed on one rank."""
    ref = runs("one")[name][0]
    assert ref["loss"] != runs("one")["ref"][0]["loss"]
    # The selections and the KL term are not empty (a trivial case would prove nothing).
    nonzero = {"clip_cov": "clip_cov/frac", "kl_cov": "kl_cov/frac", "seq_sum_kl": "kl_loss", "gspo": "pg_clipfrac",
               "cispo": "pg_clipfrac", "forking": "forking/kept_frac", "forking_sel": "forking/kept_frac",
               **{n: "off_policy/masked_frac" for n in ("tis_band", "mis_token", "mis_seq", "geo")}}
    if name in nonzero:
        assert 0 < ref["metrics"][nonzero[name]] < 1, ref["metrics"]
    for variant in (name, f"{name}/padded"):
        ranks = runs("cp2")[variant]
        for got in ranks:
            assert_same_update(ref, got)
        assert_tokens_seen_once(ref, ranks, 1)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_new_losses_and_corrections_match_single_process(runs, layout):
    """GSPO, CISPO, forking tokens (both normalisers) and the off-policy corrections at TP2, PP2
    and DP2 (packed) equal one process; CP2, packed and padded, is in the test above."""
    for name in NEW:
        for got in runs(layout)[name]:
            assert_same_update(runs("one")[name][0], got)


@pytest.mark.parametrize("name", PER_SEQUENCE)
def test_new_per_sequence_losses_match_at_every_micro_batch_size(runs, name):
    ref = runs("one")[name][0]
    for rows in (1, 2, 4):
        assert_same_update(ref, runs("one")[f"{name}/rows{rows}"][0])


def test_new_losses_differ_from_the_base_loss(runs):
    """Each new loss and correction changes the update (a no-op would pass every layout test)."""
    base = runs("one")["grpo"][0]["loss"]
    for name in NEW:
        assert runs("one")[name][0]["loss"] != base, name


@pytest.mark.parametrize("name,variant", [("one", "ref"), ("tp2", "sp"), ("cp2", "ref")],
                         ids=["one_rank", "tp2_sp", "cp2"])
def test_packed_equals_padded(runs, name, variant):
    results = runs(name)
    assert_packed_equals_padded(results[variant], results[f"{variant}/padded"])


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_micro_batch_sizes_match(runs, reference, rows):
    for variant in (f"rows{rows}", f"rows{rows}/padded"):
        assert_same_update(reference, runs("one")[variant][0])


def test_two_mini_batches_match_across_layouts(runs):
    ref = runs("one")["two_mini"][0]
    assert len(ref["loss"]) == 2
    for variant in ("two_mini", "two_mini/padded"):
        for got in runs("one")[variant] + runs("dp2")[variant]:
            assert_same_update(ref, got)


def test_grpo_equals_stare_with_gate_off(runs):
    stare, grpo = runs("one")["stare_gate_off"][0], runs("one")["grpo"][0]
    assert not stare["gate_on"]
    assert stare["loss"] == grpo["loss"] and stare["grad_norm"] == grpo["grad_norm"]
    for name, w in grpo["weights"].items():
        assert torch.equal(w, stare["weights"][name]), name


def test_stare_update_differs_from_grpo_when_gate_on(runs, reference):
    assert reference["loss"] != runs("one")["grpo"][0]["loss"]


def test_non_finite_step_is_skipped_and_weights_untouched(runs):
    for got in runs("pp2")["poisoned"]:
        assert got["skipped"] == 1
        assert not torch.isfinite(torch.tensor(got["loss"][0]))
        for name, w in got["weights"].items():
            assert torch.equal(w, seeded_canonical(name, w.shape)), f"{name} changed on a skipped step"


@pytest.mark.parametrize("name,variant", [("tp2", "sp"), ("dp2", "distopt"), ("tp2dp2", "sp_distopt")],
                         ids=CLUSTER_LAYOUT_IDS)
def test_sequence_parallel_and_distributed_optimizer_match_single_process(runs, reference, name, variant):
    for v in (variant, f"{variant}/padded"):
        for got in runs(name)[v]:
            assert_same_update(reference, got)


def test_odd_lengths_are_padded_for_sequence_parallel_and_change_no_number(runs):
    ref = runs("one")["rows1"][0]  # one sample per micro-batch: unpadded widths
    assert any(w % 2 for w in ref["widths"]), "the case has no odd length to pad"
    for variant in ("sp_rows1", "sp_rows1/padded"):
        for got in runs("tp2")[variant]:
            assert got["widths"] == [w + w % 2 for w in ref["widths"]]
            assert_same_update(ref, got)


def test_bf16_distributed_optimizer_matches_fp32_within_bf16_tolerance(runs):
    """bf16 weights with fp32 main params (distributed optimizer, DP2) against the fp32 update.

    Tolerances (measured on this case: loss 1.0e-4, grad norm 5.7e-4 relative, weights 2.1*lr
    beyond half an ulp, 24 of 25 selected tokens shared, update cosine 0.93): losses within 1e-3
    and grad norms within 5e-3 relative; every weight within half a bf16 ulp (2^-8 |w|) plus
    3*lr (one Adam step moves a weight by about lr, and a tiny gradient may flip its sign); at
    least 80% of STARE's selected tokens shared; the bf16 update points the fp32 way (cosine > 0.8).
    """
    lr = 1e-4
    fp32 = runs("one")["lr4"][0]
    for got in runs("dp2")["bf16"]:
        assert abs(got["loss"][0] - fp32["loss"][0]) <= 1e-3 * abs(fp32["loss"][0])
        assert abs(got["grad_norm"][0] - fp32["grad_norm"][0]) <= 5e-3 * fp32["grad_norm"][0]
        for name, w in fp32["weights"].items():
            excess = ((got["weights"][name] - w).abs() - 2 ** -8 * w.abs()).max().item()
            assert excess <= 3 * lr, f"{name}: {excess}"
        assert len(set(got["selected"]) & set(fp32["selected"])) >= 0.8 * len(fp32["selected"])
        start = {n: seeded_canonical(n, w.shape) for n, w in fp32["weights"].items()}
        u32 = torch.cat([(w - start[n]).reshape(-1) for n, w in fp32["weights"].items()])
        u16 = torch.cat([(got["weights"][n] - start[n].bfloat16().float()).reshape(-1) for n in fp32["weights"]])
        assert torch.nn.functional.cosine_similarity(u32, u16, dim=0) > 0.8


def assert_same_pass_statistics(ref, got):
    """The log-prob pass's results: per-token old log-probs and entropies (``got``'s tokens, a
    data shard of ``ref``'s), the batch entropy, the engine mismatch, the masked fraction and
    the entropy diagnostics."""
    for name in ("logp", "token_entropy"):
        assert got[name] and got[name].keys() <= ref[name].keys()
        worst = max(abs(ref[name][k] - v) for k, v in got[name].items())
        assert worst <= 1e-5, (name, worst)
    assert rel(ref["entropy"], got["entropy"]) <= 1e-6
    for a, b in zip(ref["mismatch"], got["mismatch"]):
        assert (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-5), (ref["mismatch"], got["mismatch"])
    assert (ref["masked_frac"] is None) == (got["masked_frac"] is None)
    if ref["masked_frac"] is not None:
        assert abs(ref["masked_frac"] - got["masked_frac"]) <= 1e-9
    assert ref["dynamics"].keys() == got["dynamics"].keys() and ref["dynamics"]
    for k, a in ref["dynamics"].items():
        assert abs(a - got["dynamics"][k]) <= 1e-6 * max(1.0, abs(a)), (k, a, got["dynamics"][k])


@pytest.mark.parametrize("layout", ["one", "tp2", "pp2", "dp2"])
@pytest.mark.parametrize("name", list(ON_POLICY))
def test_the_updates_forward_stands_in_for_the_logprob_pass(runs, layout, name):
    """With one optimizer step per batch, skipping the forward-only pass changes no number:
    the update, the pass's statistics and the diagnostics equal the two-pass step's on every
    rank, and the single process's at every layout; the ratio is exactly 1."""
    one = runs("one")[f"onpolicy_{name}/fused"][0]
    for with_pass, fused in zip(runs(layout)[f"onpolicy_{name}/pass"], runs(layout)[f"onpolicy_{name}/fused"]):
        assert fused["metrics"]["ppo_kl"] == 0.0  # logp - logp.detach(): no drift at all
        assert fused["logp"].keys() == with_pass["logp"].keys()
        for ref in (with_pass, one):
            assert_same_update(ref, fused)
            assert_same_pass_statistics(ref, fused)
    if name == "kl_tis":
        assert one["mismatch"][0] > 0.01 and 0.0 < one["masked_frac"] < 1.0, "the correction did nothing"
        assert one["metrics"]["kl_loss"] > 0.0
