#!/usr/bin/env bash
# The test command: bootstraps the environment if needed, then runs the whole suite on CPU.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not slow" -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
