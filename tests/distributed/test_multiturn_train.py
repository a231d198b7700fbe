"""The trainer's multi-turn path on 2 ranks (hf engine, real Megatron actor): trajectories from
the environment, its reward as the score, the per-step multi-turn metrics, identical on both
ranks; and the config's one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_stare.config.load import ConfigError, load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.testing.distributed import run_on_ranks

from .test_trainer_phases import assets  # noqa: F401 - the tiny model and task (a module fixture)

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


def _overrides(assets: Path):
    return [f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
            f"logging.dir={assets / 'logs'}", "logging.tensorboard=false", "checkpoint.dir=null",
            "checkpoint.save_every=0", "trainer.total_steps=1", "trainer.prompts_per_step=2", "rollout.n=2",
            "rollout.max_new_tokens=4", "rollout.engine=hf", "trainer.dynamic_sampling=false",
            "rollout.multi_turn.env=megatron_stare.testing.envs:EchoToolEnv", "rollout.multi_turn.max_turns=4",
            "rollout.multi_turn.max_total_tokens=32", "reward.num_workers=0", "algorithm.stare.target_entropy=10.0"]


def _step(rank, world, assets: Path):
    from megatron_stare.train import Trainer

    cfg = validate_config(load_config(str(ROOT / "examples" / "tiny_cpu.yaml"), _overrides(assets)), world_size=world)
    tr = Trainer(cfg)
    try:
        tr.sync_weights()
        m = tr.step(0)
        return {k: v for k, v in m.items() if k.startswith(("multiturn/", "reward/"))}
    finally:
        tr.close()


def test_multiturn_step_on_two_ranks(assets):
    r0, r1 = run_on_ranks(_step, 2, assets)
    assert r0 == r1
    # EchoToolEnv: done at its 3rd step (reward 1), 2 tool calls of which the 2nd fails; the
    # model's turns are 4 tokens (or fewer at an EOS), each observation 3.
    assert r0["multiturn/turns_mean"] == 3 and r0["multiturn/tool_calls_mean"] == 2
    assert r0["multiturn/tool_success_rate"] == 0.5 and r0["reward/mean"] == 1.0
    assert 0 < r0["multiturn/trained_token_frac"] < 1


def test_config_errors_are_one_line(assets):
    for ov, msg in [(["rollout.multi_turn.env=nope"], "rollout.multi_turn.env: unknown environment 'nope'"),
                    (["rollout.multi_turn.env_options.time_limit_s=2"], "env_options are set but"),
                    (["rollout.multi_turn.env=calculator", "rollout.multi_turn.max_turns=0"],
                     "rollout.multi_turn.max_turns must be >= 1")]:
        with pytest.raises(ConfigError, match=msg) as e:
            validate_config(load_config(str(ROOT / "examples" / "tiny_cpu.yaml"), _overrides(assets)[:2] + ov),
                            world_size=2)
        assert "\n" not in str(e.value)
