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
``enable_memory_saver`` (needed by ``release_memory_occupation``); for a mixture-of-experts
policy ``ep_size`` = ``tp_size`` and, for routing replay, ``enable_return_routed_experts``
(``moe_kwargs``; results then carry ``meta_info["routed_experts"]``: ``to_result``).

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
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..weight_sync import iter_buckets
from .base import (GenerationResult, MemoryRelease, RolloutEngine, SamplingParams, batch_indices, register_engine,
                   sample_seed)
from .phases import EngineMemory
from .routed_experts import MoELayout, decode_sglang, moe_layout, to_result_layout
from .spec import EngineSpec

__all__ = ["RAW_LOGPROB_ENV", "SGLangEngine", "engine_kwargs", "sglang_engine_class", "sglang_rows",
           "to_result"]

log = logging.getLogger(__name__)

RAW_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
"""SGLang's switch to raw-logit log-probs (read by its sampler); must stay off."""
RESUME_WEIGHTS_TAGS = ["weights"]
RESUME_KV_TAGS = ["kv_cache", "cuda_graph"]


def engine_kwargs(spec: EngineSpec) -> dict:
    """The spec in ``sglang.Engine``'s arguments (its ``ServerArgs`` fields), plus ``moe_kwargs``."""
    return {"model_path": spec.model_path, "tp_size": spec.tp, "dtype": spec.dtype,
            "context_length": spec.context_length, "mem_fraction_static": spec.gpu_memory_utilization,
            "base_gpu_id": spec.devices.base_gpu_id, "random_seed": spec.seed, "skip_tokenizer_init": True,
            "enable_memory_saver": spec.devices.shares_trainer_gpus, **moe_kwargs(spec)}


def moe_kwargs(spec: EngineSpec) -> dict:
    """A mixture-of-experts policy: SGLang's expert parallel over the engine's TP group
    (``ep_size = tp_size``: each GPU holds whole experts, 1/tp of them, instead of a 1/tp slice
    of every expert), and ``enable_return_routed_experts`` when the spec asks for the routing
    (``return_routed_experts``: routing replay). Nothing for a dense model."""
    local = Path(spec.model_path) / "config.json"
    if not local.is_file():  # a server command printed for another node: its flags are the user's
        return {}
    if moe_layout(spec.model_path) is None:
        if spec.return_routed_experts:
            raise ValueError(f"return_routed_experts: {spec.model_path} is not a mixture-of-experts model")
        return {}
    kw = {"ep_size": spec.tp}
    if spec.return_routed_experts:
        kw["enable_return_routed_experts"] = True
    return kw


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


def to_result(row: Tuple[int, int], out: dict, moe: Optional[MoELayout] = None) -> GenerationResult:
    """One SGLang output row -> our result; ``moe``: read its routed experts too."""
    meta = out["meta_info"]
    reason = meta["finish_reason"]["type"]
    if reason == "abort":
        raise RuntimeError(f"SGLang aborted a request: {meta['finish_reason']}")
    toks = list(out["output_ids"])
    lps = torch.tensor([float(lp) for lp, _tid, *_ in meta["output_token_logprobs"]], dtype=torch.float32)
    routed = None
    if moe is not None:
        if meta.get("routed_experts") is None:
            raise RuntimeError("SGLang returned no routed experts (start it with enable_return_routed_experts)")
        routed = to_result_layout(decode_sglang(meta["routed_experts"], moe), moe.layers)
    return GenerationResult(row[0], row[1], toks, lps, reason, routed_experts=routed)


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
        # Routing replay: every result carries SGLang's routed experts (GenerationResult.routed_experts).
        self._moe = moe_layout(str(model_path)) if kwargs.get("enable_return_routed_experts") else None
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
        extra = {"return_routed_experts": True} if self._moe is not None else {}
        outs = self.engine.generate(input_ids=input_ids, sampling_params=sp, return_logprob=True, **extra)
        return [to_result(r, o, self._moe) for r, o in zip(rows, outs)]

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
