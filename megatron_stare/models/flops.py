"""Model FLOPs of a training step's passes over a batch (the efficiency figure of
``benchmarks/bench_vs_trl.py``).

Counted as the useful multiply-adds (2 FLOPs each) of a Llama-like decoder, per sequence of ``s``
tokens (prompt + response):

- the layers' weight matrices: ``2*N*s``, with ``N`` the q/k/v/o and MLP matrices of all layers
  (no embedding, no norms: a lookup and element-wise work);
- the vocabulary projection, counted once even when tied to the embedding: ``2*h*V*s``;
- causal attention: query ``i`` meets ``i`` keys, each pair a ``q.k`` and an ``a*v`` of
  ``heads*head_dim``: ``4*heads*head_dim * s(s+1)/2`` per layer (kernels that compute the masked
  half as well do more work than this counts).

A forward is that sum; a backward is twice a forward (gradients of inputs and of weights), so
the log-prob pass is 1 forward and an update 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_stare.models.sizes import param_counts


@dataclass(frozen=True)
class FlopShape:
    """What the count needs of a model."""

    hidden: int
    num_layers: int
    heads: int
    head_dim: int
    vocab: int
    layer_matmul_params: int
    """Per layer: attention (q, k, v, o, with biases) and MLP matrices."""

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "FlopShape":
        c = param_counts(hf_config)
        h = hf_config["hidden_size"]
        heads = hf_config["num_attention_heads"]
        return cls(hidden=h, num_layers=c.num_layers, heads=heads,
                   head_dim=hf_config.get("head_dim") or h // heads, vocab=hf_config["vocab_size"],
                   layer_matmul_params=c.attention + c.mlp)

    @property
    def matmul_params(self) -> int:
        """``N``: the layers' matrices, without the (tied or untied) vocabulary projection."""
        return self.num_layers * self.layer_matmul_params

    def forward(self, seq_lens: Sequence[int]) -> float:
        """FLOPs of one forward over sequences of these lengths (each its own causal context)."""
        tokens = sum(seq_lens)
        pairs = sum(s * (s + 1) // 2 for s in seq_lens)
        return (2.0 * (self.matmul_params + self.hidden * self.vocab) * tokens
                + 4.0 * self.num_layers * self.heads * self.head_dim * pairs)


@dataclass(frozen=True)
class StepFlops:
    logprob: float
    """The log-prob pass: one forward."""
    update: float
    """The update: forward and backward (3 forwards) per PPO epoch."""

    @property
    def train(self) -> float:
        return self.logprob + self.update


def step_flops(shape: FlopShape, seq_lens: Sequence[int], *, ppo_epochs: int = 1,
               logprob_pass: bool = True) -> StepFlops:
    """The training phase's FLOPs on a batch of sequences (``seq_lens``: prompt + response)."""
    f = shape.forward(seq_lens)
    return StepFlops(logprob=f if logprob_pass else 0.0, update=3.0 * f * ppo_epochs)
