"""The package layering: ps_common is neutral, workers and the admin tool never import the server."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept() -> None:
    """The contracts in pyproject.toml's [tool.importlinter] hold (import-linter reads every import)."""
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.fail("lint-imports is not installed; pip install -e '.[dev]' provides it (import-linter)")
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


@pytest.mark.parametrize("module", ["ps_admin.cli", "ps_common", "ps_common.modes", "ps_common.channels"])
def test_importing_leaves_torch_unloaded(module: str) -> None:
    """ps-admin and the neutral package's light modules start without loading torch."""
    code = f"import sys, {module}; print('torch' in sys.modules, 'ps_server' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
