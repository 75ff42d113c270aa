"""Fixtures of tests/deploy: the validators' locations and the rendered deployment files.

The validators are installed by .ci/install-deploy-tools.sh. A missing one fails the test under
CI (CI set) and skips it elsewhere, with the command that installs it.
"""

from __future__ import annotations

from typing import Any

import kustomize_lite
import pytest
import yaml
from deploy_tools import find_tool, require_tool
from deployment import REPO, compose_config, run_tool


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
def rendered_k8s_yaml(kubectl: str | None) -> str:
    """``kubectl kustomize deploy/k8s`` (or kustomize_lite's rendering without kubectl)."""
    if kubectl is None:
        return yaml.safe_dump_all(kustomize_lite.build(REPO / "deploy" / "k8s"), sort_keys=False)
    done = run_tool([kubectl, "kustomize", str(REPO / "deploy" / "k8s")], timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="session")
def rendered_k8s(rendered_k8s_yaml: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(rendered_k8s_yaml) if doc]


USER_SCRIPT_OVERLAY = REPO / "deploy" / "k8s-overlays" / "user-script"


@pytest.fixture(scope="session")
def rendered_user_script_yaml() -> str:
    """``kubectl kustomize deploy/k8s-overlays/user-script`` (patches and file generators are beyond
    kustomize_lite: this one needs kubectl, which .ci/install-deploy-tools.sh provides)."""
    kubectl = require_tool("kubectl")
    done = run_tool([kubectl, "kustomize", str(USER_SCRIPT_OVERLAY)], timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="session")
def rendered_user_script(rendered_user_script_yaml: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(rendered_user_script_yaml) if doc]
