"""The CPU demo and the entropy study.

``python -m megatron_stare.demo.run`` (docs/demo.md): tiny Qwen2-style model -> supervised warm
start on ``pick_sum`` (``warm_start``, ``sft``) -> GRPO and STARE runs from the same start through
the real trainer (torchrun, TP=2 Megatron actor, ``hf`` engine) -> metrics JSONL and a PNG.
``python -m megatron_stare.study.v2`` (docs/study.md): every method (``study_methods``) from the
same warm starts over seeds, one rank per run -> the table, goals, figures (``study_report``,
``study_figures``).
"""
