"""``vllm``: a colocated vLLM engine in the trainer's process (``vllm.LLM``).

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): weight updates hand
the trainer's HF tensor stream straight to each worker's ``reload_weights`` through
``collective_rpc`` (no serialization; raw tensors do not survive the multiprocess RPC), then
reset the prefix cache. Under ``torchrun`` pass ``distributed_executor_backend=
"external_launcher"``: every trainer rank then hosts one engine rank in its own process,
vLLM reuses the trainer's default process group, and the engine's tensor-parallel size may
differ from the trainer's (each rank feeds its engine rank the full HF stream; vLLM shards it).

Built from the spec (``llm_kwargs``): the policy's dtype, ``rollout.tp``, the memory budget
``rollout.gpu_memory_utilization`` (on CPU an explicit KV cache: ``rollout.cpu_kv_cache_gb``),
``max_model_len`` = the context length, the trainer's seed,
``logprobs_mode="processed_logprobs"`` (the log-prob convention of ``rollout/base.py``),
``generation_config="vllm"`` (the model's generation defaults, e.g. a repetition penalty, must
not change the sampled distribution), sleep mode on GPU, and, inside the trainer's ranks,
``external_launcher`` with a data-parallel size of ``world / tp``.

Preemption inside a step: ``generate`` aborts its requests between engine steps once
``interrupted()`` (``_abort_on_interrupt``) and raises ``StepInterrupted``. Under
``external_launcher`` at TP > 1 the engine's TP ranks must schedule identically (vLLM's
``ExecutorWithExternalLauncher``, ``v1/executor/uniproc_executor.py``: the engines "don't need to
synchronize the states with each other" only while scheduling is deterministic), and each rank
learns of a signal on its own clock: so before every engine step they agree (an all-reduce MAX
over the TP group's CPU group) and abort at the same step, or a rank that aborted alone would
leave the others in the step's all-reduces.

Memory phases: ``LLM.sleep(level=1)`` (weights to host memory, KV cache discarded), then
``wake_up(tags=["weights"])`` and, after the weight sync, ``wake_up(tags=["kv_cache"])``. On
CPU the same real calls are made - vLLM pauses its scheduler and tracks the sleeping tags -
but vLLM-CPU frees nothing (its worker ignores sleep), and this engine says so once.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Dict, Iterable, List, Optional, Sequence, Tuple
import gc

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.errors import UserError
from megatron_stare.runtime.preemption import StepInterrupted
from megatron_stare.weight_sync import TensorChecksum
from megatron_stare.rollout.base import (GenerationResult, MemoryRelease, RolloutEngine, SamplingParams, batch_indices, sample_seed)
from megatron_stare.rollout import vllm_cpu
from megatron_stare.rollout.routed_experts import capture_unavailable, moe_layers, to_result_layout
from megatron_stare.rollout.spec import EngineSpec

__all__ = ["LOGPROBS_MODE", "VLLMEngine", "from_vllm_output", "llm_kwargs", "to_vllm_sampling_params"]

log = logging.getLogger(__name__)

WORKER_EXTENSION = "megatron_stare.rollout.vllm_worker_ext.StareWorkerExtension"
LOGPROBS_MODE = "processed_logprobs"
"""vLLM's name for the log-prob convention: after temperature (and top-k/top-p), fp32."""
SLEEP_LEVEL = 1
"""vLLM sleep level of the release phase: 1 offloads weights to host memory and discards the KV
cache. (Level 2 would discard the weights too, and with them buffers no checkpoint holds.)"""


def llm_kwargs(spec: EngineSpec) -> dict:
    """The spec in ``vllm.LLM``'s arguments (``VLLMEngine`` adds the worker extension)."""
    kw = {"model": spec.model_path, "dtype": spec.dtype, "seed": spec.seed,
          "max_model_len": spec.context_length, "tensor_parallel_size": spec.tp,
          "gpu_memory_utilization": spec.gpu_memory_utilization, "enforce_eager": not spec.cuda,
          "enable_sleep_mode": spec.cuda, "logprobs_mode": LOGPROBS_MODE, "generation_config": "vllm"}
    if not spec.cuda:
        kw.update(vllm_cpu.scheduler_kwargs(spec.context_length))  # seeded sampling survives big batches
        if spec.cpu_kv_cache_bytes:  # on CPU the fraction above would be of host RAM
            kw["kv_cache_memory_bytes"] = spec.cpu_kv_cache_bytes
    if spec.joins_process_group:  # every trainer rank hosts one engine rank
        kw["distributed_executor_backend"] = "external_launcher"
        if spec.world_size > spec.tp:
            kw["data_parallel_size"] = spec.world_size // spec.tp
    return kw


def to_vllm_sampling_params(params: SamplingParams, prompt_index: int):
    """Our ``SamplingParams`` -> vLLM's, for prompt ``prompt_index`` (per-prompt seed)."""
    import vllm

    return vllm.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, logprobs=0, detokenize=False,
        seed=None if params.seed is None else sample_seed(params.seed, prompt_index),
    )


def from_vllm_output(prompt_index: int, request_output,
                     moe_layers: Optional[Sequence[int]] = None) -> List[GenerationResult]:
    """One vLLM ``RequestOutput`` -> our results, ordered by sample index. ``moe_layers`` (the
    MoE layers' indices): take each completion's routed experts (``rollout/routed_experts.py``)."""
    results = []
    for s, c in enumerate(sorted(request_output.outputs, key=lambda c: c.index)):
        toks = list(c.token_ids)
        lps = [c.logprobs[i][t].logprob for i, t in enumerate(toks)]
        routed = None
        if moe_layers is not None:
            if c.routed_experts is None:
                raise RuntimeError("vLLM returned no routed experts (was the engine built with "
                                   "enable_return_routed_experts?)")
            routed = to_result_layout(c.routed_experts, moe_layers)
        results.append(GenerationResult(prompt_index, s, toks, torch.tensor(lps, dtype=torch.float32),
                                        _finish_reason(c.finish_reason), routed_experts=routed))
    return results


def _finish_reason(reason: Optional[str]) -> str:
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"vLLM request ended with finish_reason={reason!r} (aborted or failed)")


class VLLMEngine(RolloutEngine):
    """Colocated in-process vLLM.

    Args:
        model_path: HF checkpoint directory.
        seed: engine seed (requests with ``SamplingParams.seed`` use their own).
        max_model_len: longest prompt + response.
        tensor_parallel_size / distributed_executor_backend: engine parallelism; use
            ``"external_launcher"`` under torchrun.
        dtype: ``"float32"`` by default (engine log-probs comparable to the trainer's fp32).
        enforce_eager: default True on CPU (no CUDA graphs there).
        enable_sleep_mode: default True on GPU, False on CPU (unsupported).
        sleep_level: 1 offloads weights to host, 2 discards them (a weight update follows).
        record_checksums: workers remember checksums of every received tensor.
        return_routed_experts: every result carries the engine's routed experts
            (``GenerationResult.routed_experts``; vLLM's ``enable_return_routed_experts``), for
            routing replay (``rollout.routing_replay=r3``). Refused on CPU, where vLLM cannot
            capture them (``rollout/routed_experts.py`` says why).
        **llm_kwargs: passed to ``vllm.LLM``.
    """

    name = "vllm"

    def __init__(self, model_path: str, *, seed: int = 0, max_model_len: int = 2048,
                 tensor_parallel_size: int = 1, distributed_executor_backend: Optional[str] = None,
                 dtype: str = "float32", enforce_eager: Optional[bool] = None,
                 enable_sleep_mode: Optional[bool] = None, sleep_level: int = SLEEP_LEVEL,
                 record_checksums: bool = False, logprobs_mode: str = LOGPROBS_MODE,
                 generation_config: str = "vllm", return_routed_experts: bool = False, **llm_kw):
        if return_routed_experts and (why := capture_unavailable(torch.cuda.is_available())):
            raise UserError(why)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise UserError("the colocated vllm engine needs VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                             "(tensors cannot cross the multiprocess RPC); unset it or use the "
                             "vllm-server engine")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.cpu = not torch.cuda.is_available()
        self.sleep_level = sleep_level
        self.record_checksums = record_checksums
        self._enable_sleep = (not self.cpu) if enable_sleep_mode is None else enable_sleep_mode
        self._external = distributed_executor_backend == "external_launcher"
        self._moe_layers = moe_layers(str(model_path)) if return_routed_experts else None
        if return_routed_experts:
            llm_kw["enable_return_routed_experts"] = True
        owned_dist = not dist.is_initialized()
        if self.cpu and tensor_parallel_size > 1 and self._external:
            self._remove_stale_shm()
        self.llm = LLM(
            model=str(model_path), dtype=dtype, seed=seed, max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            enforce_eager=self.cpu if enforce_eager is None else enforce_eager,
            enable_sleep_mode=self._enable_sleep and not self.cpu, logprobs_mode=logprobs_mode,
            generation_config=generation_config, worker_extension_cls=WORKER_EXTENSION, **llm_kw)
        # vLLM created the default process group only if none existed: then it is ours to end.
        self._owns_dist = owned_dist and not self._external and dist.is_initialized()
        self._agree_group = None  # the TP ranks that must abort at the same engine step
        if self._external and tensor_parallel_size > 1:
            from vllm.distributed.parallel_state import get_tp_group

            self._agree_group = get_tp_group().cpu_group

    @staticmethod
    def _remove_stale_shm() -> None:
        """Leftovers of a killed run would stop the TP group's start (``vllm_cpu.remove_stale_shm``):
        one rank per node removes them while the others wait."""

        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            gone = vllm_cpu.remove_stale_shm()
            if gone:
                log.warning("vllm engine: removed %d stale vLLM-CPU shared-memory segment(s) of a killed run: %s",
                            len(gone), ", ".join(gone))
        dist.barrier()

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> "VLLMEngine":
        kw = llm_kwargs(spec)
        return cls(kw.pop("model"), record_checksums=spec.record_checksums,
                   return_routed_experts=spec.return_routed_experts, **kw)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                 prompt_indices: Optional[Sequence[int]] = None) -> List[GenerationResult]:
        """Under ``external_launcher`` data parallelism every replica calls this with its own
        slice (possibly empty): vLLM's DP ranks agree on each step whether any has work left."""
        from vllm.inputs import TokensPrompt

        self.check_can_generate()
        idx = batch_indices(prompt_token_ids, prompt_indices)
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids]
        sps = [to_vllm_sampling_params(params, i) for i in idx]
        with self._abort_on_interrupt() as aborted:
            outs = self.llm.generate(prompts, sampling_params=sps, use_tqdm=False)
        if aborted:
            raise StepInterrupted("generate")
        return [r for i, o in zip(idx, outs) for r in from_vllm_output(i, o, self._moe_layers)]

    @contextmanager
    def _abort_on_interrupt(self):
        """``LLM.generate`` runs the engine loop in this thread (``while has_unfinished_requests():
        step()``): before each engine step, once ``interrupted()``, abort every request. The loop
        then ends by itself (under data parallelism the other replicas run dummy steps until all
        are done, as for any replica out of work), and the engine holds no request: reusable.
        Yields a list that is non-empty if the requests were aborted."""
        engine = self.llm.llm_engine
        real, aborted = engine.step, []

        def step():
            if not aborted and self._interrupt_agreed():
                engine.abort_request(list(engine.output_processor.request_states), internal=True)
                aborted.append(True)
            return real()

        own = engine.__dict__.get("step")  # an instance's own step (a test's counter), else the class's
        engine.step = step
        try:
            yield aborted
        finally:
            if own is None:
                del engine.step
            else:
                engine.step = own

    def _interrupt_agreed(self) -> bool:
        """``interrupted()``, agreed by the engine's TP ranks (MAX over its CPU group) when they
        run one engine between them: True on all of them at the same step, or on none."""
        mine = self.interrupted()
        if self._agree_group is None:
            return mine
        flag = torch.tensor([int(mine)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._agree_group)
        return bool(flag.item())

    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        self.check_can_load_weights()
        counts = self.llm.collective_rpc("stare_reload_weights",
                                         args=(iter(named_tensors), self.record_checksums))
        self.llm.reset_prefix_cache()
        log.info("vllm engine: reloaded %d tensors (%.1f MB)", counts[0]["tensors"],
                 counts[0]["bytes"] / 2 ** 20)

    def checksum(self, names: Sequence[str]) -> Dict[str, Optional[TensorChecksum]]:
        res = self.llm.collective_rpc("stare_checksum", args=(list(names),))[0]
        return {n: None if v is None else TensorChecksum.from_json(v) for n, v in res.items()}

    # ---------------------------------------------------------------- memory phases
    @property
    def memory_release(self) -> MemoryRelease:
        if self.cpu:
            return MemoryRelease(False, "vLLM-CPU accepts sleep() but frees nothing")
        if not self._enable_sleep:
            return MemoryRelease(False, "the engine was built with enable_sleep_mode=False")
        return MemoryRelease(True, f"vLLM sleep level {self.sleep_level}: weights to host memory, "
                                   f"KV cache discarded")

    def _release(self) -> bool:
        if not (self.cpu or self._enable_sleep):
            return False  # vLLM would refuse the call
        with _quiet_cpu_sleep():
            self.llm.sleep(level=self.sleep_level)
        return not self.cpu

    def _resume_weights(self) -> None:
        if self.cpu or self._enable_sleep:
            with _quiet_cpu_sleep():
                self.llm.wake_up(tags=["weights"])

    def _resume_kv(self) -> None:
        if self.cpu or self._enable_sleep:
            with _quiet_cpu_sleep():
                awake = self.llm.wake_up(tags=["kv_cache"])
            if not awake:
                raise RuntimeError("vllm engine: still asleep after waking its weights and KV cache")

    def is_sleeping(self) -> bool:
        """vLLM's own answer (its executor's sleeping tags), for checks of the phase order."""
        return self.llm.llm_engine.is_sleeping()

    def shutdown(self) -> None:
        if getattr(self, "llm", None) is None:
            return

        del self.llm
        self.llm = None
        gc.collect()
        if self._owns_dist:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()


class _CpuSleepFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "sleep mode is not supported on CPU" not in record.getMessage()


@contextmanager
def _quiet_cpu_sleep():
    """vLLM-CPU's worker warns on every sleep/wake-up call; this engine has said it once."""
    logger, f = logging.getLogger("vllm.v1.worker.cpu_worker"), _CpuSleepFilter()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)
