#!/usr/bin/env bash
# STARE-O1 on Qwen2.5-32B (base), long chain-of-thought math RL, multi-node.
#
# Runs `python -m megatron_stare.train --config examples/qwen2.5_32b_longcot.yaml` under torchrun on
# every node, with the recipe stated below as a.b=c overrides grouped by concern. Defaults: 4 nodes
# x 8 GPUs x 80 GB. Run it once per node (launch/slurm_32b.sbatch does that under SLURM):
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 MODEL_DIR=/models/Qwen2.5-32B launch/train_32b_longcot.sh
#
# Usage: launch/train_32b_longcot.sh [--dry-run] [--print-cmd] [a.b=c ...]
#   --dry-run    print the parallel plan and per-GPU memory estimate instead of training (no GPU
#                needed; exit 0 fits, 3 does not fit, 2 config error). The HF config comes from
#                $MODEL_DIR/config.json, else examples/configs/qwen2.5-32b.json.
#   --print-cmd  print the training command and exit.
#   a.b=c        extra overrides, applied last (e.g. parallel.micro_batch_tokens=32768).
# Environment: NNODES NODE_RANK MASTER_ADDR (required when NNODES > 1) MASTER_PORT MASTER_WAIT_S
#              GPUS_PER_NODE GPU_MEM_GB MODEL_DIR DATA_DIR RUN_DIR VENV (the environment that runs
#              it: default .venv, see launch/common.sh).
# Before torchrun starts, the node checks that it can reach MASTER_ADDR:MASTER_PORT (node rank > 0
# waits up to MASTER_WAIT_S, default 120 s, for node 0) and validates the config: one line, exit 2.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NNODES=${NNODES:-4}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-}            # required when NNODES > 1: node rank 0's host
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
GPU_MEM_GB=${GPU_MEM_GB:-80}
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-32B}
DATA_DIR=${DATA_DIR:-/data}
RUN_DIR=${RUN_DIR:-runs/qwen2.5-32b-stare-longcot}
CONFIG=examples/qwen2.5_32b_longcot.yaml
FALLBACK_HF_CONFIG=examples/configs/qwen2.5-32b.json

source launch/common.sh
parse_args "$@"

MODEL_ARGS=(
  model.path="$MODEL_DIR"
  model.dtype=bfloat16
)
# TP 8 = the 8 KV heads (one per rank) inside an NVLink node; CP 2 splits each ~22.5k-token
# sequence over two ranks. PP 2, not 4: with TP 8 and CP 2, PP 4 needs 64 GPUs (tp*pp*cp = 64),
# and at PP 2 a stage already fits (~72 GiB peak, in the rollout phase, on 80 GB: see --dry-run)
# with full recompute and the distributed optimizer, with a smaller 1F1B bubble than PP 4.
# On 4 nodes this leaves dp 1: the optimizer shards over dp*cp = 2 ranks.
PARALLEL_ARGS=(
  parallel.tp=8
  parallel.pp=2
  parallel.cp=2
  parallel.sequence_parallel=true
  parallel.distributed_optimizer=true
  parallel.recompute=full
  parallel.micro_batch_tokens=24576
)
# The plan's advice (--dry-run): with the trainer's state offloaded while the engine generates
# (22.9 GiB per GPU to pinned host memory, 183 GiB a node), the engine's KV cache holds 82 of a
# replica's 128 full-length sequences at once instead of 49.
ROLLOUT_ARGS=(
  rollout.engine=vllm
  rollout.tp=8
  rollout.gpu_memory_utilization=0.83
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
  trainer.dynamic_sampling=true
  trainer.max_gen_batches=10
  trainer.total_steps=400
  trainer.offload=all
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
ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${ALGO_ARGS[@]}"
      "${OPTIMIZER_ARGS[@]}" "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}"
      ${EXTRA[@]+"${EXTRA[@]}"})

launch_multinode
