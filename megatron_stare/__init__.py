"""megatron-stare: RL post-training of LLMs on Megatron-core with STARE as the policy loss."""

__version__ = "0.1.0"
