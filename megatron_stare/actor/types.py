"""Typed state that crosses the actor's boundary: its settings and what its passes return."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_stare.config.algorithm import AlgorithmConfig
from megatron_stare.algorithms.off_policy import OffPolicyCorrection
from megatron_stare.config.load import OptimizerConfig, ParallelConfig
from megatron_stare.runtime.parallel import ParallelGroups

WeightLoader = Callable[[torch.nn.Module, ParallelGroups], None]


@dataclass
class ActorSettings:
    """What the actor needs beyond the model: a view of the run config's relevant sections."""

    parallel: ParallelConfig
    optimizer: OptimizerConfig
    algorithm: AlgorithmConfig
    temperature: float = 1.0
    """Log-probs are those of softmax(logits / temperature), the rollout's distribution."""
    dtype: torch.dtype = torch.float32
    total_optimizer_steps: int = 1000
    """Length of the LR schedule (decay steps)."""
    max_rows_per_micro_batch: Optional[int] = None
    logprob_chunk: int = 1024
    off_policy: Optional[OffPolicyCorrection] = None
    """The off-policy correction on the engine's log-probs (``off_policy.resolve_off_policy`` of
    the run's config); None: ``algorithm``'s own (``algorithm.off_policy_correction``)."""
    attention: str = "auto"
    """``model.attention_backend`` (``models.gpt.resolve_attention``)."""
    moe_router_losses: Tuple[float, float] = (0.0, 0.0)
    """Mixture of experts: (load-balancing loss, z-loss) coefficients of the router; 0 = off."""
    routing_replay: str = "none"
    """Mixture of experts: ``rollout.routing_replay`` (none | r3 | r2; ``actor/routing_replay.py``)."""


@dataclass
class StepStats:
    """Global results of the log-prob pass (identical on every rank)."""

    entropy: float
    """Token-mean entropy of the whole training batch (all DP ranks): the controller's input."""
    num_tokens: int
    mismatch_mean: Optional[float] = None
    """Mean |logp_engine - logp_train| over response tokens (when engine log-probs came)."""
    mismatch_max: Optional[float] = None
    ratio_masked_frac: Optional[float] = None
    """Fraction of response tokens the off-policy correction masks (a mask rule on)."""
    replay_metrics: Dict[str, float] = field(default_factory=dict)
    """Routing replay of the pass (``routing_replay.py``'s ``moe/replay_*``); also logged with
    the update's metrics."""


@dataclass
class UpdateResult:
    loss: List[float]
    """Global mini-batch loss per optimizer step."""
    grad_norm: List[float]
    metrics: Dict[str, float] = field(default_factory=dict)
    skipped_steps: int = 0
    optimizer_s: float = 0.0
    """Wall time of the optimizer steps (grad norm, clip, Adam) on this rank, within the update."""
    selected_keys: Optional[List[int]] = None
    """Debug: global keys of STARE-selected tokens (sorted), when requested."""
