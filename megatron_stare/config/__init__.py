"""Run configuration: the typed sections, their field ranges, YAML loading with overrides, the checks, and the preflight of a run's inputs.

``python -m megatron_stare.config --config X.yaml [a.b=c ...]`` prints the resolved config (``load.main``); it loads no torch."""
