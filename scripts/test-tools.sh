#!/usr/bin/env bash
# Tools the deployment tests call: promtool + prometheus (Debian's `prometheus` package) and
# kubectl (kustomize). Installs prometheus when missing and we are root; never starts its daemon.
set -euo pipefail
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test-tools: installing Debian's prometheus (promtool) ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    # policy-rc.d keeps the package from starting a system-wide prometheus on :9090
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    rm -f /usr/sbin/policy-rc.d
  else
    echo "test-tools: promtool not found and cannot install it (need root + apt-get)" >&2
  fi
fi
command -v kubectl >/dev/null 2>&1 || echo "test-tools: kubectl not found (kustomize tests will fail)" >&2
exit 0
