# Shared by the launch scripts (sourced, not run): argument parsing and the plan / print / run tail.

# parse_args "$@": sets MODE (train | plan | print) and EXTRA (the a.b=c overrides, applied last).
parse_args() {
  MODE=train
  EXTRA=()
  for arg in "$@"; do
    case "$arg" in
      --dry-run) MODE=plan ;;
      --print-cmd) MODE=print ;;
      -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
      *) EXTRA+=("$arg") ;;
    esac
  done
}

# launch_multinode: with $CONFIG and the ARGS array, print the plan (--dry-run), print the command
# (--print-cmd) or run multi-node torchrun from NNODES NODE_RANK GPUS_PER_NODE MASTER_ADDR/PORT.
launch_multinode() {
  if [[ $MODE == plan ]]; then
    local hf_config=$FALLBACK_HF_CONFIG
    [[ -f $MODEL_DIR/config.json ]] && hf_config=$MODEL_DIR/config.json
    exec "$PYTHON" -m megatron_stare.plan --config "$CONFIG" --world-size $((NNODES * GPUS_PER_NODE)) \
      --gpu-mem-gb "$GPU_MEM_GB" --hf-config "$hf_config" "${ARGS[@]}"
  fi
  local cmd=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK"
             --nproc-per-node "$GPUS_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
             -m megatron_stare.train --config "$CONFIG" "${ARGS[@]}")
  if [[ $MODE == print ]]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
  fi
  export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron's TP/SP communication overlap relies on it
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} TOKENIZERS_PARALLELISM=false
  mkdir -p "$RUN_DIR"
  exec "${cmd[@]}"
}
