#!/usr/bin/env bash
# The tiny CPU run: a 2-layer random-init Qwen2-style model, STARE-O1, 2 gloo ranks with TP 2 and
# the embedded `hf` engine (examples/tiny_cpu.yaml). Minutes on a laptop; no GPU, no downloads.
#
# Runs `python -m megatron_stare.run --standalone --nproc-per-node 2 --config
# examples/tiny_cpu.yaml` with the settings below as a.b=c overrides grouped by concern. If
# $TINY_DIR/model or $TINY_DIR/train.jsonl is missing it is built first (a tiny checkpoint from
# megatron_stare.models.tiny and an arithmetic prompt set with exact-match answers).
#
# Usage: launch/train_tiny_cpu.sh [--dry-run] [--print-cmd] [a.b=c ...]
#   --dry-run    print the parallel plan and memory estimate instead of training (builds nothing;
#                the HF config is $TINY_DIR/model/config.json, else the tiny model's defaults).
#   --print-cmd  print the training command and exit.
#   a.b=c        extra overrides, applied last (e.g. trainer.total_steps=5).
# Environment: NPROC (2) GPU_MEM_GB TINY_DIR (runs/tiny) VENV (the environment that runs it: default
#              .venv, see launch/common.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NPROC=${NPROC:-2}
GPU_MEM_GB=${GPU_MEM_GB:-80}
TINY_DIR=${TINY_DIR:-runs/tiny}
CONFIG=examples/tiny_cpu.yaml

source launch/common.sh
parse_args "$@"

MODEL_ARGS=(
  model.path="$TINY_DIR/model"
  model.dtype=float32
)
PARALLEL_ARGS=(
  parallel.tp=2
  parallel.pp=1
)
ROLLOUT_ARGS=(
  rollout.engine=hf
  rollout.n=8
  rollout.max_new_tokens=16
)
ALGO_ARGS=(
  algorithm.policy_loss=stare
  algorithm.stare.variant=O1
  trainer.prompts_per_step=8
  trainer.total_steps=20
)
OPTIMIZER_ARGS=(
  optimizer.lr=1e-4
)
DATA_ARGS=(
  data.train_path="$TINY_DIR/train.jsonl"
)
CKPT_ARGS=(
  checkpoint.dir="$TINY_DIR/ckpt"
)
LOG_ARGS=(
  logging.dir="$TINY_DIR/logs"
)
ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${ALGO_ARGS[@]}"
      "${OPTIMIZER_ARGS[@]}" "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}"
      ${EXTRA[@]+"${EXTRA[@]}"})

if [[ $MODE == plan ]]; then
  HF_CONFIG=$TINY_DIR/model/config.json
  if [[ ! -f $HF_CONFIG ]]; then
    # The defaults of megatron_stare.models.tiny.build_tiny_hf_model("qwen2", ...).
    HF_CONFIG=$(mktemp "${TMPDIR:-/tmp}/tiny-config.XXXXXX")
    trap 'rm -f "$HF_CONFIG"' EXIT
    cat >"$HF_CONFIG" <<'JSON'
{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
 "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
 "rope_theta": 1000000.0, "tie_word_embeddings": false, "vocab_size": 397}
JSON
  fi
  rc=0
  "$RUN_PY" -m megatron_stare.plan --config "$CONFIG" --world-size "$NPROC" \
    --gpu-mem-gb "$GPU_MEM_GB" --hf-config "$HF_CONFIG" "${ARGS[@]}" || rc=$?
  exit $rc
fi

CMD=("$RUN_PY" "${LAUNCH[@]}" --standalone --nproc-per-node "$NPROC" "${TORCHRUN_SIGNALS[@]}"
     --config "$CONFIG" "${ARGS[@]}")
if [[ $MODE == print ]]; then
  print_cmd "${CMD[@]}"
  exit 0
fi

if [[ ! -f $TINY_DIR/model/config.json || ! -f $TINY_DIR/train.jsonl ]]; then
  TINY_DIR=$TINY_DIR "$RUN_PY" - <<'PY'
import json, os, random
from pathlib import Path
from megatron_stare.models.tiny import build_tiny_hf_model

root = Path(os.environ["TINY_DIR"])
if not (root / "model" / "config.json").is_file():
    build_tiny_hf_model("qwen2", root / "model")
if not (root / "train.jsonl").is_file():
    rng = random.Random(0)
    with open(root / "train.jsonl", "w", encoding="utf-8") as f:
        for _ in range(512):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
print(f"prepared {root}")
PY
fi
"$RUN_PY" -m megatron_stare.config --quiet --config "$CONFIG" --world-size "$NPROC" "${ARGS[@]}" || exit $?
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
run_torchrun "${CMD[@]}"
