#!/usr/bin/env bash
# The STARE paper's 7B short-CoT recipe (docs/anchors.md), STARE-O1, on one node of 8 GPUs.
#
# Runs `python -m megatron_stare.train --config examples/qwen2.5_7b_shortcot.yaml` under torchrun,
# with the recipe stated below as a.b=c overrides grouped by concern: GRPO advantages with std
# normalisation, no KL, no entropy bonus, token-mean, lr 1e-6, 64 prompts x 8 responses, dynamic
# sampling (up to 10 generation batches), max response 3072, clip 0.2/0.28 with dual clip 10,
# on-policy, temperature 1.0, grad clip 1.0, STARE W 1.1, M 0.9, H_tgt 0.3, P 0.1; eval avg@32 at
# temperature 1.0, top-p 0.7. The model is Qwen2.5-Math-7B (4096-token context = 1024 + 3072; its
# config.json is examples/configs/qwen2.5-7b.json); Qwen2.5-7B base works unchanged (MODEL_DIR).
# Not expressible yet: the reference generates 3 x 64 prompts per generation batch; the trainer has
# no generation-batch setting, so each generation batch is trainer.prompts_per_step prompts.
#
#   MODEL_DIR=/models/Qwen2.5-Math-7B DATA_DIR=/data launch/train_7b_shortcot.sh
#
# Usage: launch/train_7b_shortcot.sh [--dry-run] [--print-cmd] [a.b=c ...]
#   --dry-run    print the parallel plan and per-GPU memory estimate instead of training (no GPU
#                needed; exit 0 fits, 3 does not fit, 2 config error). The HF config comes from
#                $MODEL_DIR/config.json, else examples/configs/qwen2.5-7b.json.
#   --print-cmd  print the training command and exit.
#   a.b=c        extra overrides, applied last (e.g. algorithm.stare.variant=C2).
# Environment: NNODES NODE_RANK MASTER_ADDR (required when NNODES > 1) MASTER_PORT MASTER_WAIT_S
#              GPUS_PER_NODE GPU_MEM_GB MODEL_DIR DATA_DIR RUN_DIR VENV (the environment that runs
#              it: default .venv, see launch/common.sh).
# Before torchrun starts, the node checks that it can reach MASTER_ADDR:MASTER_PORT (node rank > 0
# waits up to MASTER_WAIT_S, default 120 s, for node 0) and validates the config: one line, exit 2.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-}            # required when NNODES > 1: node rank 0's host
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
GPU_MEM_GB=${GPU_MEM_GB:-80}
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-Math-7B}
DATA_DIR=${DATA_DIR:-/data}
RUN_DIR=${RUN_DIR:-runs/qwen2.5-7b-stare-shortcot}
CONFIG=examples/qwen2.5_7b_shortcot.yaml
FALLBACK_HF_CONFIG=examples/configs/qwen2.5-7b.json

source launch/common.sh
parse_args "$@"

MODEL_ARGS=(
  model.path="$MODEL_DIR"
  model.dtype=bfloat16
)
# TP 2 (4 KV heads) x DP 4 on 8 GPUs: a TP-2 stage with the distributed optimizer holds ~32 GiB
# of trainer state, which leaves the colocated engine ~36 GiB (see --dry-run). Full recompute:
# 28 layers of 16k-token micro-batches would otherwise keep ~35 GiB of activations.
PARALLEL_ARGS=(
  parallel.tp=2
  parallel.pp=1
  parallel.cp=1
  parallel.sequence_parallel=true
  parallel.distributed_optimizer=true
  parallel.recompute=full
  parallel.micro_batch_tokens=16384
)
ROLLOUT_ARGS=(
  rollout.engine=vllm
  rollout.tp=2
  rollout.gpu_memory_utilization=0.45
  rollout.n=8
  rollout.temperature=1.0
  rollout.top_p=1.0
  rollout.max_new_tokens=3072
  rollout.sync_bucket_mb=512
  rollout.eval_n=32
  rollout.eval_temperature=1.0
  rollout.eval_top_p=0.7
  reward.fn=math
  reward.overlong_buffer_len=0
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
  algorithm.stare.w=1.1
  algorithm.stare.m=0.9
  algorithm.stare.target_entropy=0.3
  algorithm.stare.selection_scope=global
  trainer.prompts_per_step=64
  trainer.mini_batches_per_step=1
  trainer.ppo_epochs=1
  trainer.dynamic_sampling=true
  trainer.max_gen_batches=10
  trainer.total_steps=500
)
OPTIMIZER_ARGS=(
  optimizer.lr=1e-6
  optimizer.clip_grad=1.0
  optimizer.lr_schedule=constant
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
  data.max_prompt_length=1024
)
CKPT_ARGS=(
  checkpoint.dir="$RUN_DIR/ckpt"
  checkpoint.save_every=50
  checkpoint.keep_last=3
)
LOG_ARGS=(
  logging.dir="$RUN_DIR/logs"
  trainer.eval_every=20
)
ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${ALGO_ARGS[@]}"
      "${OPTIMIZER_ARGS[@]}" "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}"
      ${EXTRA[@]+"${EXTRA[@]}"})

launch_multinode
