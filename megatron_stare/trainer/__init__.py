"""The trainer loop's parts (``megatron_stare.train`` reads as the algorithm): a step's phases, generation, async rollouts, batching, offload, metrics and the console."""
