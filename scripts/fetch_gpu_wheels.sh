#!/usr/bin/env bash
# Download, HERE (a machine with network), the wheels that scripts/gpu_check.sh installs on a GPU
# machine that has CUDA torch, Triton and transformers but no network and no megatron-core:
#   megatron-core 0.16.1 (CPython 3.12, manylinux x86-64; needs torch, numpy, packaging, which the
#   GPU machine has) and pytest with its pure-Python dependencies (in case the machine lacks it).
# The wheels land in an ignored folder (default wheels/); carry it to the GPU machine, e.g. with
# the device tool: run(command="bash scripts/gpu_check.sh", carry=["wheels"]).
#
# Usage: scripts/fetch_gpu_wheels.sh [OUT_DIR]
#   env PYVER (default 3.12) and PLATFORM (default manylinux_2_28_x86_64) describe the GPU machine.
# PyPI names the megatron-core 0.16.1 wheel megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64
# .manylinux_2_28_x86_64.whl: ask for manylinux_2_28 (pip matches --platform exactly, so the older
# spelling manylinux2014_x86_64 finds nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-wheels}
PYVER=${PYVER:-3.12}
PLATFORM=${PLATFORM:-manylinux_2_28_x86_64}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT"
dl() { "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
         --python-version "$PYVER" -d "$OUT" "$@"; }
dl --implementation cp --platform "$PLATFORM" megatron-core==0.16.1
# Pure-Python (py3-none-any): any platform matches.
dl pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0
ls -1 "$OUT"
