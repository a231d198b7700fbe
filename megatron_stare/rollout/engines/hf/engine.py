"""``hf``: the embedded rollout engine - a transformers model and our own sampling loop.

The CPU default (no server, no extra process): good for tests, the tiny demo and as the
reference the other engines are checked against. It runs the model in the trainer's process in
the checkpoint's dtype (fp32 for the equality tests) with a KV cache.

Batching: rows (prompt x sample) whose prompts have the same length run together, so there is
no padding and every row computes exactly what a single-sequence forward computes. Sampling
draws each row's noise from its own generator seeded with ``sample_seed(sample_seed(seed,
prompt), sample)``, so a seeded call gives the same tokens whatever the batch composition.

Log-probs (``rollout/base.py``): of the sampled token under the distribution it was sampled
from, ``log_softmax(filter_logits(logits, temperature, top_k, top_p))`` - vLLM's
``processed_logprobs``; greedy calls return ``log_softmax(logits)``.

Weights: ``update_weights`` copies each HF tensor into the parameter of the same name (tied
embeddings share storage, so either name updates both). There is no cache kept between calls,
so nothing else needs resetting.

Preemption: ``generate`` checks ``interrupted()`` between decode steps and raises
``StepInterrupted`` (nothing outlives the call, so the engine stays usable).

Memory: on a GPU ``release_memory`` moves the model to host memory and empties the allocator's
cache (the KV cache lives only inside a ``generate`` call); ``resume_weights`` moves it back.
On CPU there is nothing to free: it says so once.
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_stare.runtime.preemption import StepInterrupted
from megatron_stare.weight_sync import TensorChecksum, tensor_checksum
from megatron_stare.rollout.base import (GenerationResult, MemoryRelease, RolloutEngine, SamplingParams, batch_indices, sample_seed)
from megatron_stare.rollout.spec import EngineSpec

__all__ = ["HFEngine", "filter_logits", "hf_engine_kwargs", "score_tokens"]

log = logging.getLogger(__name__)


def filter_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """``[R, V]`` fp32 logits -> temperature-scaled logits with filtered tokens at ``-inf``.

    top-k keeps the ``top_k`` largest (ties at the boundary kept); top-p keeps the smallest
    prefix of tokens sorted by probability whose mass reaches ``top_p`` (at least one token).
    """
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def hf_engine_kwargs(spec: EngineSpec) -> dict:
    """The spec in ``HFEngine``'s arguments: the policy's dtype, on the driver's GPU (or CPU)."""
    return {"device": f"cuda:{spec.devices.base_gpu_id}" if spec.cuda else "cpu",
            "dtype": {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]}


class HFEngine(RolloutEngine):
    """Embedded transformers engine.

    Args:
        model_path: HF checkpoint directory.
        device: default CUDA when available, else CPU.
        dtype: parameter dtype (fp32 by default: log-probs comparable to the trainer's fp32).
        max_batch_rows: most rows per forward pass.
    """

    name = "hf"

    def __init__(self, model_path: str, *, device: Optional[str] = None,
                 dtype: torch.dtype = torch.float32, max_batch_rows: int = 64):
        import transformers

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=dtype).to(self.device).eval()
        self.max_batch_rows = max_batch_rows
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        # state_dict() holds every HF name (both names of tied weights), sharing storage.
        self._tensors: Dict[str, Tensor] = self.model.state_dict(keep_vars=False)

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> "HFEngine":
        return cls(spec.model_path, **hf_engine_kwargs(spec))

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                 prompt_indices: Optional[Sequence[int]] = None) -> List[GenerationResult]:
        self.check_can_generate()
        idx = batch_indices(prompt_token_ids, prompt_indices)
        base_seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2 ** 62)
        rows_by_len: Dict[int, List[Tuple[int, int]]] = defaultdict(list)
        for p, ids in enumerate(prompt_token_ids):
            if len(ids) == 0:
                raise ValueError(f"prompt {p} is empty; every prompt needs at least one token")
            for s in range(params.n):
                rows_by_len[len(ids)].append((p, s))
        out: Dict[Tuple[int, int], GenerationResult] = {}
        for rows in rows_by_len.values():
            for i in range(0, len(rows), self.max_batch_rows):
                chunk = rows[i:i + self.max_batch_rows]
                prompts = [prompt_token_ids[p] for p, _ in chunk]
                seeds = [sample_seed(sample_seed(base_seed, idx[p]), s) for p, s in chunk]
                for (p, s), (toks, lps, reason) in zip(chunk, self._generate_rows(prompts, seeds, params)):
                    out[(p, s)] = GenerationResult(idx[p], s, toks, torch.tensor(lps, dtype=torch.float32),
                                                   reason)
        return [out[(p, s)] for p in range(len(prompt_token_ids)) for s in range(params.n)]

    def _generate_rows(self, prompts: List[Sequence[int]], seeds: List[int], params: SamplingParams):
        """Generate for equal-length prompts; returns ``[(tokens, logprobs, reason)]`` per row."""
        R = len(prompts)
        ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=self.device)
        gens = None
        if not params.greedy:
            gens = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
        toks: List[List[int]] = [[] for _ in range(R)]
        lps: List[List[float]] = [[] for _ in range(R)]
        reasons: List[Optional[str]] = [None] * R
        out = self.model(input_ids=ids, use_cache=True)
        for step in range(params.max_new_tokens):
            logits = out.logits[:, -1, :].float()
            if not params.greedy:  # the distribution sampled from (the log-prob convention)
                logits = filter_logits(logits, params.temperature, params.top_k, params.top_p)
            logp = torch.log_softmax(logits, dim=-1)
            nxt = self._sample(logits, params, gens)
            chosen = logp.gather(-1, nxt[:, None])[:, 0].tolist()
            for r, (t, lp) in enumerate(zip(nxt.tolist(), chosen)):
                if reasons[r] is not None:
                    continue
                toks[r].append(t)
                lps[r].append(lp)
                if t in stop:
                    reasons[r] = "stop"
                elif step + 1 == params.max_new_tokens:
                    reasons[r] = "length"
            if all(reason is not None for reason in reasons):
                break
            if self.interrupted():  # a preemption signal: the step's start is saved instead
                raise StepInterrupted("generate")
            out = self.model(input_ids=nxt[:, None], past_key_values=out.past_key_values,
                             use_cache=True)
        return list(zip(toks, lps, reasons))

    def _sample(self, x: Tensor, params: SamplingParams, gens) -> Tensor:
        """``[R, V]`` fp32 logits (filtered, unless greedy) -> ``[R]`` sampled ids (Gumbel-max
        with per-row generators)."""
        if params.greedy:
            return x.argmax(dim=-1)
        V = x.shape[-1]
        u = torch.stack([torch.rand(V, generator=g, device=self.device, dtype=torch.float64)
                         for g in gens])
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        return (x.double() + gumbel).argmax(dim=-1)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        self.check_can_load_weights()
        n = 0
        for name, t in named_tensors:
            dst = self._tensors.get(name)
            if dst is None:
                raise ValueError(f"hf engine: the model has no tensor named {name!r}; "
                                 f"send HF checkpoint names")
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(f"hf engine: {name} has shape {tuple(dst.shape)}, "
                                 f"received {tuple(t.shape)}")
            dst.copy_(t)
            n += 1
            # Drop our view before pulling the next tensor: a receiver's bucket buffer can then
            # be freed before the next bucket is allocated (peak = one bucket, not two).
            del t
        log.info("hf engine: updated %d tensors", n)

    def checksum(self, names: Sequence[str]) -> Dict[str, Optional[TensorChecksum]]:
        return {n: tensor_checksum(self._tensors[n]) if n in self._tensors else None for n in names}

    # ------------------------------------------------------------------ memory
    @property
    def memory_release(self) -> MemoryRelease:
        if self.device.type != "cuda":
            return MemoryRelease(False, f"its weights already live in host memory ({self.device})")
        return MemoryRelease(True, "weights moved to host memory, the allocator's cache emptied")

    def _release(self) -> bool:
        if self.device.type != "cuda":
            return False
        self.model.to("cpu")
        # The name -> tensor map shares the parameters' storage: left pointing at the GPU copies,
        # it would keep every weight on the device (found by the GPU test's first run).
        self._tensors = self.model.state_dict(keep_vars=False)
        torch.cuda.empty_cache()
        return True

    def _resume_weights(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
            self._tensors = self.model.state_dict(keep_vars=False)

    def shutdown(self) -> None:
        self.__dict__.pop("model", None)
        self._tensors = {}


@torch.no_grad()
def score_tokens(model, prompt_token_ids: Sequence[int], response_token_ids: Sequence[int],
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``[T]`` fp32 log-probs of ``response_token_ids`` after the prompt under a transformers
    ``model``, in the engines' convention: one full forward (no KV cache), ``log_softmax`` of
    ``filter_logits(logits, temperature, top_k, top_p)`` (the raw logits at the defaults)."""
    ids = torch.tensor([list(prompt_token_ids) + list(response_token_ids)],
                       device=next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0].float()
    P, T = len(prompt_token_ids), len(response_token_ids)
    logp = torch.log_softmax(filter_logits(logits[P - 1:P - 1 + T], temperature, top_k, top_p), dim=-1)
    return logp.gather(-1, ids[0, P:P + T, None])[:, 0].cpu()
