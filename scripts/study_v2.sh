#!/usr/bin/env bash
# Study v2 in the background (docs/study.md, "Study v2"): every method x 3 seeds on hop_path, one run
# at a time at the lowest priority, in the order that answers the goals first (GRPO, STARE C2, DAPO
# on every seed, then STARE O1, then the other baselines). Resumable: each finished (seed, method)
# run is recorded atomically as docs/study_v2/results/seed<k>/<method>.json and skipped next time;
# a killed run restarts from its beginning. After each stage the report (study.md, study.json,
# figures) is rebuilt from the recorded results and copied to docs/study_v2/.
#
# Usage: nohup scripts/study_v2.sh > runs/study_v2.log 2>&1 &
# Commit what has landed:   git add docs/study_v2 && git commit -m "study v2: results so far"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/study_v2}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
# "seeds|methods": seed 0 first (its warm start is ready soonest), then the other seeds' warm starts.
STAGES=("0|grpo stare_c2 dapo" "0 1 2|grpo stare_c2 dapo" "0 1 2|stare_o1" "0 1 2|gspo cispo forking_tokens"
        "0 1 2|entropy_bonus clip_cov kl_cov gepo")
publish() {
  nice -n 19 "$PY" -m megatron_stare.study.v2 --task hop_path --out "$OUT" --report-only "$@" > /dev/null
  mkdir -p docs/study_v2
  cp "$OUT"/study.md "$OUT"/study.json docs/study_v2/
  cp "$OUT"/fig_*.png docs/study_v2/ 2>/dev/null || true
}
for stage in "${STAGES[@]}"; do
  seeds=${stage%%|*} methods=${stage#*|}
  # shellcheck disable=SC2086
  nice -n 19 "$PY" -m megatron_stare.study.v2 --task hop_path --out "$OUT" --jobs 1 --seeds $seeds --methods $methods
  publish
done
echo "[study_v2] every stage done"
