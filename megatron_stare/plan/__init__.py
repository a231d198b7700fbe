"""The resource planner: memory, MoE, offload and weight-sync estimates of a run before it starts.

``python -m megatron_stare.plan`` prints the plan (``planner.main``)."""
