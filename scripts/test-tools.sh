#!/usr/bin/env bash
# Tools the deployment tests call: promtool + prometheus (Debian's `prometheus` package) and
# kubectl (kustomize). Installs prometheus when missing and we are root; never starts its daemon.
#   POLICY_RC_D=/usr/sbin/policy-rc.d   the file that tells Debian's maintainer scripts whether
#                                       they may start services (a knob for the tests)
set -euo pipefail
POLICY_RC_D=${POLICY_RC_D:-/usr/sbin/policy-rc.d}

# policy-rc.d answers 101 ("not allowed") for the install, so the package does not start a
# system-wide prometheus on :9090. Whatever the file held before comes back on every exit.
backup_dir=""
restore_policy() {
  if [ -e "$backup_dir/policy-rc.d" ] || [ -L "$backup_dir/policy-rc.d" ]; then
    mv -f "$backup_dir/policy-rc.d" "$POLICY_RC_D"
  else
    rm -f "$POLICY_RC_D"
  fi
  rm -rf "$backup_dir"
}
deny_service_starts() {
  backup_dir=$(mktemp -d)
  if [ -e "$POLICY_RC_D" ] || [ -L "$POLICY_RC_D" ]; then
    cp -a "$POLICY_RC_D" "$backup_dir/policy-rc.d"
  fi
  # NOTE: the trap only after the copy: until then the original is untouched.
  trap restore_policy EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  rm -f "$POLICY_RC_D"  # a symlink would otherwise send our policy to its target
  printf '#!/bin/sh\nexit 101\n' >"$POLICY_RC_D"
  chmod +x "$POLICY_RC_D"
}

if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test-tools: installing Debian's prometheus (promtool) ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    deny_service_starts
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "test-tools: promtool not found and cannot install it (need root + apt-get)" >&2
  fi
fi
command -v kubectl >/dev/null 2>&1 || echo "test-tools: kubectl not found (kustomize tests will fail)" >&2
exit 0
