"""``sglang``: a colocated ``sglang.Engine`` held by the first rank of each engine TP group. GPU only.

SGLang has no CPU path (its wheels need CUDA and a GPU kernel package). On CPU the translation
of the spec is checked against SGLang's real ``ServerArgs`` fields and ``Engine`` signatures
(recorded from the pinned release: ``tests/fixtures/sglang_api.py``) and the adapter against a
recorded fake that enforces SGLang's rules (``tests/unit/test_rollout_sglang.py``); on a GPU by
``tests/gpu/test_sglang_gpu.py``. The server adapter is ``sglang_server.py``.

Built from the spec (``engine_kwargs``, SGLang 0.5.23's names): ``model_path``, ``tp_size``,
``dtype`` (the policy's), ``context_length`` (not vLLM's ``max_model_len``),
``mem_fraction_static`` (``rollout.gpu_memory_utilization``), ``base_gpu_id`` (the group's
first GPU on its node), ``random_seed``, ``skip_tokenizer_init`` (we send token ids) and
``enable_memory_saver`` (needed by ``release_memory_occupation``).

API used (SGLang 0.5.23):
- ``Engine.generate(input_ids=..., sampling_params=..., return_logprob=True)`` -> per row
  ``{"output_ids", "meta_info": {"finish_reason": {"type"}, "output_token_logprobs":
  [(logprob, token_id, text), ...]}}``. Each (prompt, sample) is its own row with its own
  ``sampling_seed``, so ``n`` needs no engine support.
- weights: ``begin_weight_update()``, ``update_weights_from_tensor(named_tensors,
  load_format=None, flush_cache=False)`` once per bucket, ``end_weight_update()``, then
  ``flush_cache()`` unless the KV cache is released (releasing it flushed it).
- memory: ``release_memory_occupation()`` releases every tag (``kv_cache``, ``weights``,
  ``cuda_graph``); ``resume_memory_occupation(["weights"])`` before the weight sync and
  ``resume_memory_occupation(["kv_cache", "cuda_graph"])`` after it. SGLang refuses to resume
  a tag that is not released, so the two resumes must cover exactly what was released.

Log-probs: SGLang's ``output_token_logprobs`` are ``log(softmax(logits / temperature))`` of
the sampled token (its sampler divides by the temperature before the softmax) - the project's
convention - unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set, which returns raw-logit
log-probs: the engine refuses to start with it set.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..weight_sync import iter_buckets
from .base import (GenerationResult, MemoryRelease, RolloutEngine, SamplingParams, batch_indices, register_engine,
                   sample_seed)
from .phases import EngineMemory
from .spec import EngineSpec

__all__ = ["RAW_LOGPROB_ENV", "SGLangEngine", "engine_kwargs", "sglang_engine_class", "sglang_rows",
           "to_result"]

log = logging.getLogger(__name__)

RAW_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
"""SGLang's switch to raw-logit log-probs (read by its sampler); must stay off."""
RESUME_WEIGHTS_TAGS = ["weights"]
RESUME_KV_TAGS = ["kv_cache", "cuda_graph"]


def engine_kwargs(spec: EngineSpec) -> dict:
    """The spec in ``sglang.Engine``'s arguments (its ``ServerArgs`` fields)."""
    return {"model_path": spec.model_path, "tp_size": spec.tp, "dtype": spec.dtype,
            "context_length": spec.context_length, "mem_fraction_static": spec.gpu_memory_utilization,
            "base_gpu_id": spec.devices.base_gpu_id, "random_seed": spec.seed, "skip_tokenizer_init": True,
            "enable_memory_saver": spec.devices.shares_trainer_gpus}


def check_logprob_env(env=os.environ) -> None:
    """SGLang must return log-probs after temperature: refuse a raw-log-prob switch."""
    if env.get(RAW_LOGPROB_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        raise ValueError(f"{RAW_LOGPROB_ENV} is set: SGLang would return raw-logit log-probs, not the "
                         f"temperature-scaled ones the trainer computes; unset it")


def sglang_engine_class():
    """``sglang.Engine``; ValueError on a machine without CUDA (SGLang has no CPU path)."""
    if not torch.cuda.is_available():
        raise ValueError("the sglang engine needs a CUDA GPU (SGLang has no CPU path); "
                         "use rollout engine 'hf' or 'vllm' on CPU")
    import sglang

    return sglang.Engine


def sglang_rows(prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                prompt_indices: Optional[Sequence[int]] = None
                ) -> Tuple[List[Tuple[int, int]], List[List[int]], List[dict]]:
    """``(rows, input_ids, sampling_params)``: one SGLang request row per (prompt, sample); a
    row is ``(batch index of the prompt, sample index)`` (see ``RolloutEngine.generate``)."""
    idx = batch_indices(prompt_token_ids, prompt_indices)
    local = {g: p for p, g in enumerate(idx)}
    rows = [(g, s) for g in idx for s in range(params.n)]
    sp = []
    for p, s in rows:
        d = {"temperature": params.temperature, "top_p": params.top_p,
             "top_k": params.top_k if params.top_k > 0 else -1,
             "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
             "ignore_eos": params.ignore_eos}
        if params.seed is not None:
            d["sampling_seed"] = sample_seed(sample_seed(params.seed, p), s)
        sp.append(d)
    return rows, [list(prompt_token_ids[local[p]]) for p, _ in rows], sp


def to_result(row: Tuple[int, int], out: dict) -> GenerationResult:
    """One SGLang output row -> our result."""
    meta = out["meta_info"]
    reason = meta["finish_reason"]["type"]
    if reason == "abort":
        raise RuntimeError(f"SGLang aborted a request: {meta['finish_reason']}")
    toks = list(out["output_ids"])
    lps = torch.tensor([float(lp) for lp, _tid, *_ in meta["output_token_logprobs"]], dtype=torch.float32)
    return GenerationResult(row[0], row[1], toks, lps, reason)


@register_engine("sglang")
class SGLangEngine(RolloutEngine):
    """Colocated ``sglang.Engine`` in the trainer's process (GPU).

    Args:
        model_path: HF checkpoint directory.
        bucket_bytes: tensors per ``update_weights_from_tensor`` call.
        engine: an already-built engine object (tests inject a fake); default builds
            ``sglang_engine_class()(model_path=model_path, **kwargs)``.
        **kwargs: ``ServerArgs`` fields (``engine_kwargs(spec)`` from the spec).
    """

    def __init__(self, model_path: str, *, bucket_bytes: int = 512 << 20, engine=None, **kwargs):
        if engine is None:
            check_logprob_env()
            kwargs.setdefault("enable_memory_saver", True)
            engine = sglang_engine_class()(model_path=str(model_path), **kwargs)
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self._memory_saver = bool(kwargs.get("enable_memory_saver", True))

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> "SGLangEngine":
        kw = engine_kwargs(spec)
        return cls(kw.pop("model_path"), bucket_bytes=spec.sync_bucket_bytes, **kw)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                 prompt_indices: Optional[Sequence[int]] = None) -> List[GenerationResult]:
        self.check_can_generate()
        rows, input_ids, sp = sglang_rows(prompt_token_ids, params, prompt_indices)
        outs = self.engine.generate(input_ids=input_ids, sampling_params=sp, return_logprob=True)
        return [to_result(r, o) for r, o in zip(rows, outs)]

    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        self.check_can_load_weights()
        self.engine.begin_weight_update()
        try:
            for bucket in iter_buckets(named_tensors, self.bucket_bytes):
                self.engine.update_weights_from_tensor(named_tensors=bucket, load_format=None,
                                                       flush_cache=False)
        finally:
            self.engine.end_weight_update()
        if self.memory is EngineMemory.AWAKE:  # a released KV cache was flushed when released
            self.engine.flush_cache()

    # ------------------------------------------------------------------ memory phases
    @property
    def memory_release(self) -> MemoryRelease:
        if not self._memory_saver:
            return MemoryRelease(False, "the engine was built without enable_memory_saver")
        return MemoryRelease(True, "SGLang memory saver: weights, KV cache and CUDA graphs released")

    def _release(self) -> bool:
        if not self._memory_saver:
            return False
        self.engine.release_memory_occupation()
        return True

    def _resume_weights(self) -> None:
        if self._memory_saver:
            self.engine.resume_memory_occupation(tags=RESUME_WEIGHTS_TAGS)

    def _resume_kv(self) -> None:
        if self._memory_saver:
            self.engine.resume_memory_occupation(tags=RESUME_KV_TAGS)

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()
