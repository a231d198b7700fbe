#!/usr/bin/env bash
# Study v3 runs on one GPU machine lent for minutes (the device tool: no network, no vLLM, no
# megatron-core, Python 3.12 with CUDA torch and transformers). The model travels as the packaged
# Q4_1 GGUF in three pieces (the tool carries at most 64 MiB a call), so this takes three calls on
# one warm machine, issued back to back:
#   run(command="bash docs/study_v3/gpu_runs.sh stash a", carry=[".gpu_model/a"])
#   run(command="bash docs/study_v3/gpu_runs.sh stash b", carry=[".gpu_model/b"])
#   run(command="bash docs/study_v3/gpu_runs.sh run SECONDS JOBS 'SEEDS' 'METHODS'",
#       carry=[".gpu_model/c", ".gpu_model/tok", "wheels"])
# Here, beforehand: scripts/fetch_gpu_wheels.sh (+ the gguf wheel into wheels/), and
#   split -n 3 -d <the bootstrap's GGUF> into .gpu_model/{a,b,c}/, the model directory's other files
#   into .gpu_model/tok/ (.gpu_model/ is in .git/info/exclude).
# The runs (python -m megatron_stare.study.v3 --gpu) stop at the deadline; what they ran comes
# back in $OUT/results_gpu.tgz (docs/study_v3/results_gpu/ once unpacked here) with their logs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
STASH=/tmp/gguf_parts
case "${1:-}" in
  stash)
    mkdir -p $STASH && cp .gpu_model/"$2"/* $STASH/ && ls -la $STASH && nvidia-smi -L ;;
  run)
    SECONDS_LEFT=${2:-420}; JOBS=${3:-9}; SEEDS=${4:-"1 2 3"}; METHODS=${5:-"grpo stare_c2 dapo"}
    cp .gpu_model/c/* $STASH/
    cat $STASH/gpart_0* > /tmp/model.gguf
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      wheels/megatron_core-*.whl wheels/gguf-*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    python3 docs/study_v3/gpu_model.py /tmp/model.gguf .gpu_model/tok /tmp/model
    set +e
    # shellcheck disable=SC2086
    python3 -m megatron_stare.study.v3 --gpu --model /tmp/model --out /tmp/v3 --results /tmp/results_gpu \
      --jobs "$JOBS" --seeds $SEEDS --methods $METHODS --deadline-s "$SECONDS_LEFT" 2>&1 | tail -60
    rc=${PIPESTATUS[0]}
    tar czf "$OUT/results_gpu.tgz" -C /tmp results_gpu
    (cd /tmp/v3 && tar czf "$OUT/logs.tgz" --exclude='*.safetensors' --exclude=ckpt seed*)
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
    exit $rc ;;
  *) echo "usage: $0 stash a|b|c | run [SECONDS] [JOBS] [SEEDS] [METHODS]" >&2; exit 2 ;;
esac
