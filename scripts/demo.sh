#!/usr/bin/env bash
# The CPU demo (docs/demo.md): GRPO vs STARE on policy entropy, from the same supervised warm start.
# Bootstraps .venv with the CPU recipe (scripts/bootstrap.sh; idempotent, fast when up to date),
# then runs `python -m megatron_stare.demo.run`: tiny Qwen2 model + BPE tokenizer built offline,
# supervised warm start on single-digit addition, GRPO and STARE runs from the same start through
# torchrun (2 ranks, TP=2 Megatron actor, `hf` engine), metrics JSONL + TensorBoard, and the figure
# runs/demo/demo.png. About 4 minutes on 2 cores (after the bootstrap); progress lines with an ETA
# show on the console during the warm start and each RL run (the full trainer output is in train.log).
#
# Usage: scripts/demo.sh [--out runs/demo] [--seed 0] [--steps 300] [--target-ratio 0.6] [--quick] [a.b=c ...]
#   scripts/demo.sh --repro    the 3-seed table instead (python -m megatron_stare.demo.repro; ~12 min)
# Environment: VENV (.venv), NO_VLLM=1 to bootstrap without vLLM (the demo does not use it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
VENV=$VENV bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
MODULE=megatron_stare.demo.run
if [[ ${1:-} == --repro ]]; then
  MODULE=megatron_stare.demo.repro
  shift
fi
exec "$VENV/bin/python" -m "$MODULE" "$@"
