#!/usr/bin/env bash
# The CPU demo (docs/demo.md): GRPO vs STARE on policy entropy, from the same start.
# Bootstraps .venv with the CPU recipe (scripts/bootstrap.sh; idempotent, fast when up to date; it
# also fetches the real model), then runs `python -m megatron_stare.demo.run`:
#   default   the real pretrained model: SmolLM2-135M-Instruct on word problems, GRPO then STARE C2
#             through torchrun (2 ranks, DP2 Megatron actor, colocated vLLM-CPU receiving the weights
#             every step); STARE's target = 0.35 x the first step's entropy. About 15 minutes on 2 cores.
#   --tiny    a tiny random-init model on study v1's pick_sum after a supervised warm start (about 5 min)
#   --quick   CI-sized: 1 step of each real-model run (with --tiny: a tiny warm start, 3 steps each)
# Progress lines with an ETA show on the console during each run (the full trainer output is in
# <out>/{grpo,stare}/train.log); the figure is <out>/demo.png, the table <out>/summary.json.
#
# Usage: scripts/demo.sh [--tiny] [--out runs/demo] [--seed 0] [--steps N] [--target-ratio 0.35] [--quick] [a.b=c ...]
#   scripts/demo.sh --study    the entropy study instead (every method x 3 seeds; docs/study.md;
#                              python -m megatron_stare.study.v2; about 2 hours, resumable)
#   scripts/demo.sh --study --task hop_path   study v2 (docs/study.md, "Study v2"; scripts/study_v2.sh)
# Environment: VENV (.venv), NO_VLLM=1 to bootstrap without vLLM (then only --tiny runs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
VENV=$VENV bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
MODULE=megatron_stare.demo.run
if [[ ${1:-} == --study ]]; then
  MODULE=megatron_stare.study.v2
  shift
fi
exec "$VENV/bin/python" -m "$MODULE" "$@"
