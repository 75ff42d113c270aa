"""Where the validators that .ci/install-deploy-tools.sh installs are found.

A missing one fails the test under CI (CI set) and skips it elsewhere, naming the installer.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from deployment import VENV_BIN

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
