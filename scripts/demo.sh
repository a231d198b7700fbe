#!/usr/bin/env bash
# The CPU demo (docs/demo.md): GRPO vs STARE on policy entropy, from the same supervised warm start.
# Bootstraps .venv with the CPU recipe (scripts/bootstrap.sh; idempotent, fast when up to date),
# then runs `python -m megatron_stare.demo.run`: tiny Qwen2 model + BPE tokenizer built offline,
# supervised warm start on pick_sum (pick 2 of 6 digits that sum to N: several correct answers),
# GRPO and STARE runs from the same start through torchrun (2 ranks, TP=2 Megatron actor, `hf`
# engine), metrics JSONL + TensorBoard, and the figure runs/demo/demo.png. About 5 minutes on 2
# cores (after the bootstrap); progress lines with an ETA show on the console during the warm start
# and each RL run (the full trainer output is in train.log).
#
# Usage: scripts/demo.sh [--out runs/demo] [--seed 0] [--steps 250] [--target-ratio 0.35] [--quick] [a.b=c ...]
#   scripts/demo.sh --study    the entropy study instead (every method x 3 seeds; docs/study.md;
#                              python -m megatron_stare.demo.study; about 2 hours, resumable)
#   scripts/demo.sh --study --task hop_path   study v2 (docs/study.md, "Study v2"; scripts/study_v2.sh)
# Environment: VENV (.venv), NO_VLLM=1 to bootstrap without vLLM (the demo does not use it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
VENV=$VENV bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
MODULE=megatron_stare.demo.run
if [[ ${1:-} == --study ]]; then
  MODULE=megatron_stare.demo.study
  shift
fi
exec "$VENV/bin/python" -m "$MODULE" "$@"
