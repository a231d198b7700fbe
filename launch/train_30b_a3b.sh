#!/usr/bin/env bash
# STARE-O1 on Qwen3-30B-A3B (mixture of experts: 128 experts, top-8) with rollout routing replay
# (R3), multi-node.
#
# Runs `python -m megatron_stare.train --config examples/qwen3_30b_a3b.yaml` under torchrun on
# every node, with the recipe stated below as a.b=c overrides grouped by concern. Defaults: 4 nodes
# x 8 GPUs x 80 GB (2 nodes also fit: see the MoE paragraph of the README). Run it once per node:
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 MODEL_DIR=/models/Qwen3-30B-A3B-Base launch/train_30b_a3b.sh
#
# Usage: launch/train_30b_a3b.sh [--dry-run] [--print-cmd] [a.b=c ...]
#   --dry-run    print the parallel plan and per-GPU memory estimate (expert weights and their
#                optimizer state under EP, the dispatcher's buffers, the routing-replay tensors)
#                instead of training (no GPU needed; exit 0 fits, 3 does not fit, 2 config error).
#                The HF config comes from $MODEL_DIR/config.json, else examples/configs/qwen3-30b-a3b.json.
#   --print-cmd  print the training command and exit.
#   a.b=c        extra overrides, applied last (e.g. rollout.routing_replay=r2).
# Environment: NNODES NODE_RANK MASTER_ADDR (required when NNODES > 1) MASTER_PORT MASTER_WAIT_S
#              GPUS_PER_NODE GPU_MEM_GB MODEL_DIR DATA_DIR RUN_DIR VENV (see launch/common.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NNODES=${NNODES:-4}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-}            # required when NNODES > 1: node rank 0's host
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
GPU_MEM_GB=${GPU_MEM_GB:-80}
MODEL_DIR=${MODEL_DIR:-/models/Qwen3-30B-A3B-Base}
DATA_DIR=${DATA_DIR:-/data}
RUN_DIR=${RUN_DIR:-runs/qwen3-30b-a3b-stare}
CONFIG=examples/qwen3_30b_a3b.yaml
FALLBACK_HF_CONFIG=examples/configs/qwen3-30b-a3b.json

source launch/common.sh
parse_args "$@"

MODEL_ARGS=(
  model.path="$MODEL_DIR"
  model.dtype=bfloat16
  model.moe_aux_loss_coeff=0.0
)
# EP 8: 16 whole experts per rank, expert all-to-all inside an NVLink node; EP spans the TP ranks
# (megatron-core's expert grid: etp*ep*pp = 16 divides the world), which needs sequence parallel.
# TP 2 for attention and the dense parts (4 KV heads), PP 2 (24 layers a stage). On 32 GPUs the
# dense state shards over dp 8 and the experts' optimizer state over edp = 32/(8*2) = 2.
PARALLEL_ARGS=(
  parallel.tp=2
  parallel.pp=2
  parallel.cp=1
  parallel.ep=8
  parallel.etp=1
  parallel.sequence_parallel=true
  parallel.distributed_optimizer=true
  parallel.recompute=full
  parallel.micro_batch_tokens=20480
)
# Colocated vLLM, engine TP 8 (4 instances): every expert's weights over the engine's 8 GPUs.
# R3: the engine returns each token's routed experts, the log-prob pass and every update replay them.
ROLLOUT_ARGS=(
  rollout.engine=vllm
  rollout.routing_replay=r3
  rollout.tp=8
  rollout.gpu_memory_utilization=0.5
  rollout.n=8
  rollout.temperature=1.0
  rollout.top_p=1.0
  rollout.max_new_tokens=8192
  rollout.sync_bucket_mb=1024
  rollout.eval_n=16
  rollout.eval_temperature=1.0
  rollout.eval_top_p=0.7
  reward.fn=math
  reward.overlong_buffer_len=2048
  reward.overlong_penalty_factor=1.0
)
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
  trainer.dynamic_sampling=true
  trainer.max_gen_batches=10
  trainer.total_steps=400
)
OPTIMIZER_ARGS=(
  optimizer.lr=1e-6
  optimizer.weight_decay=0.1
  optimizer.clip_grad=1.0
  optimizer.lr_schedule=constant
  optimizer.warmup_steps=10
)
# The data files: as for launch/train_32b_longcot.sh (python -m megatron_stare.data.prepare).
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
ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${ALGO_ARGS[@]}"
      "${OPTIMIZER_ARGS[@]}" "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}"
      ${EXTRA[@]+"${EXTRA[@]}"})

launch_multinode
