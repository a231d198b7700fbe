"""Run configuration: the typed sections, their field ranges, YAML loading with overrides (``load``). The checks of a loaded config and of the run's
inputs are ``megatron_stare.preflight``'s.

``python -m megatron_stare.config --config X.yaml [a.b=c ...]`` prints the resolved config (``megatron_stare.preflight.cli``); it loads no torch."""
