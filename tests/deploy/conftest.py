"""Fixtures of tests/deploy: the validators' locations and the rendered deployment files.

The validators are installed by .ci/install-deploy-tools.sh. A missing one fails the test under
CI (CI set) and skips it elsewhere, with the command that installs it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import kustomize_lite
import pytest
import yaml
from deployment import REPO, VENV_BIN, compose_config, run_tool

INSTALL_HINT = "run .ci/install-deploy-tools.sh with the project venv active"
CHECKOV_DEFAULT = Path(os.environ.get("GRPC_PS_TOOLS", "/opt/grpc-ps-tools")) / "checkov" / "bin" / "checkov"


def find_tool(name: str, *extra: Path) -> str | None:
    """``name`` from the venv, then ``extra`` paths, then PATH."""
    for candidate in (VENV_BIN / name, *extra):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


def require_tool(name: str, *extra: Path) -> str:
    path = find_tool(name, *extra)
    if path:
        return path
    message = f"{name} not found: {INSTALL_HINT}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def docker_compose() -> str:
    return require_tool("docker-compose")


@pytest.fixture(scope="session")
def kubectl() -> str | None:
    """kubectl when installed; the tests fall back to kustomize_lite without it."""
    return find_tool("kubectl")


@pytest.fixture(scope="session")
def compose_model(docker_compose: str) -> dict[str, Any]:
    """``docker-compose config`` of docker-compose.yml with the tokens of .env.example."""
    return compose_config(docker_compose, REPO / ".env.example")


@pytest.fixture(scope="session")
def rendered_k8s(kubectl: str | None) -> list[dict[str, Any]]:
    """deploy/k8s rendered by ``kubectl kustomize`` (or kustomize_lite without kubectl)."""
    if kubectl is None:
        return kustomize_lite.build(REPO / "deploy" / "k8s")
    done = run_tool([kubectl, "kustomize", str(REPO / "deploy" / "k8s")], timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="session")
def rendered_k8s_file(rendered_k8s: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("k8s") / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(rendered_k8s, sort_keys=False))
    return path
