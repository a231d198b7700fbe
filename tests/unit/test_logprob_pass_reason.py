"""When the update's forward may stand in for the forward-only log-prob pass
(``trainer.logprob_pass`` auto): exactly when nothing reads the pass's values before the first
backward and the batch gets one optimizer step. Each reason is named for the console."""

import pytest

from megatron_stare.actor.logprob_pass import logprob_pass_reason
from megatron_stare.config.algorithm import AlgorithmConfig
from megatron_stare.algorithms.losses import POLICY_LOSSES, build_policy_loss

#: The losses whose plan selects tokens by the pass's values (or reads the gate of this step).
READS = {"stare", "clip_cov", "kl_cov", "forking_tokens"}


def reason(loss="vanilla", mode="auto", mini_batches=1, ppo_epochs=1, gepo=False, routing_replay="none"):
    return logprob_pass_reason(mode, build_policy_loss(AlgorithmConfig(policy_loss=loss)), mini_batches=mini_batches,
                               ppo_epochs=ppo_epochs, gepo=gepo, routing_replay=routing_replay)


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_only_losses_that_plan_without_old_logprobs_skip_the_pass(loss):
    why = reason(loss)
    if loss in READS:
        assert why is not None and f"'{loss}'" in why
    else:
        assert why is None


@pytest.mark.parametrize("knobs, words", [
    ({"mode": "always"}, "always"),
    ({"mini_batches": 2}, "2 mini-batch"),
    ({"ppo_epochs": 3}, "3 epoch"),
    ({"gepo": True}, "GEPO"),
    ({"routing_replay": "r3"}, "routing replay r3"),
    ({"routing_replay": "r2"}, "routing replay r2"),
])
def test_every_other_reader_keeps_the_pass(knobs, words):
    why = reason("vanilla", **knobs)
    assert why is not None and words in why


def test_a_bad_mode_is_refused_naming_the_field():
    from megatron_stare.config.load import load_config

    assert load_config(overrides=["trainer.logprob_pass=always"]).trainer.logprob_pass == "always"
    with pytest.raises(ValueError, match="trainer.logprob_pass"):
        load_config(overrides=["trainer.logprob_pass=never"])
