"""The sync probe's pieces (``trainer/sync_probe.py``): bounds by dtype, cadence from the run's
first sync (a resume included), the probe's prompts, the check's one line, and the watch on the
step's engine/trainer gap."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from megatron_stare.testing.hf_models import build_tiny_hf_model
from megatron_stare.trainer.sync_probe import (BOUNDS, MismatchWatch, ProbeGap, SyncCheckError, SyncProbe, bound_for,
                                               probe_prompts)


def test_bound_is_the_least_precise_sides():
    assert bound_for("float32") == bound_for("float32", "float32") == BOUNDS["float32"] == (1e-4, 1e-3)
    assert bound_for("float32", "bfloat16") == bound_for("bfloat16") == (2e-2, 0.5)


@pytest.mark.parametrize("first, every, want", [(0, 10, [0, 10, 20]), (7, 10, [7, 17, 27]), (3, 1, list(range(3, 30))),
                                                (5, 0, [5])])
def test_cadence_counts_from_the_runs_first_sync(first, every, want):
    probe = SyncProbe([[1, 2]], 1.0, every, BOUNDS["float32"])
    assert [v for v in range(first, 30) if probe.due(v)] == want


def test_prompts_fit_share_a_prefix_and_render_the_chat_template(tmp_path):
    tok = AutoTokenizer.from_pretrained(build_tiny_hf_model("qwen2", tmp_path / "m"))
    full = max(len(p) for p in probe_prompts(tok, 10_000, count=5))
    for limit in (full, full - 40):  # the whole system turn; a shortened one
        prompts = probe_prompts(tok, limit, count=5)
        assert len(prompts) == 5 and max(len(p) for p in prompts) <= limit
        assert len({tuple(p) for p in prompts}) == 5  # distinct questions (the 5th repeats one, marked)
        assert tok.decode(prompts[0]).startswith("<|im_start|>system\n")
        shared = next(i for i, ts in enumerate(zip(*prompts)) if len(set(ts)) > 1)
        assert shared > 16
    assert all(len(p) == 20 for p in probe_prompts(tok, 20))  # nothing fits: the prompts' tails
    tok.chat_template = None  # a base model: plain text, the same shared prefix
    assert probe_prompts(tok, 200, count=2)[0][:10] == probe_prompts(tok, 200, count=2)[1][:10]


def test_check_passes_within_the_bound_and_names_engine_step_gap_and_where_past_it():
    probe = SyncProbe([[1], [2]], 1.0, 10, BOUNDS["float32"])
    ok = ProbeGap([5e-5, 9e-5], [4e-4, 9e-4], 32)
    assert probe.check(ok, 3, "vllm", ["replica 0 of 2", "replica 1 of 2"]) is ok and probe.last is ok
    for bad in (ProbeGap([5e-5, 3e-4], [4e-4, 9e-4], 32), ProbeGap([5e-5, 5e-5], [4e-4, 2e-3], 32)):
        with pytest.raises(SyncCheckError) as e:
            probe.check(bad, 12, "vllm", ["replica 0 of 2", "replica 1 of 2"])
        msg = str(e.value)
        assert "\n" not in msg and "the vllm engine (replica 1 of 2) is off the trainer after the sync of step 12" in msg
        assert f"{bad.mean:.2e} mean / {bad.max:.2e} max over 32 tokens (bound 1e-04 / 1e-03)" in msg


def test_watch_says_once_past_ten_times_the_first_step_or_the_bound():
    w = MismatchWatch(1e-4)
    assert [w.update(s, g) for s, g in ((1, None), (2, 1e-6), (3, 9e-5), (4, 1e-4))] == [None] * 4
    line = w.update(5, 3e-3)
    assert line.startswith("step 5: the engine's log-probs are 3.00e-03 (mean abs) from the trainer's, 3000x")
    assert "rollout.verify_sync=probe" in line and w.update(6, 5e-2) is None  # once
    w = MismatchWatch(2e-2)  # bf16: the first step's gap is already 5e-3; 10x is the limit
    assert w.update(1, 5e-3) is None and w.update(2, 4e-2) is None and w.update(3, 6e-2).startswith("step 3")
