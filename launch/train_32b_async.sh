#!/usr/bin/env bash
# STARE-O1 on Qwen2.5-32B (base), long-CoT math RL, asynchronous (trainer.staleness 1) on
# disaggregated nodes: ENGINE_NODES nodes of vLLM servers and the rest of Megatron training.
#
# Defaults: 4 nodes x 8 GPUs x 80 GB; node ranks 0-1 train (torchrun, Megatron TP 8 x PP 2), node
# ranks 2-3 serve (one vLLM server of TP 8 per node, on GPUs of its own, awake all the time). The
# trainer's rank 0 attaches to every server (rollout.server_urls, built from ENGINE_HOSTS), sends
# the generation requests (the next step's batch generates while this step trains) and, at each
# step boundary, broadcasts the new weights over one NCCL group into all servers' workers.
# Run it once per node, the same way on every node:
#
#   NNODES=4 NODE_RANK=<r> MASTER_ADDR=node0 ENGINE_HOSTS=node2,node3 MODEL_DIR=/models/Qwen2.5-32B \
#     launch/train_32b_async.sh
#
# Engine nodes start their servers with the command `python -m megatron_stare.rollout.server_cmd`
# prints for this config (the trainer checks on attaching that each honours the run's spec);
# training nodes wait (up to ENGINE_WAIT_S, default 1800 s) until every server answers /health,
# then start torchrun. Stopping: end the training job, then the engine nodes' scripts (SIGTERM).
#
# Usage: launch/train_32b_async.sh [--dry-run] [--print-cmd] [a.b=c ...]
#   --dry-run    print the trainer's parallel plan and per-GPU memory estimate (no GPU needed; the
#                servers run on GPUs of their own and cost the trainer's nothing; exit 0 fits, 3
#                does not fit, 2 config error). HF config: $MODEL_DIR/config.json, else
#                examples/configs/qwen2.5-32b.json.
#   --print-cmd  print this node's command (torchrun on a training node, the server(s) on an
#                engine node) and exit.
#   a.b=c        extra overrides, applied last, on every node (the servers honour them too).
# Environment: NNODES (all nodes) ENGINE_NODES (default 2) NODE_RANK MASTER_ADDR (required when the
#              training nodes are > 1) MASTER_PORT MASTER_WAIT_S ENGINE_HOSTS (comma-separated hosts of
#              the engine nodes, in node-rank order; required to train) ENGINE_PORT (default 8000;
#              a node's servers listen on ENGINE_PORT, ENGINE_PORT+1, ...) ENGINE_WAIT_S GPUS_PER_NODE
#              GPU_MEM_GB MODEL_DIR DATA_DIR RUN_DIR VENV (see launch/common.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NNODES=${NNODES:-4}
ENGINE_NODES=${ENGINE_NODES:-2}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-}            # node rank 0's host (required when the training nodes are > 1)
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
GPU_MEM_GB=${GPU_MEM_GB:-80}
ENGINE_HOSTS=${ENGINE_HOSTS:-}          # required to train: the engine nodes' hosts, comma-separated
ENGINE_PORT=${ENGINE_PORT:-8000}
ENGINE_TP=${ENGINE_TP:-8}
ENGINE_WAIT_S=${ENGINE_WAIT_S:-1800}
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-32B}
DATA_DIR=${DATA_DIR:-/data}
RUN_DIR=${RUN_DIR:-runs/qwen2.5-32b-stare-async}
CONFIG=examples/qwen2.5_32b_async.yaml
FALLBACK_HF_CONFIG=examples/configs/qwen2.5-32b.json

source launch/common.sh
parse_args "$@"

TRAIN_NODES=$((NNODES - ENGINE_NODES))
(( ENGINE_NODES >= 1 && TRAIN_NODES >= 1 )) || fail "NNODES=$NNODES with ENGINE_NODES=$ENGINE_NODES leaves no training or no engine node; set NNODES > ENGINE_NODES >= 1"
(( GPUS_PER_NODE % ENGINE_TP == 0 )) || fail "ENGINE_TP=$ENGINE_TP does not divide GPUS_PER_NODE=$GPUS_PER_NODE; one node holds whole servers"
SERVERS_PER_NODE=$((GPUS_PER_NODE / ENGINE_TP))
# The servers' URLs: every engine node's servers, in node order (placeholders engine0, engine1, ...
# for --dry-run and --print-cmd when ENGINE_HOSTS is not set).
if [[ -n $ENGINE_HOSTS ]]; then
  IFS=, read -r -a HOSTS <<< "$ENGINE_HOSTS"
  (( ${#HOSTS[@]} == ENGINE_NODES )) || fail "ENGINE_HOSTS lists ${#HOSTS[@]} host(s) but ENGINE_NODES=$ENGINE_NODES; list one host per engine node"
elif [[ $MODE == train ]]; then
  fail "ENGINE_HOSTS is not set; set it to the engine nodes' hosts, comma-separated (e.g. ENGINE_HOSTS=node2,node3)"
else
  HOSTS=()
  for ((i = 0; i < ENGINE_NODES; i++)); do HOSTS+=("engine$i"); done
fi
URLS=()
for host in "${HOSTS[@]}"; do
  for ((j = 0; j < SERVERS_PER_NODE; j++)); do URLS+=("http://$host:$((ENGINE_PORT + j))"); done
done
SERVER_URLS="[$(IFS=,; echo "${URLS[*]}")]"

MODEL_ARGS=(
  model.path="$MODEL_DIR"
  model.dtype=bfloat16
)
# TP 8 = the 8 KV heads (one per rank) inside an NVLink node; PP 2 over the two training nodes.
# CP 1: with 16 training GPUs tp*pp already uses them all, and a ~22.5k-token sequence fits one
# rank with full recompute and sequence parallel (~43 GiB peak on 80 GB: see --dry-run).
PARALLEL_ARGS=(
  parallel.tp=8
  parallel.pp=2
  parallel.cp=1
  parallel.sequence_parallel=true
  parallel.distributed_optimizer=true
  parallel.recompute=full
  parallel.micro_batch_tokens=24576
)
# The engines: vLLM servers attached from the engine nodes, on GPUs of their own (so they may take
# 0.9 of them), one TP-8 server per node by default.
ROLLOUT_ARGS=(
  rollout.engine=vllm-server
  rollout.server_urls="$SERVER_URLS"
  rollout.tp="$ENGINE_TP"
  rollout.gpu_memory_utilization=0.9
  rollout.n=8
  rollout.temperature=1.0
  rollout.top_p=1.0
  rollout.max_new_tokens=20480
  rollout.sync_bucket_mb=1024
  rollout.eval_n=32
  rollout.eval_temperature=1.0
  rollout.eval_top_p=0.7
  reward.fn=math
  reward.overlong_buffer_len=4096
  reward.overlong_penalty_factor=1.0
)
# STARE-O1 with the 14B/32B weights W 1.05, M 0.95: O1 is the paper's 32B headline (AIME24/25
# 43.3/34.1), and M only acts in C2 (algorithm.stare.variant=C2 to attenuate L- as well).
ALGO_ARGS=(
  algorithm.adv_estimator=grpo
  algorithm.norm_adv_by_std=true
  algorithm.policy_loss=stare
  algorithm.loss_agg_mode=token-mean
  algorithm.clip_ratio_low=0.2
  algorithm.clip_ratio_high=0.28
  algorithm.clip_ratio_c=10.0
  algorithm.entropy_coeff=0.0
  algorithm.kl_loss_coef=0.0
  algorithm.stare.variant=O1
  algorithm.stare.top_p=0.1
  algorithm.stare.w=1.05
  algorithm.stare.m=0.95
  algorithm.stare.target_entropy=0.3
  algorithm.stare.selection_scope=global
  trainer.prompts_per_step=64
  trainer.mini_batches_per_step=1
  trainer.dynamic_sampling=false
  trainer.total_steps=400
)
# Bounded staleness 1 (docs/async.md): step t+1's batch generates, under the weights of step t,
# while step t trains; a sample is at most one policy version old. The off-policy correction uses
# the engine's behaviour log-probs: TIS capped at 2 and a token mask outside the ratio band [0.5, 2].
# DAPO dynamic sampling is off: a step's extra generation batches cannot be drawn ahead.
ASYNC_ARGS=(
  trainer.staleness=1
  algorithm.off_policy_correction=tis+band_mask
  algorithm.off_policy.tis_cap=2.0
  algorithm.off_policy.band_low=0.5
  algorithm.off_policy.band_high=2.0
)
OPTIMIZER_ARGS=(
  optimizer.lr=1e-6
  optimizer.weight_decay=0.1
  optimizer.clip_grad=1.0
  optimizer.lr_schedule=constant
  optimizer.warmup_steps=10
)
# The data files, in verl's format (chat-message prompts, reward_model.ground_truth), from the
# published DAPO-Math-17k and AIME-2024 parquet files:
#   python -m megatron_stare.data.prepare --format dapo dapo-math-17k.parquet "$DATA_DIR/dapo-math-17k.parquet"
#   python -m megatron_stare.data.prepare --format aime --split test aime-2024.parquet "$DATA_DIR/aime-2024.parquet"
DATA_ARGS=(
  data.train_path="$DATA_DIR/dapo-math-17k.parquet"
  data.eval_path="$DATA_DIR/aime-2024.parquet"
  data.prompt_key=prompt
  data.answer_key=reward_model.ground_truth
  data.max_prompt_length=2048
)
CKPT_ARGS=(
  checkpoint.dir="$RUN_DIR/ckpt"
  checkpoint.save_every=20
  checkpoint.async_save=true
  checkpoint.keep_last=3
)
LOG_ARGS=(
  logging.dir="$RUN_DIR/logs"
  trainer.eval_every=10
)
ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${ALGO_ARGS[@]}" "${ASYNC_ARGS[@]}"
      "${OPTIMIZER_ARGS[@]}" "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}"
      ${EXTRA[@]+"${EXTRA[@]}"})

# serve_engines: this engine node's servers (the command server_cmd prints for the run's config,
# each on its ENGINE_TP GPUs and its port), printed (--print-cmd) or started and waited for.
serve_engines() {
  local j first line pids=()
  for ((j = 0; j < SERVERS_PER_NODE; j++)); do
    first=$((j * ENGINE_TP))
    line=$("$RUN_PY" -m megatron_stare.rollout.server_cmd --config "$CONFIG" --host 0.0.0.0 \
             --port $((ENGINE_PORT + j)) "${ARGS[@]}") || exit $?
    line="CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + ENGINE_TP - 1))) $line"
    if [[ $MODE == print ]]; then echo "$line"; continue; fi
    mkdir -p "$RUN_DIR"
    echo "engine node $((NODE_RANK - TRAIN_NODES)): server $j on port $((ENGINE_PORT + j)) (log: $RUN_DIR/server_${NODE_RANK}_$j.log)"
    bash -c "exec env $line" > "$RUN_DIR/server_${NODE_RANK}_$j.log" 2>&1 &
    pids+=($!)
  done
  [[ $MODE == print ]] && exit 0
  trap 'kill "${pids[@]}" 2>/dev/null || true' TERM INT
  local rc=0
  wait -n "${pids[@]}" || rc=$?  # one server gone ends the node: the trainer will fail on it
  kill "${pids[@]}" 2>/dev/null || true
  wait || true
  exit "$rc"
}

# wait_for_engines: every server answers /health (the trainer's rank 0 attaches at start-up).
wait_for_engines() {
  "$RUN_PY" - "$ENGINE_WAIT_S" "${URLS[@]}" <<'PY' || exit $?
import sys, time, urllib.request
wait_s, urls = float(sys.argv[1]), sys.argv[2:]
deadline = time.monotonic() + wait_s
for url in urls:
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"error: engine server {url} not up after {wait_s:.0f}s (ENGINE_WAIT_S); check the engine nodes' logs")
        time.sleep(5)
PY
}

if [[ $MODE != plan && $NODE_RANK -ge $TRAIN_NODES ]]; then
  serve_engines
fi
NNODES=$TRAIN_NODES  # torchrun and the plan see the training nodes only
[[ $MODE == train ]] && wait_for_engines
launch_multinode
