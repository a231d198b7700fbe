#!/usr/bin/env bash
# Multi-turn tool use on CPU (examples/tool_use_cpu.yaml): STARE, 2 gloo ranks with TP 2, the `hf`
# engine, the calculator environment. Builds the tiny model, the `mul` prompts and the supervised
# warm start into $TOOL_DIR first if missing (python -m megatron_stare.demo.tool_use).
#
# Usage: launch/train_tool_use_cpu.sh [--dry-run] [--print-cmd] [a.b=c ...]   (overrides applied last;
#   --dry-run needs the warm start's config.json)
# Environment: NPROC (2) TOOL_DIR (runs/tool_use) VENV (see launch/common.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NPROC=${NPROC:-2}
TOOL_DIR=${TOOL_DIR:-runs/tool_use}
CONFIG=examples/tool_use_cpu.yaml

source launch/common.sh
parse_args "$@"

ARGS=(model.path="$TOOL_DIR/sft" data.train_path="$TOOL_DIR/data/train.jsonl"
      checkpoint.dir="$TOOL_DIR/ckpt" logging.dir="$TOOL_DIR/logs" ${EXTRA[@]+"${EXTRA[@]}"})
CMD=("$RUN_PY" "${LAUNCH[@]}" --standalone --nproc-per-node "$NPROC" "${TORCHRUN_SIGNALS[@]}"
     --config "$CONFIG" "${ARGS[@]}")
if [[ $MODE == plan ]]; then
  "$RUN_PY" -m megatron_stare.plan --config "$CONFIG" --world-size "$NPROC" --gpu-mem-gb "${GPU_MEM_GB:-80}" \
    --hf-config "$TOOL_DIR/sft/config.json" "${ARGS[@]}"
  exit $?
fi
if [[ $MODE == print ]]; then
  print_cmd "${CMD[@]}"
  exit 0
fi
if [[ ! -f $TOOL_DIR/sft/config.json || ! -f $TOOL_DIR/data/train.jsonl ]]; then
  "$RUN_PY" -m megatron_stare.demo.tool_use --out "$TOOL_DIR"
fi
"$RUN_PY" -m megatron_stare.config --quiet --config "$CONFIG" --world-size "$NPROC" "${ARGS[@]}" || exit $?
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
run_torchrun "${CMD[@]}"
