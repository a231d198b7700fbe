"""The CPU demo: GRPO vs STARE on policy entropy, from the same supervised warm start.

``python -m megatron_stare.demo.run`` (see docs/demo.md): tiny Qwen2-style model -> supervised
warm start (``sft``) -> GRPO and STARE runs from the same start through the real trainer
(torchrun, TP=2 Megatron actor, ``hf`` engine) -> metrics JSONL and a PNG. ``repro`` repeats the
comparison over seeds and prints a table.
"""
