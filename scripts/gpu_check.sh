#!/usr/bin/env bash
# The GPU check: run on ONE CUDA machine the tests the machine can run, in about 8 minutes.
#
# The machine may have CUDA torch, Triton and transformers but no megatron-core, vLLM,
# transformer-engine, SGLang or network. So this script
#   1. installs what it carries: megatron-core (and pytest if missing) from wheels/, fetched
#      beforehand with scripts/fetch_gpu_wheels.sh, into .gpu-deps/ (pip --target, --no-deps,
#      --no-index; put on PYTHONPATH, the system's packages stay as they are);
#   2. says, one line each, what it lacks and therefore skips (vLLM, SGLang, transformer-engine,
#      Apex: the tests that need them skip themselves cleanly);
#   3. runs first the cluster paths (docs/cluster-paths.md: the colocated SGLang engine's CUDA-IPC
#      weight payload and its TP ranks' contexts, then the SGLang and vLLM engine tests), so that a
#      short lease checks them before anything else; then the rest of tests/gpu: the bf16 +
#      distributed-optimizer actor update against fp32, the
#      distributed-optimizer checkpoint round trip, a bf16 TP1 trainer run (2 steps, checkpoint,
#      resume), the torch attention on CUDA (packed, CP chunks, 16k memory, packed vs padded
#      actor), transformer-engine's attention on packed rows when TE is installed, and the
#      vLLM / SGLang engine tests when those engines are installed.
#
# Usage: scripts/gpu_check.sh [--dry-run | --setup-only] [--budget SECONDS] [-- EXTRA_PYTEST_ARGS...]
#   --dry-run     print what would be installed, skipped and run; install and run nothing
#   --setup-only  install what is carried and report what is missing; run no test (no GPU needed)
#   --budget      wall-clock limit of the test run (default 480 s; setup takes well under a minute)
# Env: PYTHON (default python3), WHEELS (default wheels), DEPS_DIR (default .gpu-deps)
# Exit status: pytest's; 0 with a message when there is no CUDA GPU (nothing to check);
# 2 for bad arguments or a missing megatron-core wheel.
# With the project's device tool: run(command="bash scripts/gpu_check.sh", carry=["wheels"]).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
DEPS_DIR=$(realpath -m "${DEPS_DIR:-.gpu-deps}")
BUDGET=480
DRY=0
SETUP_ONLY=0
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --setup-only) SETUP_ONLY=1 ;;
    --budget)
      [ $# -ge 2 ] && [[ "$2" =~ ^[0-9]+$ ]] || { echo "gpu-check: --budget needs a number of seconds" >&2; exit 2; }
      BUDGET=$2; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

say() { echo "[gpu-check] $*"; }
# imports: the module imports (megatron-core, pytest); has: it is installed (engines: importing
# vLLM alone takes many seconds).
imports() { PYTHONPATH="$DEPS_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import $1" >/dev/null 2>&1; }
has() { PYTHONPATH="$DEPS_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
          "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" >/dev/null 2>&1; }
start=$(date +%s)

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  say "no torch importable with $PY; nothing to check"; exit 2
fi
read -r TORCH CUDA_OK GPU PYV < <("$PY" - <<'PY'
import sys, torch
ok = torch.cuda.is_available()
name = torch.cuda.get_device_name(0).replace(" ", "_") if ok else "none"
print(torch.__version__, int(ok), name, f"{sys.version_info.major}{sys.version_info.minor}")
PY
)
say "python cp$PYV, torch $TORCH, GPU: $GPU"
if [ "$CUDA_OK" != 1 ]; then
  say "skip: no CUDA GPU visible, so no GPU test can run here"
  [ "$DRY" = 1 ] || [ "$SETUP_ONLY" = 1 ] || exit 0
fi

# 1. What the machine lacks and this script carries.
install_wheel() {  # wheel file -> $DEPS_DIR, with pip when present, else by unpacking the zip
  if [ "$DRY" = 1 ]; then say "would install $(basename "$1") into $DEPS_DIR"; return 0; fi
  mkdir -p "$DEPS_DIR"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --disable-pip-version-check -q --no-deps --no-index --target "$DEPS_DIR" "$1"
  else
    "$PY" -m zipfile -e "$1" "$DEPS_DIR"
  fi && say "installed $(basename "$1")"
}
if imports megatron.core; then
  say "megatron-core: present"
else
  whl=$(ls "$WHEELS"/megatron_core-0.16.1-cp"$PYV"-cp"$PYV"-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ]; then
    say "megatron-core missing and no cp$PYV wheel in $WHEELS/: run scripts/fetch_gpu_wheels.sh" \
        "(PYVER=${PYV:0:1}.${PYV:1}) where there is network and carry $WHEELS/"
    exit 2
  fi
  install_wheel "$whl" || exit 2
  if [ "$DRY" = 0 ] && ! imports megatron.core; then
    say "megatron-core from $whl does not import:"
    PYTHONPATH="$DEPS_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import megatron.core" 2>&1 | tail -1
    exit 2
  fi
fi
if imports pytest; then
  say "pytest: present"
else
  for w in "$WHEELS"/pytest-*.whl "$WHEELS"/pluggy-*.whl "$WHEELS"/iniconfig-*.whl "$WHEELS"/pygments-*.whl; do
    [ -f "$w" ] || { say "pytest missing and $w not carried: run scripts/fetch_gpu_wheels.sh"; exit 2; }
    install_wheel "$w" || exit 2
  done
fi

# 2. What it lacks and skips.
for mod in vllm:"tests/gpu/test_vllm_gpu.py" \
           sglang:"tests/gpu/test_sglang_gpu.py and test_cluster_paths_gpu.py's TP2 test (its CUDA-IPC payload test runs without SGLang)" \
           transformer_engine:"the TE layer spec and test_te_attention_gpu.py (the tests choose the torch attention: model.attention_backend=torch)" \
           apex:"Apex fused kernels (torch's run instead)"; do
  name=${mod%%:*}; what=${mod#*:}
  if has "$name"; then say "$name: present"; else say "$name: not installed -> skipped: $what"; fi
done

[ "$SETUP_ONLY" = 1 ] && { say "setup done in $(( $(date +%s) - start )) s"; exit 0; }

# 3. The tests, within the budget.
export PYTHONPATH="$DEPS_DIR:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false
# Two runs, the cluster paths first (one pytest run would collect them in file order), then the
# rest of tests/gpu, within one budget.
FIRST=(tests/gpu/test_cluster_paths_gpu.py tests/gpu/test_sglang_gpu.py tests/gpu/test_vllm_gpu.py)
pytest_run() {  # seconds, pytest arguments...
  timeout --signal=INT --kill-after=20 "$1" "$PY" -m pytest -q -p no:cacheprovider -rs --durations=10 "${@:2}"
}
if [ "$DRY" = 1 ]; then
  say "would run (PYTHONPATH=$PYTHONPATH), first: pytest ${FIRST[*]} ${EXTRA[*]}"
  say "then: pytest tests/gpu ${FIRST[*]/#/--ignore=} ${EXTRA[*]} (budget ${BUDGET} s for both)"
  exit 0
fi
say "setup took $(( $(date +%s) - start )) s; running the cluster paths, then tests/gpu (budget ${BUDGET} s)"
t0=$(date +%s)
pytest_run "$BUDGET" "${FIRST[@]}" "${EXTRA[@]}"
rc=$?
left=$(( BUDGET - ($(date +%s) - t0) ))
if [ $rc != 124 ] && [ $left -gt 0 ]; then
  pytest_run "$left" tests/gpu "${FIRST[@]/#/--ignore=}" "${EXTRA[@]}"
  rest=$?
  [ $rc = 0 ] || [ $rc = 5 ] && rc=$rest
fi
[ $rc = 124 ] && say "the test run hit the ${BUDGET} s budget"
say "done in $(( $(date +%s) - start )) s, exit $rc"
exit $rc
