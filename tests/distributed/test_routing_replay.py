"""MoE routing replay (``rollout.routing_replay``, ``actor/routing_replay.py``) on the tiny
Qwen3-MoE (``MOE_SPEC``: 8 experts, top-2, 2 MoE layers), real megatron-core on gloo.

- r3: the experts the routers chose, captured inside the model, equal the supplied "engine"
  routes at every engine-routed position of every layer in the log-prob pass, and every forward
  and recompute (full activation recompute) of every update equals the log-prob pass (prompt
  positions without engine routes: the trainer's own routing of that pass, replayed).
- r2: every mini-batch and PPO epoch routes as the log-prob pass did, while the moved weights'
  own routing differs (``moe/replay_changed_frac_update`` > 0).
- near-ties: an "engine" whose router weights differ by a 2% perturbation flips ~0.6% of the
  top-k choices of near-tied router logits; the trainer's mean |log-prob - engine log-prob| with
  r3 is ~1% of the same without replay (printed).
- One STARE update with replay on (r3 with response-only engine routes on packed rows, with full
  routes on padded rows; r2 over two mini-batches) equals one process at EP2, EP2xPP2 and
  EP2xTP2xCP2 (sequence parallel: each TP rank's routers see their chunk of the sequence): loss, grad norm (1e-5 relative), selected tokens, metrics (the replay fractions and
  the expert load among them; the load counted the padding under CP: 2.69 against 2.55 on
  padded rows), weights (1e-6), every token's log-prob seen once.
- The config refuses replay for a dense model and r3 for an engine that returns no routes.
"""

import pytest

from megatron_stare.config.load import ConfigError, load_config
from megatron_stare.preflight.checks import check_config
from megatron_stare.testing.actor_case import MOE_SPEC, run_actor_variants
from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.replay_case import run_replay_cases

from tests.distributed.test_actor_layouts import assert_same_update, assert_tokens_seen_once
from tests.unit.test_moe_config import _cfg

pytestmark = pytest.mark.distributed

R3 = {"spec": MOE_SPEC, "routing_replay": "r3", "engine_routes": "response"}
R3_FULL_PADDED = {"spec": MOE_SPEC, "routing_replay": "r3", "engine_routes": "full", "pack_sequences": False}
# Two mini-batches: the second replays what the log-prob pass recorded before the first's step.
R2 = {"spec": MOE_SPEC, "routing_replay": "r2", "mini_batches": 2}
VARIANTS = {"r3": R3, "r3_padded": R3_FULL_PADDED, "r2": R2}
#: name -> (world, tp, pp, cp, ep, [variants]); EP2 x TP2 x CP2 (sequence parallel): EP spans the TP ranks.
RUNS = {
    "ep2": (2, 1, 1, 1, 2, ["r3", "r3_padded", "r2"]),
    "ep2pp2": (4, 1, 2, 1, 2, ["r3", "r2"]),
    "ep2tp2cp2": (4, 2, 1, 2, 2, ["r3", "r3_padded"]),
}


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def run(name):
        if name not in cache:
            world, tp, pp, cp, ep, variants = RUNS[name]
            ranks = run_on_ranks(run_actor_variants, world, tp, pp, [VARIANTS[v] for v in variants], cp=cp, ep=ep)
            cache[name] = {v: [r[i] for r in ranks] for i, v in enumerate(variants)}
        return cache[name]

    return run


@pytest.fixture(scope="module")
def cases():
    """The one-process cases (``replay_case.py``) and the layout tests' references, one spawn."""
    out = run_on_ranks(run_replay_cases, 1, list(VARIANTS.values()))[0]
    out["reference"] = dict(zip(VARIANTS, out.pop("variants")))
    return out


@pytest.mark.parametrize("covered", ["full", "response"])
def test_r3_replays_the_engine_routes_exactly(cases, covered):
    c = cases[f"r3_{covered}"]
    assert c["engine_wrong"] == 0 and c["update_wrong"] == 0, c
    assert c["engine_checked"] > 0 and c["recomputed"] > 0 and c["update_checked"] > c["engine_checked"]
    assert c["moe/replay_changed_frac"] > 0.5  # random engine routes: replay changed most choices
    assert (c["moe/replay_engine_frac"] == 1.0) == (covered == "full")


def test_r2_every_mini_batch_and_epoch_routes_as_the_logprob_pass(cases):
    c = cases["r2"]
    assert c["update_wrong"] == 0 and c["update_checked"] > 0, c
    assert c["changed_update"] > 0, "the weights did not move enough for replay to matter"


def test_replay_brings_trainer_logprobs_to_the_engine_on_near_ties(cases):
    c = cases["near_tie"]
    print(f"near-tie: {100 * c['flipped_frac']:.2f}% of top-k choices flipped; mean |dlogp| "
          f"{c['mismatch_none']:.3g} without replay, {c['mismatch_r3']:.3g} with r3 (ratio {c['ratio']:.4f})")
    assert c["flipped_frac"] > 0
    assert c["ratio"] < 0.1, c


@pytest.mark.parametrize("name,variant", [(n, v) for n in RUNS for v in RUNS[n][5]])
def test_replay_layouts_match_single_process(runs, cases, name, variant):
    world, tp, pp, cp, ep, _ = RUNS[name]
    reference = cases["reference"][variant]
    assert reference["metrics"]["moe/replay_changed_frac"] > (0.5 if variant.startswith("r3") else -1)
    ranks = runs(name)[variant]
    for got in ranks:
        assert_same_update(reference, got)
    assert_tokens_seen_once(reference, ranks, tp * pp)


def test_config_refuses_replay_without_moe_or_engine_routes():
    moe = _cfg(head_dim=32)
    dense = {k: v for k, v in moe.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    dense.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    ok = ["rollout.engine=vllm", "rollout.routing_replay=r3"]
    check_config(load_config(None, ok), cuda=True, check_paths=False, hf_config=moe)
    # vLLM-CPU cannot capture routes (rollout/routed_experts.py): refused up front, in one line.
    with pytest.raises(ConfigError, match="vLLM-CPU cannot return routed experts") as e:
        check_config(load_config(None, ok), cuda=False, check_paths=False, hf_config=moe)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model") as e:
        check_config(load_config(None, ok), cuda=False, check_paths=False, hf_config=dense)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="needs an engine that returns routed experts"):
        check_config(load_config(None, ["rollout.engine=hf", "rollout.routing_replay=r3"]), cuda=False,
                     check_paths=False, hf_config=moe)
    check_config(load_config(None, ["rollout.engine=hf", "rollout.routing_replay=r2"]), cuda=False,
                 check_paths=False, hf_config=moe)
