#!/usr/bin/env bash
# Resumable: rerun this script; checkpoint.resume=auto picks up runs/v3/<method>/ckpt.
set -euo pipefail
cd /work/main
METHOD=${1:-grpo}; TARGET=${2:-0.0}; shift 2 || true
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
OV=$(.venv/bin/python -c "from megatron_stare.demo.study_methods import method_overrides as m; import sys; print(' '.join(m(sys.argv[1], shared=('optimizer.lr=1e-4','trainer.prompts_per_step=8'))))" $METHOD)
exec nice -n 10 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_stare.train   --config examples/study_real_cpu.yaml model.path=/root/.cache/megatron-stare/models/smollm2-135m-instruct data.train_path=runs/v3/data/train.parquet   data.eval_path=runs/v3/data/test.parquet logging.dir=runs/v3/$METHOD checkpoint.dir=runs/v3/$METHOD/ckpt   $OV algorithm.stare.target_entropy=$TARGET "$@"
