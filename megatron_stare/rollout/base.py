"""The rollout-engine interface, its typed request/result, and the engine registry.

Every engine (``hf``, ``vllm``, ``vllm-server``, ``sglang``, ``sglang-server``) takes prompts as
token ids and returns, for every prompt and every one of its ``n`` samples, the response token
ids, the engine's log-prob of each sampled token (fp32) and why generation stopped.

Log-prob convention (all engines): ``log_softmax`` of the model's RAW logits at the sampled
token - before temperature, top-k and top-p - i.e. vLLM's default ``raw_logprobs`` mode. This
is what the trainer's log-prob pass computes at temperature 1 (the STARE setting), so the
train/inference mismatch metric compares like with like.

Stopping: a response ends at ``max_new_tokens`` (``finish_reason="length"``) or at the first
token in ``stop_token_ids`` or the model's EOS ids unless ``ignore_eos`` (``"stop"``). The stop
token IS included in ``token_ids`` (and has a log-prob), as in vLLM.

Weight updates take a stream of HF-named tensors (``model.layers.0.self_attn.q_proj.weight``,
...), typically the Megatron streaming export; engines reset their prefix / KV caches after
every update, so no token is ever computed from stale weights.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type

from torch import Tensor

from ..weight_sync.plan import TensorChecksum

__all__ = ["ENGINES", "GenerationResult", "RolloutEngine", "SamplingParams", "register_engine", "sample_seed"]

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


def sample_seed(seed: int, prompt_index: int) -> int:
    """The per-prompt seed every engine uses: distinct prompts get distinct streams."""
    return (seed * 1_000_003 + prompt_index) % (2 ** 63 - 1)


@dataclass
class GenerationResult:
    """One sampled response.

    ``token_ids``: ``[T]`` response tokens (prompt excluded; a stop token included).
    ``logprobs``: ``[T]`` float32, the engine's log-prob of each sampled token (see the module
    docstring for the convention). ``finish_reason``: ``"stop"`` or ``"length"``.
    """

    prompt_index: int
    sample_index: int
    token_ids: List[int]
    logprobs: Tensor
    finish_reason: str

    def __post_init__(self):
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")
        if len(self.token_ids) != self.logprobs.numel():
            raise ValueError(f"{len(self.token_ids)} tokens but {self.logprobs.numel()} log-probs")


class RolloutEngine(ABC):
    """A generator of responses whose weights the trainer can replace.

    Results of ``generate`` are ordered prompt-major: prompt 0's ``n`` samples, then prompt 1's.
    """

    name: str = "?"

    @abstractmethod
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams
                 ) -> List[GenerationResult]:
        """``len(prompt_token_ids) * params.n`` results, prompt-major."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        """Load HF-named tensors (a lazy stream is fine) and reset caches derived from weights.

        Tensors must not be modified by the producer after being yielded: an engine may keep a
        reference until all pieces of a fused parameter have arrived.
        """

    def update_weights_from_buckets(self, buckets: Iterable) -> None:
        """``update_weights`` from a stream of buckets, each an iterable of ``(name, tensor)``
        (e.g. the Megatron export's ``Bucket`` lists). Byte transports override this to move
        already-flat buckets without repacking them."""
        self.update_weights(item for bucket in buckets for item in bucket)

    @property
    def supports_sleep(self) -> bool:
        """Whether ``sleep()`` really releases memory on this engine and device."""
        return False

    def sleep(self) -> bool:
        """Release weights / KV-cache memory for the trainer's turn. Returns True if memory was
        released; where unsupported logs why and returns False (never pretends)."""
        log.warning("%s engine: sleep is not supported here; memory stays allocated", self.name)
        return False

    def wake_up(self) -> bool:
        """Undo ``sleep()`` (weights first, then KV cache). Returns True if anything was restored."""
        return False

    def checksum(self, names: Sequence[str]) -> Dict[str, Optional[TensorChecksum]]:
        """Checksums of the HF tensors ``names`` as the engine holds them (None: unavailable)."""
        raise NotImplementedError(f"{self.name} engine does not implement checksum()")

    def shutdown(self) -> None:
        """Free the engine's resources (processes, memory). Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


#: name -> engine class; filled by ``@register_engine``.
ENGINES: Dict[str, Type[RolloutEngine]] = {}


def register_engine(name: str) -> Callable[[Type[RolloutEngine]], Type[RolloutEngine]]:
    def deco(cls: Type[RolloutEngine]) -> Type[RolloutEngine]:
        if name in ENGINES:
            raise ValueError(f"rollout engine {name!r} registered twice")
        cls.name = name
        ENGINES[name] = cls
        return cls
    return deco
