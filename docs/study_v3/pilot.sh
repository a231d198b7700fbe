#!/usr/bin/env bash
# Study v3's GRPO pilot (docs/study.md, "Study v3"): one method on the study mix with the shared
# settings (examples/study_real_cpu.yaml). Resumable: rerun it; checkpoint.resume=auto picks up
# runs/v3/<method>/ckpt. Usage: docs/study_v3/pilot.sh [METHOD] [TARGET] [a.b=c ...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
METHOD=${1:-grpo}; TARGET=${2:-0.0}; shift 2 || true
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
MODEL=$(.venv/bin/python -c "from megatron_stare.models.fetch import fetch; print(fetch('smollm2-135m-instruct', quiet=True))")
DATA=runs/v3/data
[[ -f $DATA/train.parquet ]] || .venv/bin/python -m megatron_stare.study.word_problems $DATA \
  --tiers $(.venv/bin/python -c "from megatron_stare.study.word_problems import STUDY_TIERS as t; print(*t)")
OV=$(.venv/bin/python -c "from megatron_stare.study.methods import method_overrides as m; import sys; print(' '.join(m(sys.argv[1], shared=('optimizer.lr=1e-4','trainer.prompts_per_step=8'))))" $METHOD)
exec nice -n 10 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_stare.train \
  --config examples/study_real_cpu.yaml model.path=$MODEL data.train_path=$DATA/train.parquet \
  data.eval_path=$DATA/test.parquet logging.dir=runs/v3/$METHOD checkpoint.dir=runs/v3/$METHOD/ckpt \
  checkpoint.resume=auto $OV algorithm.stare.target_entropy=$TARGET "$@"
