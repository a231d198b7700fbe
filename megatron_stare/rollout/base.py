"""The rollout-engine interface, its typed request/result, and the engine registry.

Every engine (``hf``, ``vllm``, ``vllm-server``, ``sglang``, ``sglang-server``) takes prompts as
token ids and returns, for every prompt and every one of its ``n`` samples, the response token
ids, the engine's log-prob of each sampled token (fp32) and why generation stopped.

Log-prob convention (all engines, one at any temperature): the log-prob of the sampled token
under the distribution it was sampled from, ``log_softmax(filter(logits / temperature))`` in
fp32, where ``filter`` applies top-k / top-p (masked tokens at ``-inf``, the rest renormalised)
- vLLM's ``processed_logprobs`` mode. Greedy calls (temperature 0) return ``log_softmax(logits)``.
Training rollouts sample without top-k / top-p (``config_checks`` refuses them), so the
engine's log-probs are those of ``softmax(logits / temperature)``: exactly what the trainer's
log-prob pass computes at the rollout temperature, and the mismatch metric and TIS compare
like with like at any temperature.

Stopping: a response ends at ``max_new_tokens`` (``finish_reason="length"``) or at the first
token in ``stop_token_ids`` or the model's EOS ids unless ``ignore_eos`` (``"stop"``). The stop
token IS included in ``token_ids`` (and has a log-prob), as in vLLM.

Weight updates take a stream of HF-named tensors (``model.layers.0.self_attn.q_proj.weight``,
...), typically the Megatron streaming export; engines reset their prefix / KV caches after
every update, so no token is ever computed from stale weights.

Preemption inside a step (``step_interrupt.py``): ``generate`` asks ``interrupted()`` between
decode steps (or while it waits on a server) and, once it is True, ends its requests and raises
``preemption.StepInterrupted``.

Memory phases (``runtime/phases.py``): ``release_memory()`` (step phase 4), then
``resume_weights()`` (6), the weight sync (7), ``resume_kv_cache()`` (8). The base class
enforces that order (``memory``: AWAKE -> RELEASED -> WEIGHTS -> AWAKE), refuses ``generate``
unless AWAKE and weight updates unless the weights are resident. An engine that cannot free
memory goes through the same states, says so once in the log, and ``release_memory()``
returns False: it never pretends.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from torch import Tensor

from megatron_stare.weight_sync import TensorChecksum, assemble
from megatron_stare.runtime.phases import EngineMemory

if TYPE_CHECKING:
    from megatron_stare.rollout.spec import EngineSpec

__all__ = ["GenerationResult", "MemoryRelease", "RolloutEngine", "SamplingParams", "batch_indices",
           "sample_seed"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy (then top-k / top-p / seed do not matter)."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus mass in ``(0, 1]``; 1 disables."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens; 0 disables."""
    max_new_tokens: int = 64
    stop_token_ids: Tuple[int, ...] = ()
    """Extra stop tokens, on top of the model's EOS ids."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS ids (``stop_token_ids`` still stop)."""
    seed: Optional[int] = None
    """Makes a call reproducible. Prompt ``i`` is sampled with ``sample_seed(seed, i)``."""

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def batch_indices(prompt_token_ids: Sequence[Sequence[int]], prompt_indices: Optional[Sequence[int]]
                  ) -> List[int]:
    """The batch index of each prompt of a ``generate`` call (see ``RolloutEngine.generate``)."""
    if prompt_indices is None:
        return list(range(len(prompt_token_ids)))
    if len(prompt_indices) != len(prompt_token_ids):
        raise ValueError(f"{len(prompt_indices)} prompt_indices for {len(prompt_token_ids)} prompts")
    return [int(i) for i in prompt_indices]


def sample_seed(seed: int, prompt_index: int) -> int:
    """The per-prompt seed every engine uses: distinct prompts get distinct streams."""
    return (seed * 1_000_003 + prompt_index) % (2 ** 63 - 1)


@dataclass
class GenerationResult:
    """One sampled response.

    ``token_ids``: ``[T]`` response tokens (prompt excluded; a stop token included).
    ``logprobs``: ``[T]`` float32, the engine's log-prob of each sampled token (see the module
    docstring for the convention). ``finish_reason``: ``"stop"`` or ``"length"``.
    ``versions``: ``[T]`` the policy version that produced each token, set by partial rollouts
    (``rollout/partial.py``), whose responses can span a weight update; None when one version
    produced the whole response.
    ``routed_experts``: ``[P + T - 1, num_moe_layers, topk]`` int16, the experts the engine's
    router chose (top-k order as vLLM returns them) at every position it ran: the ``P`` prompt
    positions (prefill; also for a prefix served from vLLM's prefix cache) and response positions
    ``0..T-2`` (the last sampled token is never run), MoE layers only, in model order (vLLM's
    rows of dense layers are dropped: ``rollout/routed_experts.py``). Row ``i`` routes the token
    at position ``i`` of ``prompt + token_ids``. For routing replay (MoE models,
    ``rollout.routing_replay=r3``); None when the engine was not asked for it
    (``return_routed_experts``) or cannot return it (hf, SGLang, vLLM on CPU).
    """

    prompt_index: int
    sample_index: int
    token_ids: List[int]
    logprobs: Tensor
    finish_reason: str
    versions: Optional[List[int]] = None
    routed_experts: Optional[Tensor] = None

    def __post_init__(self):
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")
        if len(self.token_ids) != self.logprobs.numel():
            raise ValueError(f"{len(self.token_ids)} tokens but {self.logprobs.numel()} log-probs")
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.versions)} policy versions")


@dataclass(frozen=True)
class MemoryRelease:
    """What ``release_memory()`` does on an engine: ``frees`` memory or not, and ``how`` (the
    level it releases at, or why it cannot)."""

    frees: bool
    how: str


class RolloutEngine(ABC):
    """A generator of responses whose weights the trainer can replace.

    Results of ``generate`` are ordered prompt-major: prompt 0's ``n`` samples, then prompt 1's.
    """

    name: str = "?"

    @classmethod
    def from_spec(cls, spec: "EngineSpec") -> "RolloutEngine":
        """Build the engine from the run's ``EngineSpec``: each engine translates the spec into
        its own API's arguments."""
        raise NotImplementedError(f"{cls.__name__} does not build from an EngineSpec")

    @abstractmethod
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                 prompt_indices: Optional[Sequence[int]] = None) -> List[GenerationResult]:
        """``len(prompt_token_ids) * params.n`` results, prompt-major.

        ``prompt_indices``: each prompt's index in the whole batch (default ``0..P-1``), which
        seeds it (``sample_seed(params.seed, index)``) and becomes its results' ``prompt_index``:
        a data-parallel replica passes its slice's indices (``rollout/data_parallel.py``), so a
        prompt samples the same stream whichever replica generates it.
        """

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        """Load HF-named tensors (a lazy stream is fine) and reset caches derived from weights.

        Tensors must not be modified by the producer after being yielded: an engine may keep a
        reference until all pieces of a fused parameter have arrived.
        """

    def update_weights_from_buckets(self, buckets: Iterable) -> None:
        """``update_weights`` from a stream of buckets, each an iterable of ``(name, tensor)``
        (e.g. the Megatron export's ``weight_sync.FlatBucket``s). Byte transports override this to move
        already-flat buckets without repacking them. Tensors sent in pieces (the export's
        ``pieces=True``) are joined first (``weight_sync.assemble``)."""
        self.update_weights(assemble(buckets))

    # ------------------------------------------------------------------ memory phases
    @property
    def memory(self) -> EngineMemory:
        """What the engine holds now: AWAKE, RELEASED or WEIGHTS (see the module docstring)."""
        return self.__dict__.get("_memory", EngineMemory.AWAKE)

    @property
    def memory_release(self) -> MemoryRelease:
        """Whether ``release_memory()`` frees memory here, and how (or why not)."""
        return MemoryRelease(False, "this engine cannot release memory")

    def release_memory(self) -> bool:
        """Step phase 4: free weights and KV cache for the trainer's turn. True if memory was
        freed; an engine that cannot free it says why (once) and returns False."""
        self._expect(EngineMemory.AWAKE, "release_memory()")
        how = self.memory_release
        if not how.frees:
            self.say_once(f"{self.name} engine: cannot release memory ({how.how}); it stays allocated "
                          f"while the trainer trains")
        freed = self._release() and how.frees
        self.__dict__["_memory"] = EngineMemory.RELEASED
        return freed

    def resume_weights(self) -> None:
        """Step phase 6: restore the weight memory (before the weight sync fills it)."""
        self._expect(EngineMemory.RELEASED, "resume_weights()")
        self._resume_weights()
        self.__dict__["_memory"] = EngineMemory.WEIGHTS

    def resume_kv_cache(self) -> None:
        """Step phase 8: restore the KV cache (after the weights, which it is sized around)."""
        self._expect(EngineMemory.WEIGHTS, "resume_kv_cache()")
        self._resume_kv()
        self.__dict__["_memory"] = EngineMemory.AWAKE

    # Hooks of the memory phases; the defaults do nothing (an engine that cannot release).
    def _release(self) -> bool:
        return False

    def _resume_weights(self) -> None:
        pass

    def _resume_kv(self) -> None:
        pass

    def _expect(self, state: EngineMemory, call: str) -> None:
        if self.memory is not state:
            raise RuntimeError(f"{self.name} engine: {call} needs its memory {state.name}, but it is "
                               f"{self.memory.name}; the step's order is release_memory -> "
                               f"resume_weights -> weight sync -> resume_kv_cache")

    def check_can_generate(self) -> None:
        """Engines call this first in ``generate``: only an AWAKE engine generates."""
        self._expect(EngineMemory.AWAKE, "generate()")

    def check_can_load_weights(self) -> None:
        """Engines call this first in ``update_weights``: the weights must be resident."""
        if self.memory is EngineMemory.RELEASED:
            raise RuntimeError(f"{self.name} engine: weight update while its memory is RELEASED; "
                               f"call resume_weights() first")

    # ------------------------------------------------------------------ preemption inside a step
    def set_interrupt(self, check: Callable[[], bool]) -> None:
        """``check()`` becomes True when a preemption signal asks the running ``generate`` to
        stop (``step_interrupt.py``): the engine then ends its requests and raises
        ``preemption.StepInterrupted``, and stays usable (or closable)."""
        self.__dict__["_interrupt"] = check

    def interrupted(self) -> bool:
        """Whether ``generate`` must stop now (engines ask between decode steps)."""
        check = self.__dict__.get("_interrupt")
        return bool(check is not None and check())

    def say_once(self, msg: str) -> None:
        """Log ``msg`` as a warning the first time this engine says it."""
        said = self.__dict__.setdefault("_said", set())
        if msg not in said:
            said.add(msg)
            log.warning("%s", msg)

    def checksum(self, names: Sequence[str]) -> Dict[str, Optional[TensorChecksum]]:
        """Checksums of the HF tensors ``names`` as the engine holds them (None: unavailable)."""
        raise NotImplementedError(f"{self.name} engine does not implement checksum()")

    def shutdown(self) -> None:
        """Free the engine's resources (processes, memory). Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
