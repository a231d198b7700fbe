"""``trainer.logprob_pass`` through ``Trainer.step`` (2 gloo ranks at TP2, the hf engine, vanilla
loss, one optimizer step per batch): 'auto' skips the forward-only pass (the actor's
``compute_logprobs`` is never called) and its two steps log the numbers of the run with the
pass ('always'): loss, grad norm, entropy, rewards, the quadrant diagnostics. The actor-level
equality at four layouts is ``test_actor_layouts.py::test_the_updates_forward_stands_in_for_the_logprob_pass``."""

from pathlib import Path

import pytest

from megatron_stare.testing.distributed import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _steps(rank, world, assets: Path, mode: str, steps: int):
    from megatron_stare.config.load import load_config
    from megatron_stare.preflight.checks import validate_config
    from megatron_stare.train import Trainer

    overrides = [f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
                 f"logging.dir={assets / ('logs_' + mode)}", "logging.tensorboard=false", "checkpoint.dir=null",
                 "checkpoint.save_every=0", "trainer.total_steps=2", "trainer.prompts_per_step=4", "rollout.n=4",
                 "rollout.max_new_tokens=8",
                 "rollout.engine=hf", "algorithm.policy_loss=vanilla", f"trainer.logprob_pass={mode}",
                 "reward.fn=megatron_stare.testing.rewards:parity_reward", "reward.num_workers=0",
                 "optimizer.lr=1e-3"]
    cfg = validate_config(load_config(str(ROOT / "examples" / "tiny_cpu.yaml"), overrides), world_size=world)
    tr = Trainer(cfg)
    passes = []
    real = tr.actor.compute_logprobs
    tr.actor.compute_logprobs = lambda *a, **k: passes.append(1) or real(*a, **k)
    try:
        rows = [{k: v for k, v in tr.step(s).items() if not k.startswith(("time/", "perf/"))} for s in range(steps)]
        return {"rows": rows, "passes": len(passes), "skipped_reason": tr.logprob_pass}
    finally:
        tr.close()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_stare.rewards.synthetic import make_task, write_jsonl
    from megatron_stare.testing.hf_models import build_tiny_hf_model

    d = tmp_path_factory.mktemp("logprob_pass")
    build_tiny_hf_model("qwen2", d / "model", num_layers=2)
    write_jsonl(make_task("add", 32, seed=0, digits=1), d / "train.jsonl")
    return d


def test_the_trainer_skips_the_pass_and_logs_the_same_numbers(assets):
    always = run_on_ranks(_steps, 2, assets, "always", 2)[0]
    auto = run_on_ranks(_steps, 2, assets, "auto", 2)[0]
    assert always["passes"] == 2 and "always" in always["skipped_reason"]
    assert auto["passes"] == 0 and auto["skipped_reason"] is None
    for a, b in zip(always["rows"], auto["rows"]):
        assert a.keys() == b.keys()
        assert a["grad_norm"] > 0  # real advantages: the steps moved the weights
        for k, x in a.items():
            y = b[k]
            if isinstance(x, float):
                assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (k, x, y)
            else:
                assert x == y, (k, x, y)
