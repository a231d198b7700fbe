"""Bounded-staleness asynchronous training, the parts that need no engine:

- the rollout pipeline (``rollout/async_loop.py``) keeps ``staleness`` batches ahead, in a real
  worker thread: batches are drawn in step order on the caller's thread, generated under the
  version current at launch, never more than ``staleness`` versions old when taken, and
  generation ahead overlaps the caller's work (its span intersects);
- staleness 0 runs nothing ahead (the synchronous step);
- the off-policy ratio band masks exactly the tokens whose ratio lies outside it, and composes
  with TIS;
- (the config's staleness checks are in ``test_config.py``).
"""

import threading
import time

import pytest
import torch

from megatron_stare.config.algorithm import OffPolicyConfig
from megatron_stare.algorithms.off_policy import OffPolicyCorrection, off_policy_weights
from megatron_stare.rollout.async_loop import RolloutPipeline, Span, overlaps
from megatron_stare.rollout.base import SamplingParams
from megatron_stare.rollout.partial import SegmentedBatch


class _Recorder:
    """A draw / generate pair that records the thread and order of each call."""

    def __init__(self, gen_s: float = 0.0):
        self.draws, self.gens, self.gen_s = [], [], gen_s
        self.main = threading.get_ident()

    def draw(self, step):
        assert threading.get_ident() == self.main, "draws must happen on the caller's thread"
        self.draws.append(step)
        return step

    def generate(self, step):
        self.gens.append((step, threading.get_ident() == self.main))
        time.sleep(self.gen_s)
        return f"batch{step}"


def _run(k: int, steps: int, rec: _Recorder, train_s: float = 0.0, serial: bool = False):
    """The trainer's schedule: take, launch ahead, train, drain, push (version + 1)."""
    pipe = RolloutPipeline(k, rec.draw, rec.generate)
    version, taken, trains = 0, [], []
    try:
        for step in range(steps):
            job = pipe.take(step, version)
            taken.append((step, job.version, job.results))
            pipe.launch_ahead(step, version, end=steps)
            if serial:  # broken on purpose: wait for the generation before training
                pipe.drain()
            t0 = time.perf_counter()
            time.sleep(train_s)
            trains.append((Span(step, "train", t0, time.perf_counter()),
                           [j.span for j in list(pipe.pending.values())]))
            pipe.drain()
            trains[-1] = (trains[-1][0], [j.span for j in pipe.pending.values() if j.version == step])
            version = step + 1
    finally:
        pipe.close()
    return taken, trains


@pytest.mark.parametrize("k", [1, 2])
def test_pipeline_runs_k_ahead_and_bounds_staleness(k):
    rec = _Recorder(gen_s=0.05)
    taken, trains = _run(k, 5, rec, train_s=0.1)
    assert [t[0] for t in taken] == list(range(5)) and [t[2] for t in taken] == [f"batch{s}" for s in range(5)]
    assert rec.draws == list(range(5))  # drawn once each, in step order, none past the run
    # Step 0 is generated inline; every later batch in the worker thread, under the version of the
    # step that launched it: max(s - k, 0), so at most k versions old (and exactly k in steady state).
    assert rec.gens[0] == (0, True) and all(not inline for _, inline in rec.gens[1:])
    assert [v for _, v, _ in taken] == [max(s - k, 0) for s in range(5)]
    # Generation ahead overlaps training: each step's training intersects a generation span.
    for train, ahead in trains[:5 - k]:
        assert ahead and any(overlaps(train, g) for g in ahead)
    assert all(ahead == [] for _, ahead in trains[5 - k:])  # the last k steps launch nothing new


@pytest.mark.parametrize("k", [1, 2])
def test_partial_batches_get_one_round_per_version_then_finish_inline(k):
    """``advance`` rounds (partial rollouts): a batch needing 4 rounds gets one in the worker per
    version it lives through ahead (k of them: versions s - k .. s - 1), then the rest inline
    under the version that takes it; rounds are drained before each push."""
    main, rounds = threading.get_ident(), []

    def advance(job, version):
        rounds.append((job.step, version, threading.get_ident() == main))
        job.work = (job.work or 0) + 1
        if job.work == 4:
            job.results = f"batch{job.step}"
        return job.work == 4

    pipe = RolloutPipeline(k, lambda s: s, advance=advance)
    steps, version = 5, 0
    try:
        for step in range(steps):
            job = pipe.take(step, version)
            assert job.results == f"batch{step}" and version - job.version <= k
            pipe.launch_ahead(step, version, end=steps)
            pipe.drain()
            version = step + 1
    finally:
        pipe.close()
    for s in range(k, steps):
        mine = [(v, inline) for st, v, inline in rounds if st == s]
        assert mine == [(v, False) for v in range(s - k, s)] + [(s, True)] * (4 - k), (s, mine)
    with pytest.raises(ValueError, match="one of generate"):
        RolloutPipeline(1, lambda s: s)


def test_close_drops_queued_rounds_and_waits_for_the_running_one():
    started, release = threading.Event(), threading.Event()
    ran = []

    def generate(step):
        ran.append(step)
        started.set()
        release.wait(5)
        return step

    pipe = RolloutPipeline(3, lambda s: s, generate)
    pipe.launch_ahead(0, 0)  # steps 1, 2, 3 queued; step 1 starts
    assert started.wait(5)
    threading.Timer(0.2, release.set).start()
    pipe.close()  # returns once step 1's round is done; 2 and 3 never start
    assert ran == [1] and pipe.pending[1].results == 1
    with pytest.raises(RuntimeError, match="step 2's generation was cancelled"):
        pipe.take(2, 0)


def test_overlap_check_fails_for_a_serial_schedule():
    _, trains = _run(1, 3, _Recorder(gen_s=0.05), train_s=0.05, serial=True)
    assert all(ahead for _, ahead in trains[:2])
    assert not any(overlaps(train, g) for train, ahead in trains for g in ahead)


def test_staleness_zero_runs_nothing_ahead():
    rec = _Recorder()
    taken, trains = _run(0, 3, rec)
    assert rec.gens == [(0, True), (1, True), (2, True)] and [v for _, v, _ in taken] == [0, 1, 2]
    assert all(ahead == [] for _, ahead in trains)


def test_too_stale_batch_and_worker_errors_raise_on_take():
    rec = _Recorder()
    pipe = RolloutPipeline(1, rec.draw, rec.generate)
    try:
        pipe.take(0, 0)
        pipe.launch_ahead(0, 0)
        # The trainer skipped a push: step 1's batch would be 2 versions old, beyond k = 1.
        with pytest.raises(RuntimeError, match="2 versions old, beyond trainer.staleness=1"):
            pipe.take(1, 2)
    finally:
        pipe.close()

    def boom(step):
        raise ValueError("engine died")

    pipe = RolloutPipeline(1, rec.draw, boom)
    try:
        pipe.launch_ahead(0, 0)
        with pytest.raises(ValueError, match="engine died"):
            pipe.take(1, 0)
    finally:
        pipe.close()


def test_ratio_band_masks_tokens_outside_the_band():
    eng = torch.zeros(1, 6)
    ratios = torch.tensor([[0.3, 0.5, 0.9, 1.0, 2.0, 2.5]])
    old = torch.log(ratios)
    mask = torch.ones(1, 6, dtype=torch.bool)

    def weight(rules, **bounds):
        return off_policy_weights(old, eng, mask, OffPolicyCorrection(rules, OffPolicyConfig(**bounds))).weight

    # Edges are inside (up to the float log): 0.5 and 2 kept, 0.3 and 2.5 masked.
    keep = torch.tensor([[0.0, 1, 1, 1, 1, 0]])
    torch.testing.assert_close(weight(("band_mask",)), keep)
    torch.testing.assert_close(weight(("band_mask",), band_high=float("inf")), torch.tensor([[0.0] + [1.0] * 5]))
    assert off_policy_weights(old, eng, mask, OffPolicyCorrection()) is None
    # With TIS: min(r, cap) on kept tokens, 0 on masked ones.
    torch.testing.assert_close(weight(("tis", "band_mask"), tis_cap=1.5),
                               torch.tensor([[0.0, 0.5, 0.9, 1.0, 1.5, 0.0]]))
    torch.testing.assert_close(weight(("tis",), tis_cap=1.5), ratios.clamp(max=1.5))
    assert off_policy_weights(old, None, mask, OffPolicyCorrection(("band_mask",))) is None  # no behaviour log-probs


def test_in_flight_batches_round_trip_exactly_through_json():
    import json

    from megatron_stare.rollout.async_loop import Launched, decode_in_flight, encode_in_flight
    from megatron_stare.rollout.base import GenerationResult

    g = torch.Generator().manual_seed(0)
    res = [GenerationResult(p, i, [5, 6, 7], torch.randn(3, generator=g, dtype=torch.float32) - 3, "length")
           for p in (3, 9) for i in range(2)]
    res[1].versions = [2, 2, 3]  # a partial rollout's response spans two versions
    partial = SegmentedBatch([[1, 2]], [7], SamplingParams(max_new_tokens=8), 2)
    partial.load_state_dict({"segments": 1, "responses": [[7, 0, [4, 4], [-1.25, -0.5], [4, 4], None]]})
    jobs = [Launched(4, 3, ([3, 9], "prompts", "params"), res, finished=True),
            Launched(5, 3, ([1, 2], "p", "q"), None, finished=True),
            Launched(6, 4, ([7], "p", "q"), None, work=partial)]
    saved = json.loads(json.dumps(encode_in_flight(jobs)))
    draws = []

    def work(job, state):
        w = SegmentedBatch([[1, 2]], job.draw[0], SamplingParams(max_new_tokens=8), 2)
        w.load_state_dict(state)
        return w

    back = decode_in_flight(saved, lambda step, idx: draws.append((step, idx)) or (idx, step), keep_results=True,
                            work=work)
    assert draws == [(4, [3, 9]), (5, [1, 2]), (6, [7])]
    assert [(j.step, j.version, j.draw, j.results is None, j.finished) for j in back] == [
        (4, 3, ([3, 9], 4), False, True), (5, 3, ([1, 2], 5), True, True), (6, 4, ([7], 6), True, False)]
    assert back[2].work.state_dict() == partial.state_dict() and back[0].results[1].versions == [2, 2, 3]
    with pytest.raises(ValueError, match="partial rollout"):
        decode_in_flight(saved, lambda step, idx: idx, keep_results=True)
    assert back[2].work is not None and decode_in_flight(saved, lambda s, i: i, keep_results=False)[2].work is None
    for a, b in zip(res, back[0].results):
        assert (a.prompt_index, a.sample_index, a.token_ids, a.finish_reason) == \
            (b.prompt_index, b.sample_index, b.token_ids, b.finish_reason)
        assert torch.equal(a.logprobs, b.logprobs) and b.logprobs.dtype == torch.float32  # bit-exact
    assert all(j.results is None for j in decode_in_flight(saved, lambda s, i: i, keep_results=False))
    # Restored batches are taken without generating anything.
    pipe = RolloutPipeline(1, lambda s: pytest.fail("drew"), lambda d: pytest.fail("generated"))
    try:
        pipe.restore(back[0])
        assert pipe.take(4, 4).results is back[0].results
    finally:
        pipe.close()


class _MaskedMB:
    def __init__(self, old, eng, mask):
        self.old_logp, self.engine_logp, self.loss_mask = old, eng, mask


def _masked_fraction(rank, world):
    import torch.distributed as dist

    from megatron_stare.actor.mismatch import masked_fraction

    eng = torch.zeros(2, 3)
    # 4 response tokens per rank (the mask): 1 outside the band on rank 0, 3 on rank 1.
    ratios = [torch.tensor([[0.3, 1.0, 9.0], [1.0, 1.0, 9.0]]), torch.tensor([[0.1, 3.0, 1.0], [1.0, 0.2, 0.2]])][rank]
    mask = torch.tensor([[True, True, False], [True, True, False]])
    return masked_fraction([_MaskedMB(torch.log(ratios), eng, mask)], OffPolicyCorrection(("band_mask",)),
                           dist.group.WORLD, None, torch.device("cpu"))


def test_band_masked_fraction_counts_masked_response_tokens_over_ranks():
    from megatron_stare.testing.distributed import run_on_ranks

    assert run_on_ranks(_masked_fraction, 2) == [0.5, 0.5]  # (1 + 3) of 8 response tokens
