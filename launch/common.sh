# Shared by the launch scripts (sourced, not run): the interpreter, argument parsing, the preflight
# checks and the plan / print / run tail.
#
# PREEMPT_GRACE_S (default 300): seconds torchrun gives its workers to save and exit after a
# preemption signal (see run_torchrun).
#
# The interpreter (RUN_PY): $VENV/bin/python when VENV is set, else the repository's .venv (which
# scripts/bootstrap.sh builds), else python3 from PATH, which must then have torch. PYTHON is not
# read here: it keeps its one meaning, the base interpreter scripts/bootstrap.sh builds .venv from.

fail() { echo "error: $*" >&2; exit 2; }

# Preemption (megatron_stare/runtime/preemption.py): SIGTERM or SIGUSR1 makes the run save at the next
# step boundary and exit 75. torchrun forwards only the signals of --signals-to-handle (SIGUSR1
# is not among its defaults: it would kill torchrun and orphan the workers) and SIGKILLs workers
# --shutdown-timeout seconds after forwarding (default 30): PREEMPT_GRACE_S, which must cover a
# step plus a save (a kill past it leaves the last complete checkpoint). The same timeout bounds
# how long torchrun waits for the other workers after one fails.
# The scripts run torchrun through `python -m megatron_stare.run` (LAUNCH below): it passes these
# options to torchrun, keeps SIGINT for itself (Ctrl-C: one line and exit 130, no torchrun
# traceback; megatron_stare/run.py) and exits with the run's own code.
PREEMPT_GRACE_S=${PREEMPT_GRACE_S:-300}
TORCHRUN_SIGNALS=(--signals-to-handle SIGTERM,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "$PREEMPT_GRACE_S")
LAUNCH=(-m megatron_stare.run)

# run_torchrun CMD...: run the launcher (torchrun inside megatron_stare.run) and relay
# SIGUSR1/SIGTERM sent to this shell (by srun, or a user) to it. A preempted run exits with its
# own code here (75, or 130 after Ctrl-C, or 2 after a user error: megatron_stare.run returns what
# this node's local rank 0 wrote to its status file); torchrun's own code otherwise. The status
# file below is a fallback for a CMD that is bare torchrun (it exits 1 whatever its workers return).
run_torchrun() {
  local status pid= pending= rc=0
  status=$(mktemp "${TMPDIR:-/tmp}/megatron-stare-status.XXXXXX")
  trap 'if [[ -n $pid ]]; then kill -USR1 "$pid" 2>/dev/null || true; else pending=USR1; fi' USR1
  trap 'if [[ -n $pid ]]; then kill -TERM "$pid" 2>/dev/null || true; else pending=TERM; fi' TERM
  # Ctrl-C reaches this shell and torchrun together (one process group); torchrun forwards it to
  # the workers (they save, exit 130). This shell only keeps waiting: a relayed copy would end
  # torchrun in the middle of its shutdown.
  trap ':' INT
  MEGATRON_STARE_STATUS_FILE=$status "$@" &
  pid=$!
  if [[ -n $pending ]]; then kill -"$pending" "$pid" 2>/dev/null || true; fi
  # A trapped signal interrupts `wait`; bash keeps the child's status, so wait until it is gone.
  while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done
  wait "$pid" || rc=$?
  trap - USR1 TERM INT
  if [[ -s $status ]]; then rc=$(<"$status"); fi
  rm -f "$status"
  exit "$rc"
}

# project_python: sets RUN_PY (see above); one line and exit 2 if there is no usable interpreter.
project_python() {
  if [[ -n ${VENV:-} ]]; then
    [[ -x $VENV/bin/python ]] || fail "VENV=$VENV has no bin/python; set VENV to a virtual environment with megatron-stare installed (scripts/bootstrap.sh builds .venv)"
    RUN_PY=$VENV/bin/python
  elif [[ -x .venv/bin/python ]]; then
    RUN_PY=$PWD/.venv/bin/python
  else
    RUN_PY=$(command -v python3 || command -v python) || fail "no .venv and no python3 on PATH; run scripts/bootstrap.sh"
    "$RUN_PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' \
      || fail "no .venv here and $RUN_PY has no torch; run scripts/bootstrap.sh (it builds .venv) or set VENV to an environment with megatron-stare installed"
  fi
}

# parse_args "$@": sets MODE (train | plan | print), EXTRA (the a.b=c overrides, applied last) and RUN_PY.
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
  project_python
}

# print_cmd CMD...: the command, shell-quoted, except a "$MASTER_ADDR" placeholder left for the shell.
print_cmd() {
  local out=() a
  for a in "$@"; do
    if [[ $a == '$MASTER_ADDR' ]]; then out+=('"$MASTER_ADDR"'); else out+=("$(printf '%q' "$a")"); fi
  done
  echo "${out[*]}"
}

# preflight WORLD_SIZE: before any rank starts, check that this node can meet the others
# (megatron_stare.runtime.rendezvous: MASTER_ADDR set, resolvable, reachable within $MASTER_WAIT_S) and
# that the config is valid for the run (python -m megatron_stare.config: one line per problem).
preflight() {
  "$RUN_PY" -m megatron_stare.runtime.rendezvous --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" || exit $?
  "$RUN_PY" -m megatron_stare.config --quiet --config "$CONFIG" --world-size "$1" "${ARGS[@]}" || exit $?
}

# launch_multinode: with $CONFIG and the ARGS array, print the plan (--dry-run), print the command
# (--print-cmd) or run multi-node torchrun from NNODES NODE_RANK GPUS_PER_NODE MASTER_ADDR/PORT.
# MASTER_ADDR is required when NNODES > 1 (torchrun would default it to 127.0.0.1 and hang).
launch_multinode() {
  if [[ $MODE == plan ]]; then
    local hf_config=$FALLBACK_HF_CONFIG
    [[ -f $MODEL_DIR/config.json ]] && hf_config=$MODEL_DIR/config.json
    exec "$RUN_PY" -m megatron_stare.plan --config "$CONFIG" --world-size $((NNODES * GPUS_PER_NODE)) \
      --gpu-mem-gb "$GPU_MEM_GB" --hf-config "$hf_config" "${ARGS[@]}"
  fi
  if [[ -z $MASTER_ADDR && $NNODES -eq 1 ]]; then
    MASTER_ADDR=127.0.0.1
  fi
  local cmd=("$RUN_PY" "${LAUNCH[@]}" --nnodes "$NNODES" --node-rank "$NODE_RANK"
             --nproc-per-node "$GPUS_PER_NODE" --master-addr "${MASTER_ADDR:-\$MASTER_ADDR}"
             --master-port "$MASTER_PORT" "${TORCHRUN_SIGNALS[@]}"
             --config "$CONFIG" "${ARGS[@]}")
  if [[ $MODE == print ]]; then
    print_cmd "${cmd[@]}"
    exit 0
  fi
  preflight $((NNODES * GPUS_PER_NODE))
  export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron's TP/SP communication overlap relies on it
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} TOKENIZERS_PARALLELISM=false
  mkdir -p "$RUN_DIR"
  run_torchrun "${cmd[@]}"
}
