"""Math kernels: vocab-parallel log-prob / entropy (with and without logits) and exact selection."""

from megatron_stare.ops.fused_linear import fused_linear_logprobs_entropy
from megatron_stare.ops.selection import (
    TopKThreshold,
    kth_largest,
    topk_mask,
    topk_threshold,
    topk_thresholds,
)
from megatron_stare.ops.vocab_parallel import LogProbOutput, vocab_parallel_logprobs_entropy

__all__ = [
    "LogProbOutput",
    "TopKThreshold",
    "fused_linear_logprobs_entropy",
    "kth_largest",
    "topk_mask",
    "topk_threshold",
    "topk_thresholds",
    "vocab_parallel_logprobs_entropy",
]
